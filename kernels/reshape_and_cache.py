"""Write each new token's K and V into the paged KV cache at its slot (vLLM's reshape_and_cache).

One program per token: it reads the token's slot (``block_id * block_size + offset``), skips
padding tokens (slot -1, e.g. the filler rows of a CUDA-graph batch), and copies all its KV
heads into ``kv_cache[0/1, block_id, offset]``. The copy never syncs with the host, unlike the
reference's boolean-mask indexing, so it can be captured in a CUDA graph.

Torch reference (what the tests compare it with): ``minivllm.attention.torch_backend.write_to_kv_cache``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_off, stride_c_head,
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = block * stride_c_block + offset * stride_c_off + h * stride_c_head + d
    k = tl.load(k_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token t's key and value at slot ``slot_mapping[t]``; slots < 0 are skipped.

    k, v: [tokens, kv_heads, head_dim] (any token/head strides, contiguous head_dim);
    kv_cache: [2, num_blocks, block_size, kv_heads, head_dim].
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_size, num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
