"""Checkers for chapter 01 (the model): RMSNorm, rotary embedding, grouped-query attention.

Each function is first compared with the package's reference on random inputs, then swapped
into every layer of the bundled SmolLM2, whose logits must stay those of the reference model.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.torch_backend import write_to_kv_cache
from minivllm.course.checks.common import (
    PROMPT, Exercise, bundled_model, close, compare_tensors, fail, passed,
)
from minivllm.model.layers import RMSNorm, RotaryEmbedding
from minivllm.model.standalone import sequence_logits

LOGITS_ATOL = 1e-3  # float32 end to end: a correct component stays within ~1e-5


# -- plugging a learner's function into the real model -------------------------------------------

@contextmanager
def rms_norm_swapped(model, rms_norm):
    """Every RMSNorm of ``model`` computes ``rms_norm(x, weight, eps)`` instead of its own."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m._norm = lambda x, m=m: rms_norm(x, m.weight, m.eps)
    try:
        yield len(norms)
    finally:
        for m in norms:
            del m._norm


@contextmanager
def rotary_swapped(model, apply_rotary):
    """The model's rotary embedding rotates q and k with ``apply_rotary(x, positions, base)``."""
    rotaries = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}.values()
    for rot in rotaries:
        rot.forward = lambda positions, q, k, rot=rot: (
            apply_rotary(q, positions, rot.base), apply_rotary(k, positions, rot.base))
    try:
        yield
    finally:
        for rot in rotaries:
            del rot.forward


class WholePromptBackend(AttentionBackend):
    """Attention for whole-prompt forwards: each sequence's queries attend causally to its own
    new keys through ``attention(q, k, v, scale)`` — a learner's, in a checker."""

    name = "whole-prompt"

    def __init__(self, attention) -> None:
        self.attention = attention

    def forward(self, q, k, v, kv_cache, metadata, scale):
        write_to_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        qsl = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            start, end = qsl[i], qsl[i + 1]
            if end - start != seq_len:
                raise ValueError("WholePromptBackend computes whole prompts only (no cached context)")
            out[start:end] = self.attention(q[start:end], k[start:end], v[start:end], scale)
        return out


def _model_check(exercise: str, what: str, swap=None, backend="torch") -> None:
    """Logits of the bundled model on PROMPT with the learner's component swapped in."""
    model, tok = bundled_model()
    ids = tok.encode(PROMPT)
    expected = sequence_logits(model, ids)
    with swap(model) if swap else nullcontext():
        got = sequence_logits(model, ids, backend=backend)
    if not torch.isfinite(got).all():  # NaN would slip through a max-difference test
        fail(exercise, f"with your {what} inside SmolLM2 the logits contain NaN or inf")
    err = (got - expected).abs().max().item()
    if not err <= LOGITS_ATOL:
        want, have = tok.decode(int(expected[-1].argmax())), tok.decode(int(got[-1].argmax()))
        fail(exercise, f"with your {what} in every layer of SmolLM2, the logits of {PROMPT!r} differ "
                       f"from the reference model's by up to {err:.3g} (expected < {LOGITS_ATOL:g}); "
                       f"the most likely next token is {want!r} for the reference, {have!r} with yours")


# -- Exercise 1.1: RMSNorm -----------------------------------------------------------------------

# the package's norm, its C kernels, and torch's own RMSNorm
KERNELS = ("minivllm.cpu_kernels:library", "minivllm.cpu_kernels:cpu_elementwise_ops",
           "minivllm.model.layers:NATIVE_OPS")
RMS_ANSWER = ("minivllm.model.layers:rms_norm", "minivllm.model.layers:RMSNorm",
              "torch.nn.functional:rms_norm", "torch:rms_norm", "torch.nn:RMSNorm") + KERNELS
RMS_CONVENTION = ("Expected: x / sqrt(mean(x**2 over the last dim) + eps) * weight, computed in "
                  "float32 and returned in x's dtype.")


def check_rms_norm(rms_norm, exercise: str = "1.1", seed: int = 0) -> None:
    """``rms_norm(x, weight, eps) -> tensor`` like ``minivllm.model.layers.RMSNorm``."""
    rms_norm = Exercise(exercise, answer=RMS_ANSWER, allowed="torch").take(rms_norm, "rms_norm")
    g = torch.Generator().manual_seed(seed)
    cases = 0
    for shape in [(4, 64), (2, 5, 576), (3, 1), (1, 7, 33)]:
        for eps in (1e-5, 0.5):
            for scale in (1e-2, 1.0, 50.0):
                for dtype in (torch.float32, torch.bfloat16):
                    x = (torch.randn(shape, generator=g) * scale).to(dtype)
                    ref = RMSNorm(shape[-1], eps).to(dtype)
                    with torch.no_grad():
                        ref.weight.copy_(1 + 0.5 * torch.randn(shape[-1], generator=g))
                    expected = ref(x).detach()
                    got = rms_norm(x.clone(), ref.weight.detach().clone(), eps)
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    hint = None
                    no_eps = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True))
                              * ref.weight.float())
                    if close(got, no_eps.to(dtype), 1e-3, 1e-3):
                        hint = ("the result matches x / rms(x) * weight without eps: "
                                "add eps inside the sqrt.")
                    compare_tensors(exercise, f"rms_norm(x of shape {shape}, {dtype}, eps={eps:g})",
                                    got, expected, tol, tol, RMS_CONVENTION, hint)
                    cases += 1
    with torch.inference_mode():
        _model_check(exercise, "rms_norm", lambda model: rms_norm_swapped(model, rms_norm))
    passed(exercise, f"rms_norm matches RMSNorm on {cases} random cases, and SmolLM2 with your "
                     "rms_norm in every norm gives the reference logits.")


# -- Exercise 1.2: rotary embedding --------------------------------------------------------------

ROPE_ANSWER = ("minivllm.model.layers:rotary_embedding", "minivllm.model.layers:RotaryEmbedding",
               ) + KERNELS
ROPE_CONVENTION = ("Expected (RoPE, 'neox' layout): with d = head_dim and inv_freq[i] = "
                   "base ** (-2i / d) for i < d/2, the pair (x[..., i], x[..., i + d/2]) of a token at "
                   "position p is rotated by the angle p * inv_freq[i].")


def _rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """The other layout (GPT-J's): adjacent pairs (x[2i], x[2i+1]) — a common mistake."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    angle = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def check_rotary(apply_rotary, exercise: str = "1.2", seed: int = 0) -> None:
    """``apply_rotary(x [tokens, heads, head_dim], positions [tokens], base) -> rotated x``."""
    apply_rotary = Exercise(exercise, answer=ROPE_ANSWER, allowed="torch").take(
        apply_rotary, "apply_rotary")
    g = torch.Generator().manual_seed(seed)
    position_sets = {
        "0..4": torch.arange(5),
        "two sequences, 0..6 then 0..9": torch.cat([torch.arange(7), torch.arange(10)]),
        "random, up to 1000": torch.randint(0, 1000, (13,), generator=g),
    }
    cases = 0
    for head_dim in (8, 64, 128):
        for heads in (1, 3):
            for base in (10000.0, 100000.0, 500000.0):
                for label, positions in position_sets.items():
                    x = torch.randn(len(positions), heads, head_dim, generator=g)
                    ref = RotaryEmbedding(head_dim, 1024, base)
                    expected = ref(positions, x, x)[0]
                    got = apply_rotary(x.clone(), positions.clone(), base)
                    hint = None
                    if close(got, _rope_interleaved(x, positions, base), 2e-3, 1e-3):
                        hint = ("you rotated adjacent pairs (x[2i], x[2i+1]); Llama checkpoints pair "
                                "x[i] with x[i + head_dim/2] (the first half with the second).")
                    elif close(got, ref(torch.arange(len(positions)), x, x)[0], 2e-3, 1e-3):
                        hint = ("you rotated token t by t; rotate it by positions[t] (tokens of "
                                "several sequences share a batch, each at its own position).")
                    compare_tensors(exercise, f"apply_rotary(head_dim={head_dim}, heads={heads}, "
                                    f"base={base:g}, positions {label})", got, expected, 2e-3, 1e-3,
                                    ROPE_CONVENTION, hint)
                    cases += 1
    with torch.inference_mode():
        _model_check(exercise, "apply_rotary", lambda model: rotary_swapped(model, apply_rotary))
    passed(exercise, f"apply_rotary matches RotaryEmbedding on {cases} random cases, and SmolLM2 "
                     "with your rotary embedding gives the reference logits.")


# -- Exercise 1.3: grouped-query attention -------------------------------------------------------

# torch's fused attention is the reference (and the chapter's cell): the exercise writes it
GQA_ANSWER = ("torch.nn.functional:scaled_dot_product_attention",
              "torch:ops.aten.scaled_dot_product_attention", "torch.nn:MultiheadAttention",
              "minivllm.course.checks.model:reference_gqa_attention",
              "minivllm.attention.torch_backend:paged_prefill_attention",
              "minivllm.attention.torch_backend:paged_decode_attention",
              "minivllm.attention.torch_backend:attend_group",
              "minivllm.attention.torch_backend:TorchAttentionBackend")
GQA_ALLOWED = "torch's tensor operations (einsum, matmul, softmax, masked_fill, repeat_interleave)"
GQA_CONVENTION = ("Expected: causal attention (token t sees tokens 0..t) of q [tokens, heads, d] "
                  "over k, v [tokens, kv_heads, d], softmax(q k^T * scale) v, where query head h "
                  "uses KV head h // (heads // kv_heads).")


def reference_gqa_attention(q, k, v, scale):
    """torch's own scaled_dot_product_attention, causal, with GQA."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def gqa_hint(got, q, k, v, scale, causal: bool = True) -> str | None:
    """Name the usual mistake when the learner's output matches it."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        tiled_k = k.repeat(1, heads // kv_heads, 1)  # head h -> KV head h % kv_heads
        tiled_v = v.repeat(1, heads // kv_heads, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), tiled_k.transpose(0, 1),
                                           tiled_v.transpose(0, 1), is_causal=causal, scale=scale)
        if close(got, o.transpose(0, 1)):
            return ("query head h used KV head h % kv_heads; consecutive query heads share a KV "
                    "head: h // (heads // kv_heads) (repeat_interleave, not repeat).")
    if causal and q.shape[0] > 1:
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           scale=scale, enable_gqa=True)
        if close(got, o.transpose(0, 1)):
            return "no causal mask: token t must not attend to tokens after t."
    o = reference_gqa_attention(q, k, v, q.shape[-1] ** -0.5) if causal else None
    if o is not None and scale != q.shape[-1] ** -0.5 and close(got, o):
        return "use the scale argument, not 1/sqrt(head_dim)."
    return None


def check_gqa_attention(gqa_attention, exercise: str = "1.3", seed: int = 0) -> None:
    """``gqa_attention(q, k, v, scale) -> [tokens, heads, d]``: causal, one sequence."""
    gqa_attention = Exercise(exercise, answer=GQA_ANSWER, allowed=GQA_ALLOWED).take(
        gqa_attention, "gqa_attention")
    g = torch.Generator().manual_seed(seed)
    cases = 0
    for heads, kv_heads in ((4, 4), (9, 3), (8, 2), (6, 1)):
        for d in (16, 64):
            for tokens in (1, 5, 33):
                for scale in (d**-0.5, 0.3):
                    q = torch.randn(tokens, heads, d, generator=g)
                    k = torch.randn(tokens, kv_heads, d, generator=g)
                    v = torch.randn(tokens, kv_heads, d, generator=g)
                    expected = reference_gqa_attention(q, k, v, scale)
                    got = gqa_attention(q.clone(), k.clone(), v.clone(), scale)
                    compare_tensors(exercise, f"gqa_attention({tokens} tokens, {heads} query heads "
                                    f"over {kv_heads} KV heads, d={d}, scale={scale:.3g})", got,
                                    expected, 1e-4, 1e-4, GQA_CONVENTION,
                                    gqa_hint(got, q, k, v, scale))
                    cases += 1
    with torch.inference_mode():
        _model_check(exercise, "gqa_attention (9 query heads over 3 KV heads)",
                     backend=WholePromptBackend(gqa_attention))
    passed(exercise, f"gqa_attention matches torch's scaled_dot_product_attention on {cases} random "
                     "cases, and SmolLM2 with your attention gives the reference logits.")
