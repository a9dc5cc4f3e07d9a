"""Paged attention for decode steps, split across the context (flash-decoding).

A decode step has one query token per sequence, so there is little work per sequence and the
cost is reading its whole context from the KV cache: the kernel must keep HBM busy. One program
per (sequence, KV head) would leave most of the GPU idle for a small batch of long contexts, so
the context is cut into ``num_splits`` partitions, each handled by its own program:

* stage 1, grid (seqs, kv_heads, splits): a program loads the queries of all heads that share
  its KV head (GQA: the group is one [BLOCK_G, d] tile, so K/V are read once per group), walks
  its partition in tiles of BLOCK_N tokens — each token's block looked up in the block table —
  and keeps an online softmax: running max ``m``, running sum ``l``, unnormalised output ``acc``.
* stage 2, grid (seqs, heads): combines the partitions' (m, l, acc) into the exact softmax:
  ``out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i`` with ``M = max_i m_i``.
  With a single partition there is nothing to combine: stage 1 writes ``acc / l`` itself.

A sliding window (Mistral) only moves where each sequence's keys start: ``seq_len - window``;
a partition wholly before it reads nothing and reports an empty softmax (m = -inf, l = 0).

``max_seq_len`` only sizes the grid (the kernel reads each sequence's length from ``seq_lens``),
so a CUDA graph captured with ``max_seq_len = max_model_len`` serves any context length.

Torch reference (what the tests compare it with): ``minivllm.attention.torch_backend.paged_decode_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.attention_tile import load_kv_tile, online_softmax_update

LOG2E = 1.4426950408889634
BLOCK_N = 64  # context tokens per tile (32 for float32 at head sizes of 128 and up: decode_block_n)
BLOCK_S = 16  # partitions the reduce kernel combines per iteration
MIN_PARTITION = 256  # never split finer than this many tokens per program
TARGET_PROGRAMS = 512  # split until the grid has about this many programs (~4 per SM on an H200)


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    acc_ptr, max_ptr, sum_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is cheaper)
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_c_block, stride_c_off, stride_c_head,
    stride_bt_seq,
    stride_acc_seq, stride_acc_head, stride_acc_split,
    stride_m_seq, stride_m_head,
    block_size, head_dim, partition_size,
    sliding_window,  # 0: the whole context; w > 0: only the last w keys
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    if start >= seq_len:  # this sequence is shorter than the grid assumed
        return
    end = tl.minimum(start + partition_size, seq_len)
    if sliding_window > 0:  # a partition wholly before the window reads nothing: m=-inf, l=0
        start = tl.maximum(start, seq_len - sliding_window)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        t = tile + tl.arange(0, BLOCK_N)
        t_mask = t < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt_seq,
                            t, t_mask, d, d_mask, kv_head,
                            block_size, stride_c_block, stride_c_off, stride_c_head)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        # every tile has a valid token (a partition before a sliding window has no tile at all)
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)

    if SINGLE_SPLIT:  # the whole context was ours: normalise and write the output directly
        out_rows = seq * stride_o_seq + heads * stride_o_head
        tl.store(out_ptr + out_rows[:, None] + d[None, :],
                 (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])
        return
    base = seq * stride_m_seq + heads * stride_m_head + split
    tl.store(max_ptr + base, m_i, mask=g_mask)
    tl.store(sum_ptr + base, l_i, mask=g_mask)
    acc_rows = seq * stride_acc_seq + heads * stride_acc_head + split * stride_acc_split
    tl.store(acc_ptr + acc_rows[:, None] + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(
    out_ptr, acc_ptr, max_ptr, sum_ptr, seq_lens_ptr,
    stride_o_seq, stride_o_head,
    stride_acc_seq, stride_acc_head, stride_acc_split,
    stride_m_seq, stride_m_head,
    head_dim, partition_size,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine a (sequence, head)'s partitions, BLOCK_S at a time: the grid is sized for the
    longest context the graphs serve (hundreds of partitions at max_model_len), and one tile
    over all of them at once would not fit in registers."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(seq_len, partition_size)  # partitions that saw at least one token
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    base = seq * stride_m_seq + head * stride_m_head
    rows = seq * stride_acc_seq + head * stride_acc_head
    # pass 1: the largest partition max
    m_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_used, BLOCK_S):
        m_max = tl.maximum(m_max, tl.load(max_ptr + base + s0 + s, mask=s0 + s < num_used,
                                          other=float("-inf")))
    m_top = tl.max(m_max, 0)
    # an empty sequence (seq_len 0) used no partition: every m is -inf, and -inf - -inf would
    # be NaN in the masked lanes (where() evaluates both sides); a finite max keeps them -inf
    m_top = tl.where(m_top > float("-inf"), m_top, 0.0)
    # pass 2: the partitions' sums and outputs, each weighted by e^(m_i - M)
    denom = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for s0 in range(0, num_used, BLOCK_S):
        s_mask = s0 + s < num_used
        m = tl.load(max_ptr + base + s0 + s, mask=s_mask, other=float("-inf"))
        l = tl.load(sum_ptr + base + s0 + s, mask=s_mask, other=0.0)
        weight = tl.where(s_mask, tl.exp2(m - m_top), 0.0)
        part = tl.load(acc_ptr + rows + (s0 + s)[:, None] * stride_acc_split + d[None, :],
                       mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        denom += weight * l
        acc += part * weight[:, None]
    total = tl.sum(denom, 0)
    total = tl.where(total > 0, total, 1.0)  # an empty sequence (seq_len 0) gives zeros
    out = tl.sum(acc, 0) / total
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def num_decode_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int) -> int:
    """Partitions per sequence: enough programs to fill the GPU, none shorter than MIN_PARTITION."""
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    by_length = triton.cdiv(max(1, max_seq_len), MIN_PARTITION)
    return max(1, min(by_occupancy, by_length))


def decode_block_n(dtype: torch.dtype, block_d: int) -> int:
    """Context tokens per tile. float32 K and V tiles of 64 x 128 need 73,728 bytes of shared
    memory, over an sm_75's 65,536 (the ahead-of-time compile test checks every target)."""
    return 32 if dtype == torch.float32 and block_d >= 128 else BLOCK_N


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs are multiplied exactly ("ieee"), not in TF32: tests compare them tightly."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode_attention(
    q: torch.Tensor,  # [seqs, heads, d]: one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, d]
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [seqs] int32, context length including the new token
    scale: float,
    max_seq_len: int | None = None,  # sizes the grid; defaults to seq_lens.max() (a host sync)
    num_splits: int | None = None,  # default: num_decode_splits(...)
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,  # attend only the last sliding_window keys
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1 and out.stride(-1) == 1
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if num_splits is None:
        num_splits = num_decode_splits(max_seq_len, num_seqs, num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    block_n = decode_block_n(q.dtype, block_d)
    # round partitions up to whole tiles so no tile straddles two programs
    partition = triton.cdiv(triton.cdiv(max(1, max_seq_len), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(1, max_seq_len), partition)

    single = num_splits == 1
    acc = torch.empty(num_seqs, num_heads, 1 if single else num_splits, head_dim,
                      dtype=torch.float32, device=q.device)
    m = torch.empty(acc.shape[:-1], dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        acc, m, l, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2),
        m.stride(0), m.stride(1),
        block_size, head_dim, partition, sliding_window or 0,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype), SINGLE_SPLIT=single,
        num_warps=4,
    )
    if single:
        return out
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out, acc, m, l, seq_lens,
        out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        m.stride(0), m.stride(1),
        head_dim, partition,
        BLOCK_S=min(BLOCK_S, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2,
    )
    return out
