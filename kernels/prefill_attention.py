"""Attention for prefill chunks over the paged KV cache (variable-length, causal).

Each sequence in the batch brings ``query_len`` new tokens (a whole prompt, one chunk of a long
prompt under chunked prefill, or the tail after a prefix-cache hit); its context is
``seq_len`` tokens, the first ``seq_len - query_len`` computed earlier and already in the
cache. The new tokens' K/V were written to the cache just before (reshape_and_cache), so the
kernel reads *all* keys and values from the blocks: one code path for a fresh prompt, a later
chunk, and a prefix hit.

Grid (heads, query tiles, seqs): a program takes BLOCK_M new tokens of one sequence for one
query head, walks that sequence's keys in tiles of BLOCK_N (looking each token's block up in the
block table) with an online softmax, and stops at the last key its last query may see.
Query j of the chunk sits at position ``seq_len - query_len + j`` and sees keys up to there.
Heads are the fastest grid axis so the programs sharing a KV head (GQA) run side by side and
find its K/V tiles in L2.

Torch reference (what the tests compare it with): ``minivllm.attention.torch_backend.paged_prefill_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.attention_tile import load_kv_tile, online_softmax_update
from minivllm.kernels.decode_attention import LOG2E, dot_precision

BLOCK_M = 64  # query tokens per program
BLOCK_N = 64  # key tokens per tile (both 32 for float32 at head sizes of 128 and up: prefill_tiles)


def prefill_tiles(dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N). float32 at head_dim 128 with 64 x 64 tiles needs 98,304 bytes of
    shared memory on an sm_75 (limit 65,536) and 114,944 on an sm_86 (limit 101,376)."""
    return (32, 32) if dtype == torch.float32 and block_d >= 128 else (BLOCK_M, BLOCK_N)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_off, stride_c_head,
    stride_bt_seq,
    block_size, head_dim,
    sliding_window,  # 0: causal over the whole context; w > 0: query p sees keys p-w < k <= p
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    q_tile = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= query_len:  # the grid is sized for the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    kv_head = head // GROUP

    m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < query_len
    q_pos = context_len + m  # each query's position in its sequence
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys past this tile's last query are masked for every row: don't even read them
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_M)
    kv_start = 0
    if sliding_window > 0:  # nor keys before the first query's window
        kv_start = tl.maximum(0, context_len + q_tile * BLOCK_M - sliding_window + 1)
    for tile in range(kv_start, kv_end, BLOCK_N):
        t = tile + tl.arange(0, BLOCK_N)
        t_mask = t < kv_end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt_seq,
                            t, t_mask, d, d_mask, kv_head,
                            block_size, stride_c_block, stride_c_off, stride_c_head)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (t[None, :] <= q_pos[:, None]) & t_mask[None, :]
        if sliding_window > 0:
            visible = visible & (t[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        # a row whose window starts in a later tile stays empty until then (see
        # online_softmax_update); by the last tile every row has seen its own key
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)

    # padding rows past the chunk (masked at the store) may see no key at all: keep them finite
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [tokens, heads, d]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, d], new K/V already written
    query_start_loc: torch.Tensor | list[int],  # [seqs + 1]
    seq_lens: torch.Tensor | list[int],  # [seqs]
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    scale: float,
    max_query_len: int | None = None,  # sizes the grid; from a list it is free, else a host sync
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,  # query p sees only keys p - sliding_window < k <= p
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context, read from blocks."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(q) if out is None else out
    if max_query_len is None:
        if isinstance(query_start_loc, torch.Tensor):
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        else:
            max_query_len = max(b - a for a, b in zip(query_start_loc, query_start_loc[1:]))
    query_start_loc = torch.as_tensor(query_start_loc, dtype=torch.int32, device=q.device)
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1 and out.stride(-1) == 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n = prefill_tiles(q.dtype, block_d)
    grid = (num_heads, triton.cdiv(max_query_len, block_m), num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        block_size, head_dim, sliding_window or 0,
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=2,
    )
    return out
