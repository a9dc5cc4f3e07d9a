"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Unfused, ``x + residual`` then the norm read and write the hidden state several times; the
kernel does it in one pass: a program takes a tile of BLOCK_ROWS rows (tokens), loads x and the
residual, writes their sum (the new residual stream) and the normalised rows. Rounding follows
the reference: the sum is rounded to the model's dtype before it is normalised, the normalised
row is rounded before it is scaled by the weight.

Torch reference (what the tests compare it with): ``minivllm.model.layers.rms_norm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


TILE_ELEMENTS = 2048  # rows per program: as many as fit in a tile of this size (>= 1)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, out_ptr, residual_out_ptr, weight_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    num_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < n_cols)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    mean_sq = tl.sum(x * x, 1) / n_cols
    normed = x * tl.rsqrt(mean_sq + eps)[:, None]
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, n_cols)  # a view when rows are evenly strided, else a copy


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``minivllm.model.layers.rms_norm``: normalise over the last dim."""
    n_cols = x.shape[-1]
    x2 = _rows(x, n_cols)
    num_rows = x2.shape[0]
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block = triton.next_power_of_2(n_cols)
    block_rows = max(1, TILE_ELEMENTS // block)
    grid = (triton.cdiv(num_rows, block_rows),)
    meta = dict(BLOCK_ROWS=block_rows, BLOCK=block, num_warps=min(16, max(4, block // 256)))
    if residual is None:
        if num_rows:
            _rms_norm_kernel[grid](x2, x2, out, out, weight, x2.stride(0), 0, out.stride(0), 0,
                                   num_rows, n_cols, eps, HAS_RESIDUAL=False, **meta)
        return out.view(x.shape)
    r2 = _rows(residual, n_cols)
    new_residual = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                               device=x.device)
    if num_rows:
        _rms_norm_kernel[grid](x2, r2, out, new_residual, weight, x2.stride(0), r2.stride(0),
                               out.stride(0), new_residual.stride(0), num_rows, n_cols, eps,
                               HAS_RESIDUAL=True, **meta)
    return out.view(x.shape), new_residual.view(x.shape)
