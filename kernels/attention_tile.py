"""The two steps both attention kernels take for every tile of context (inlined by Triton).

* ``load_kv_tile``: the K and V of a tile of context tokens of one sequence and one KV head,
  each token's block looked up in the sequence's block table (the paged read).
* ``online_softmax_update``: fold a tile of scores into the running max ``m``, running sum
  ``l`` and unnormalised output ``acc`` (flash attention's online softmax, in base 2).

Decode (``decode_attention``) and prefill (``prefill_attention``) differ in which queries a
program holds and which keys each may see; the tile itself is read and folded the same way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, t, t_mask, d, d_mask, kv_head,
                 block_size, stride_c_block, stride_c_off, stride_c_head):
    """K and V ([len(t), len(d)] each) of context tokens ``t`` of the sequence whose block
    table starts at ``block_table_ptr``; masked-out tokens and dimensions read as 0."""
    block = tl.load(block_table_ptr + t // block_size, mask=t_mask, other=0).to(tl.int64)
    row = block * stride_c_block + (t % block_size) * stride_c_off + kv_head * stride_c_head
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Scores ``s`` [rows, tile] (base-2 logits, -inf where masked) and the tile's ``v``: the
    new (m, l, acc). A row that has seen no visible key yet (a sliding window that starts in a
    later tile) keeps m = -inf, l = 0, acc = 0: its exponents are taken against 0 instead of
    -inf, so it never computes ``exp2(-inf - -inf)`` (NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
