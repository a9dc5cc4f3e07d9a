"""Graders for chapter 01: RMSNorm, rotary embedding, GQA attention, each compared with the
reference on seeded random cases, then put in every layer of SmolLM2 (its logits must not move)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from itertools import product

import torch
import torch.nn.functional as F

from minivllm.attention.backend import AttentionBackend
from minivllm.course.checks.common import (
    PROMPT, Exercise, aten_operators, bundled_model, close, native_answer,
)
from minivllm.model.layers import RotaryEmbedding
from minivllm.model.layers import rms_norm as reference_rms_norm
from minivllm.model.standalone import sequence_logits

LOGITS_ATOL = 1e-3  # float32 end to end: a correct component stays within ~1e-5
# the package's norm, its C kernels, and torch's own RMSNorm
KERNELS = ("minivllm.cpu_kernels:library", "minivllm.cpu_kernels:cpu_elementwise_ops",
           "minivllm.model.layers:NATIVE_OPS")
RMS_ANSWER = ("minivllm.model.layers:rms_norm", "minivllm.model.layers:RMSNorm",
              "torch.nn.functional:rms_norm", "torch:rms_norm", "torch.nn:RMSNorm") + KERNELS + \
    aten_operators("rms_norm")
RMS_CONVENTION = ("Expected: x / sqrt(mean(x**2 over the last dim) + eps) * weight, computed in "
                  "float32 and returned in x's dtype.")
ROPE_ANSWER = ("minivllm.model.layers:rotary_embedding",
               "minivllm.model.layers:RotaryEmbedding") + KERNELS
ROPE_CONVENTION = ("Expected (RoPE, 'neox' layout): with d = head_dim and inv_freq[i] = "
                   "base ** (-2i / d) for i < d/2, the pair (x[..., i], x[..., i + d/2]) of a "
                   "token at position p is rotated by the angle p * inv_freq[i].")
# the package's attention, in torch and in its CPU kernels (refused in 1.3, 3.2 and chapter
# 09; ``native_answer(..., *ATTENTION_OPS)`` adds the operators where the kernels load)
TORCH_ATTENTION = tuple(f"minivllm.attention.torch_backend:{name}" for name in (
    "paged_decode_attention", "paged_prefill_attention", "attend_group", "attend_decodes_by_rows",
    "gather_context", "gather_blocks", "TorchAttentionBackend")) + tuple(
    f"minivllm.cpu_kernels:{name}" for name in ("paged_decode", "paged_prefill", "kernel"))
ATTENTION_OPS = ("paged_decode", "paged_prefill")
# torch's fused attention is the reference (and the chapter's cell): the exercise writes it
GQA_ANSWER = ("torch.nn.functional:scaled_dot_product_attention", "torch.nn:MultiheadAttention",
              "minivllm.course.checks.model:reference_gqa_attention") + TORCH_ATTENTION + \
    aten_operators("scaled_dot_product")  # and the kernels behind it (math, flash, ...)
GQA_ALLOWED = "torch's tensor operations (einsum, matmul, softmax, masked_fill, repeat_interleave)"
GQA_CONVENTION = ("Expected: causal attention (token t sees tokens 0..t) of q [tokens, heads, d] "
                  "over k, v [tokens, kv_heads, d], softmax(q k^T * scale) v, where query head h "
                  "uses KV head h // (heads // kv_heads).")


@contextmanager
def op_swapped(model, name: str, make):
    """While the block runs, modules whose ``op_name`` is ``name`` compute with ``make(module)``."""
    modules = [m for m in model.modules() if getattr(m, "op_name", None) == name]
    saved = [m.op for m in modules]
    for m in modules:
        m.op = make(m)
    try:
        yield
    finally:
        for m, op in zip(modules, saved):
            m.op = op


class WholePromptBackend(AttentionBackend):
    """The learner's ``attention(q, k, v, scale)`` over one whole prompt (no cached context)."""

    def __init__(self, attention) -> None:
        self.attention = attention

    def forward(self, q, k, v, kv_cache, metadata, scale):
        if len(metadata.seq_lens_cpu) != 1 or int(metadata.seq_lens_cpu[0]) != q.shape[0]:
            raise ValueError("WholePromptBackend computes one whole prompt at a time")
        return torch.empty_like(q).copy_(self.attention(q, k, v, scale))  # contiguous, q's dtype


def _in_smollm(ex: Exercise, what: str, swap=nullcontext, backend="torch") -> None:
    """SmolLM2's logits on PROMPT with the learner's component swapped in (``swap(model)``)."""
    model, tok = bundled_model()
    ids = tok.encode(PROMPT)
    with torch.inference_mode():
        expected = sequence_logits(model, ids)
        with swap(model):
            got = sequence_logits(model, ids, backend=backend)
    if not torch.isfinite(got).all():  # NaN would slip through a max-difference test
        ex.fail(f"with your {what} inside SmolLM2 the logits contain NaN or inf")
    err = (got - expected).abs().max().item()
    if not err <= LOGITS_ATOL:
        want, have = (tok.decode(int(t[-1].argmax())) for t in (expected, got))
        ex.fail(f"with your {what} in every layer of SmolLM2, the logits of {PROMPT!r} differ "
                f"from the reference model's by up to {err:.3g} (expected < {LOGITS_ATOL:g}); "
                f"the most likely next token is {want!r} for the reference, {have!r} with yours")


def check_rms_norm(rms_norm, exercise: str = "1.1", seed: int = 0) -> None:
    """``rms_norm(x, weight, eps) -> tensor`` like ``minivllm.model.layers.RMSNorm``."""
    ex = Exercise(exercise, RMS_CONVENTION, RMS_ANSWER, "torch")
    rms_norm = ex.take(rms_norm, "rms_norm")
    g = torch.Generator().manual_seed(seed)
    cases = list(product([(4, 64), (2, 5, 576), (3, 1), (1, 7, 33)], (1e-5, 0.5),
                         (1e-2, 1.0, 50.0), (torch.float32, torch.bfloat16)))
    for shape, eps, scale, dtype in cases:
        x = (torch.randn(shape, generator=g) * scale).to(dtype)
        w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
        got = rms_norm(x.clone(), w.clone(), eps)
        no_eps = reference_rms_norm(x.float(), w.float(), 0.0).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        ex.compare_tensors(f"rms_norm(x of shape {shape}, {dtype}, eps={eps:g})", got,
                           reference_rms_norm(x, w, eps), tol, tol, mistakes=[
                               (lambda y: close(y, no_eps, 1e-3, 1e-3), "the result matches x / "
                                "rms(x) * weight without eps: add eps inside the sqrt.")])

    def op(x, weight, eps, residual=None):  # RMSNorm.op: with a residual, norm(x + residual)
        return rms_norm(x, weight, eps) if residual is None else (
            rms_norm(x + residual, weight, eps), x + residual)
    _in_smollm(ex, "rms_norm", lambda model: op_swapped(model, "rms_norm", lambda m: op))
    ex.passed(f"rms_norm matches RMSNorm on {len(cases)} random cases, and SmolLM2 with your "
              "rms_norm in every norm gives the reference logits.")


def _rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """The other layout (GPT-J's): adjacent pairs (x[2i], x[2i+1]), a common mistake."""
    d = x.shape[-1]
    angle = positions.float()[:, None] * base ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def check_rotary(apply_rotary, exercise: str = "1.2", seed: int = 0) -> None:
    """``apply_rotary(x [tokens, heads, head_dim], positions [tokens], base) -> rotated x``."""
    ex = Exercise(exercise, ROPE_CONVENTION, ROPE_ANSWER, "torch")
    apply_rotary = ex.take(apply_rotary, "apply_rotary")
    g = torch.Generator().manual_seed(seed)
    position_sets = {
        "0..4": torch.arange(5),
        "two sequences, 0..6 then 0..9": torch.cat([torch.arange(7), torch.arange(10)]),
        "random, up to 1000": torch.randint(0, 1000, (13,), generator=g)}
    cases = list(product((8, 64, 128), (1, 3), (10000.0, 100000.0, 500000.0), position_sets))
    for head_dim, heads, base, label in cases:
        positions = position_sets[label]
        x = torch.randn(len(positions), heads, head_dim, generator=g)
        ref = RotaryEmbedding(head_dim, 1024, base)
        got = apply_rotary(x.clone(), positions.clone(), base)
        mistakes = [
            (lambda y: close(y, _rope_interleaved(x, positions, base), 2e-3, 1e-3),
             "you rotated adjacent pairs (x[2i], x[2i+1]); Llama checkpoints pair x[i] with "
             "x[i + head_dim/2] (the first half with the second)."),
            (lambda y: close(y, ref(torch.arange(len(positions)), x, x)[0], 2e-3, 1e-3),
             "you rotated token t by t; rotate it by positions[t] (tokens of several sequences "
             "share a batch, each at its own position).")]
        ex.compare_tensors(f"apply_rotary(head_dim={head_dim}, heads={heads}, base={base:g}, "
                           f"positions {label})", got, ref(positions, x, x)[0], 2e-3, 1e-3,
                           mistakes=mistakes)
    _in_smollm(ex, "apply_rotary", lambda model: op_swapped(
        model, "rotary_embedding", lambda r: lambda positions, q, k, cos_sin: (
            apply_rotary(q, positions, r.base), apply_rotary(k, positions, r.base))))
    ex.passed(f"apply_rotary matches RotaryEmbedding on {len(cases)} random cases, and SmolLM2 "
              "with your rotary embedding gives the reference logits.")


def reference_gqa_attention(q, k, v, scale, causal: bool = True):
    """torch's own scaled_dot_product_attention with GQA, on [tokens, heads, d] tensors."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=causal, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def gqa_mistakes(q, k, v, scale, causal: bool = True) -> list:
    """The classic mistakes of GQA attention, as ``Exercise.hint`` rows."""
    group, default = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    tiled = (k.repeat(1, group, 1), v.repeat(1, group, 1))  # head h -> KV head h % kv_heads
    return [
        (lambda y: group > 1 and close(y, reference_gqa_attention(q, *tiled, scale, causal)),
         "query head h used KV head h % kv_heads; consecutive query heads share a KV head: "
         "h // (heads // kv_heads) (repeat_interleave, not repeat)."),
        (lambda y: causal and q.shape[0] > 1 and close(
            y, reference_gqa_attention(q, k, v, scale, causal=False)),
         "no causal mask: token t must not attend to tokens after t."),
        (lambda y: causal and scale != default and close(
            y, reference_gqa_attention(q, k, v, default)),
         "use the scale argument, not 1/sqrt(head_dim).")]


def check_gqa_attention(gqa_attention, exercise: str = "1.3", seed: int = 0) -> None:
    """``gqa_attention(q, k, v, scale) -> [tokens, heads, d]``: causal, one sequence."""
    ex = Exercise(exercise, GQA_CONVENTION, native_answer(GQA_ANSWER, *ATTENTION_OPS),
                  GQA_ALLOWED)
    gqa_attention = ex.take(gqa_attention, "gqa_attention")
    g = torch.Generator().manual_seed(seed)
    cases = list(product(((4, 4), (9, 3), (8, 2), (6, 1)), (16, 64), (1, 5, 33), (None, 0.3)))
    for (heads, kv_heads), d, tokens, scale in cases:
        scale = scale or d ** -0.5
        q = torch.randn(tokens, heads, d, generator=g)
        k, v = (torch.randn(tokens, kv_heads, d, generator=g) for _ in range(2))
        got = gqa_attention(q.clone(), k.clone(), v.clone(), scale)
        ex.compare_tensors(f"gqa_attention({tokens} tokens, {heads} query heads over {kv_heads} "
                           f"KV heads, d={d}, scale={scale:.3g})", got,
                           reference_gqa_attention(q, k, v, scale), 1e-4, 1e-4,
                           mistakes=gqa_mistakes(q, k, v, scale))
    _in_smollm(ex, "gqa_attention (9 query heads over 3 KV heads)",
               backend=WholePromptBackend(gqa_attention))
    ex.passed(f"gqa_attention matches torch's scaled_dot_product_attention on {len(cases)} random "
              "cases, and SmolLM2 with your attention gives the reference logits.")
