"""SwiGLU's activation, silu(gate) * up, in one pass over the [gate | up] projection.

Unfused, torch reads the projection, writes silu(gate), reads it back with up, and writes the
product; the kernel reads each element once and writes the product once. Grid (row tiles,
column tiles); computed in float32, rounded once.

Torch reference (what the tests compare it with): ``minivllm.model.layers.silu_and_mul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


MAX_BLOCK = 1024  # columns per program
TILE_ELEMENTS = 2048  # rows per program: as many as fit in a tile of this size (>= 1)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, num_rows, d,
                         BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < num_rows) & (cols < d)
    gate = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + rows * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + rows * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``minivllm.model.layers.silu_and_mul``: [..., 2d] -> [..., d]."""
    d = x.shape[-1] // 2
    x2 = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, 2 * d)
    num_rows = x2.shape[0]
    out = torch.empty(num_rows, d, dtype=x.dtype, device=x.device)
    if num_rows:
        block = min(MAX_BLOCK, triton.next_power_of_2(d))
        block_rows = max(1, TILE_ELEMENTS // block)
        grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), num_rows, d,
                                   BLOCK_ROWS=block_rows, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], d)
