"""The building blocks of a Llama-family decoder, in plain torch (chapter 01 opens each one).

Every block works on a *flattened* batch: tokens of many sequences stacked along dim 0, no
padding, each token carrying its own position. That is what lets one forward pass mix a
512-token prefill chunk with 60 single-token decodes.

The elementwise blocks (RMSNorm, rotary embedding, SiLU-and-mul) keep their math in plain
functions (``rms_norm``, ``rotary_embedding``, ``silu_and_mul``) and call it through ``self.op``.
The model runner may swap ``op`` for a fused Triton kernel of the same signature
(``minivllm.kernels``) or for a ``torch.compile``d version of the function: see
``use_elementwise_ops`` and the ``custom_ops`` / ``compile`` engine arguments.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x / rms(x) * weight over the last dim, in float32; with ``residual``: norm(x + residual)
    and the new residual stream ``x + residual``."""
    if residual is not None:
        x = x + residual
        return rms_norm(x, weight, eps), x
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm: x / rms(x) * weight, computed in float32.

    ``forward(x, residual)`` first adds the residual stream and returns ``(normed, new_residual)``
    — the fused "add + norm" that every decoder layer does twice (and a Triton kernel fuses).
    """

    op_name = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.op = rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.op(x, self.weight, self.eps, residual)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's long-context rescaling of the rotary frequencies.

    Wavelengths longer than the original context are slowed down by ``factor``; short ones are
    kept; the band in between is interpolated smoothly between the two.
    """
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    blend = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - blend) * slowed / factor + blend * slowed
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, interpolated, slowed)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, d] and k [tokens, kv_heads, d] by their tokens' positions.

    ``cos_sin_cache`` is [max_position, d] float32: cos in the first half, sin in the second.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = cos.unsqueeze(1).to(q.dtype)  # [tokens, 1, head_dim/2]
    sin = sin.unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), "neox" layout: the head dim splits into two halves.

    Each pair (x[i], x[i + d/2]) is rotated by the angle position * inv_freq[i]. The cos/sin table
    for every position up to ``max_position`` is computed once (float32) and indexed per token,
    so tokens of different sequences at different positions rotate in one call.
    """

    op_name = "rotary_embedding"

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float = 10000.0,
        scaling: dict | None = None,
    ) -> None:
        super().__init__()
        self.op = rotary_embedding
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        self._cos_sin: torch.Tensor | None = None  # [max_position, head_dim] (cos | sin)

    def inv_freq(self) -> torch.Tensor:
        exps = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.base**exps)
        if self.scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, self.scaling)
        return inv_freq

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            t = torch.arange(self.max_position, dtype=torch.float32)
            freqs = t[:, None] * self.inv_freq()[None, :]
            self._cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
        return self._cos_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        return self.op(positions, q, k, self.cos_sin_cache(q.device))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] holding [gate | up] side by side -> silu(gate) * up, [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU's gate: input is [gate | up] side by side; output silu(gate) * up."""

    op_name = "silu_and_mul"

    def __init__(self) -> None:
        super().__init__()
        self.op = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


# the plain-torch elementwise ops, by the name each module's ``op_name`` gives
NATIVE_OPS = {"rms_norm": rms_norm, "rotary_embedding": rotary_embedding,
              "silu_and_mul": silu_and_mul}


def use_elementwise_ops(model: nn.Module, ops: dict) -> None:
    """Point every elementwise module of ``model`` at ``ops[module.op_name]`` (same signature as
    the native function): fused Triton kernels, compiled functions, or ``NATIVE_OPS`` again."""
    for module in model.modules():
        name = getattr(module, "op_name", None)
        if name in ops:
            module.op = ops[name]
