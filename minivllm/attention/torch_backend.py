"""Paged attention in plain torch: the reference every faster backend is tested against.

Three operations, each a plain function a learner can read (chapter 03):

* ``write_to_kv_cache``      — scatter new K/V into their slots (vLLM's ``reshape_and_cache``);
* ``paged_decode_attention`` — one query per sequence, all decodes at once, context gathered
  from the blocks of each sequence's block table;
* ``paged_prefill_attention`` — variable-length query chunks, causal among the new tokens and
  attending to everything before them (a cached prefix, earlier chunks), one sequence at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.backend import AttentionBackend, AttentionMetadata


def write_to_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token t's key and value at slot ``slot_mapping[t]``; slots < 0 are skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    n = slot_mapping.shape[0]
    k, v = k[:n], v[:n]
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, d] + [seqs, blocks] -> [seqs, num_tokens, kv_heads, d]."""
    block_size = cache.shape[1]
    num_seqs = block_tables.shape[0]
    num_blocks = -(-num_tokens // block_size)
    ids = block_tables[:, :num_blocks].reshape(-1)
    # index_select copies whole blocks (contiguous memory): far faster than fancy indexing
    ctx = torch.index_select(cache, 0, ids).view(num_seqs, num_blocks * block_size, *cache.shape[2:])
    return ctx[:, :num_tokens]


def grouped_query_attention(
    q: torch.Tensor,  # [seqs, query_len, heads, d]
    k: torch.Tensor,  # [seqs, L, kv_heads, d]
    v: torch.Tensor,  # [seqs, L, kv_heads, d]
    allowed: torch.Tensor,  # [seqs, query_len, L] bool: which keys each query may see
    scale: float,
) -> torch.Tensor:  # [seqs, query_len, heads, d]
    """Softmax attention with grouped-query heads, in float32.

    The query heads that share a KV head are stacked as extra query rows, so each KV head is
    read once per sequence (no copy of K/V per query head, as ``repeat_interleave`` would make).
    """
    seqs, query_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    # rows of KV head h: (query head h*group + g, token t) for every g, t
    qg = q.view(seqs, query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(seqs, num_kv_heads, group * query_len, head_dim).float()
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1).float()) * scale  # [seqs, kv_heads, rows, L]
    visible = allowed.repeat(1, group, 1)[:, None]  # [seqs, 1, rows, L]
    scores.masked_fill_(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.permute(0, 2, 1, 3).float())
    out = out.view(seqs, num_kv_heads, group, query_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(seqs, query_len, num_heads, head_dim).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,  # [seqs, heads, d]: one query token per sequence
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    max_len = max_seq_len if max_seq_len is not None else int(seq_lens.max())
    k = gather_context(kv_cache[0], block_tables, max_len)  # [seqs, L, kv_heads, d]
    v = gather_context(kv_cache[1], block_tables, max_len)
    # the query is the last token: it sees its whole sequence, nothing past its end
    allowed = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]
    return grouped_query_attention(q[:, None], k, v, allowed[:, None, :], scale)[:, 0]


def paged_prefill_attention(
    q: torch.Tensor,  # [tokens, heads, d]
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context.

    ``k``/``v`` (the new tokens' keys and values) let a sequence with no earlier context skip
    reading them back from the cache; the result is the same either way.
    """
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        query_len = end - start
        if query_len == seq_len:  # no earlier context: plain causal attention
            if k is not None:
                ki, vi = k[start:end], v[start:end]
            else:
                ki, vi = _context(kv_cache, block_tables[i : i + 1], seq_len)
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=True,
            )
            out[start:end] = o.transpose(0, 1)
            continue
        # query j sits at position (seq_len - query_len + j): it sees keys up to there
        ki, vi = _context(kv_cache, block_tables[i : i + 1], seq_len)
        rows = torch.arange(query_len, device=q.device)[:, None] + (seq_len - query_len)
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= rows
        out[start:end] = grouped_query_attention(
            q[None, start:end], ki[None], vi[None], allowed[None], scale
        )[0]
    return out


def _context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """One sequence's keys and values, [seq_len, kv_heads, d] each, read from its blocks."""
    return (gather_context(kv_cache[0], block_table, seq_len)[0],
            gather_context(kv_cache[1], block_table, seq_len)[0])


class TorchAttentionBackend(AttentionBackend):
    """Decodes in small groups of similar length (little padding, context stays in CPU cache);
    prefill chunks one sequence at a time."""

    name = "torch"
    decode_group_size = 8

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float):
        write_to_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            lens = metadata.seq_lens_cpu[:nd]
            order = sorted(range(nd), key=lens.__getitem__)
            for start in range(0, nd, self.decode_group_size):
                group = order[start : start + self.decode_group_size]
                rows = torch.tensor(group, device=q.device)
                out[rows] = paged_decode_attention(
                    q[rows], kv_cache, metadata.block_tables[rows], metadata.seq_lens[rows],
                    scale, max_seq_len=lens[group[-1]],
                )
        if metadata.num_prefills:
            qsl = metadata.query_start_loc_cpu
            base, end = qsl[nd], metadata.num_actual_tokens
            out[base:end] = paged_prefill_attention(
                q[base:end],
                kv_cache,
                [s - base for s in qsl[nd:]],
                metadata.seq_lens_cpu[nd:],
                metadata.block_tables[nd:],
                scale,
                k[base:end],
                v[base:end],
            )
        return out
