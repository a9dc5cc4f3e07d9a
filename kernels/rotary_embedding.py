"""Rotary position embedding (neox layout) for q and k.

Each (token, head) row of q — then of k — is rotated by its token's angle: with x1/x2 the two
halves of the head, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin looked up for the
token's position in the precomputed float32 table ([max_position, head_dim]: cos | sin).
A program takes a tile of BLOCK_ROWS rows. q and k may be strided views into the packed qkv
projection: nothing is copied first.

Torch reference (what the tests compare it with): ``minivllm.model.layers.rotary_embedding``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


TILE_ELEMENTS = 2048  # rows per program: as many as fit in a tile of this size (>= 1)


@triton.jit
def _rotary_kernel(
    positions_ptr, x_ptr, out_ptr, cos_sin_ptr,
    stride_x_tok, stride_x_head, stride_o_tok, stride_o_head, stride_cs,
    num_rows, num_heads, half,
    BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_mask = rows < num_rows
    tok = rows // num_heads
    head = rows % num_heads
    pos = tl.load(positions_ptr + tok, mask=row_mask, other=0)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = row_mask[:, None] & (i < half)
    cs = cos_sin_ptr + pos[:, None] * stride_cs + i
    cos = tl.load(cs, mask=mask, other=0.0)
    sin = tl.load(cs + half, mask=mask, other=0.0)
    src = x_ptr + (tok * stride_x_tok + head * stride_x_head)[:, None] + i
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (tok * stride_o_tok + head * stride_o_head)[:, None] + i
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def _rotate(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_rows = max(1, TILE_ELEMENTS // block_half)
    _rotary_kernel[(triton.cdiv(num_rows, block_rows),)](
        positions, x, out, cos_sin_cache,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin_cache.stride(0),
        num_rows, num_heads, half,
        BLOCK_ROWS=block_rows, BLOCK_HALF=block_half, num_warps=4,
    )
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``minivllm.model.layers.rotary_embedding``; returns new tensors."""
    assert cos_sin_cache.stride(-1) == 1
    return _rotate(positions, q, cos_sin_cache), _rotate(positions, k, cos_sin_cache)
