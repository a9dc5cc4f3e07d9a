"""Paged-attention cases shared by the attention tests (the torch backend, the CPU kernels, the
Triton kernels): a random KV cache with scattered block tables, a sequence's context read back
from it, attention written out densely, and one step as the model runner hands it over."""

import torch

from minivllm.attention.backend import AttentionMetadata


def dense(q, keys, values, positions, scale, window=None):
    """q [n, heads, d] at ``positions`` over keys/values [len, kv_heads, d] (causal)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i, pos in enumerate(positions):
        lo = 0 if window is None else max(0, pos - window + 1)
        w = torch.softmax(torch.einsum("hd,khd->hk", q[i], k[lo:pos + 1]) * scale, dim=-1)
        out[i] = torch.einsum("hk,khd->hd", w, v[lo:pos + 1])
    return out


def paged_case(gen, seq_lens, num_kv_heads, head_dim, block_size=4, extra_width=0,
               spare_blocks=3):
    """A random cache [2, blocks, block_size, kv_heads, head_dim] holding each sequence's
    keys/values in blocks of its own, scattered over the cache (none shared, ``spare_blocks``
    left over), and its block table: one row per sequence, padded with 0 past its last block
    (as the runner pads them) up to the longest's blocks plus ``extra_width``. Drawn from the
    torch generator ``gen``."""
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(need) + extra_width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[at:at + n]
        at += n
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return cache, table


def context(cache, table, i, n):
    """The keys and values [n, kv_heads, d] of sequence ``i``'s first ``n`` tokens."""
    ids = table[i].long()
    kv = cache[:, ids].flatten(1, 2)  # [2, blocks * block_size, kv_heads, d]
    return kv[0, :n], kv[1, :n]


def step_case(gen, query_lens, seq_lens, kv_heads, heads, d, bs, num_decodes):
    """One step as the runner hands it over: the cache and block table, the step's q/k/v, its
    query start offsets, each query's position, and its ``AttentionMetadata``."""
    cache, table = paged_case(gen, seq_lens, kv_heads, d, bs)
    total = sum(query_lens)
    q = torch.randn(total, heads, d, generator=gen)
    k = torch.randn(total, kv_heads, d, generator=gen)
    v = torch.randn(total, kv_heads, d, generator=gen)
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    positions, slots = [], []
    for i, (ql, n) in enumerate(zip(query_lens, seq_lens)):
        for p in range(n - ql, n):
            positions.append(p)
            slots.append(int(table[i, p // bs]) * bs + p % bs)
    meta = AttentionMetadata(
        num_actual_tokens=total, num_decodes=num_decodes, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table,
        slot_mapping=torch.tensor(slots), query_start_loc_cpu=qsl.numpy(),
        seq_lens_cpu=torch.tensor(seq_lens).numpy())
    return cache, table, q, k, v, qsl, positions, meta
