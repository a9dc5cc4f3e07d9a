"""What every checker shares: failing with a useful message, the reference model and engine.

A checker runs the learner's component on randomised cases next to the package's reference,
then inside the real model or engine. Cases are random but seeded, so a given implementation
always gets the same verdict (and a solved notebook's output never changes).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from minivllm.attention.backend import AttentionBackend

from minivllm.course.grading import (  # noqa: F401 - re-exported: the graders' one vocabulary
    CheckFailed, Delegated, Exercise, fail, faked, first_difference, passed,
)
from minivllm.testing import model_runner


def _at(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def compare_tensors(
    exercise: str,
    what: str,
    got,
    expected: torch.Tensor,
    atol: float,
    rtol: float,
    convention: str,
    hint=None,
) -> None:
    """Fail unless ``got`` is a tensor of ``expected``'s shape, dtype and values (to tolerance).
    ``hint``: a string, or a function that gives one (or None), called only when values differ."""
    if not isinstance(got, torch.Tensor):
        fail(exercise, f"{what}: expected a torch.Tensor, got {type(got).__name__}. {convention}")
    if found := faked(got):
        fail(exercise, f"{what}: expected a plain torch.Tensor, got {found}, whose own "
                       f"methods would decide how it compares. {convention}")
    if tuple(got.shape) != tuple(expected.shape):
        fail(exercise, f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}. "
                       f"{convention}")
    if got.dtype != expected.dtype:
        fail(exercise, f"{what}: expected dtype {expected.dtype}, got {got.dtype}. {convention}")
    g, e = got.detach().float().cpu(), expected.detach().float().cpu()
    bad = ~torch.isclose(g, e, atol=atol, rtol=rtol)
    if bad.any():
        diff = torch.where(bad, (g - e).abs().nan_to_num(float("inf")), torch.zeros_like(g))
        flat = int(diff.flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
        msg = (f"{what}: at index {_at(index)} expected {e[index].item():.6g}, got "
               f"{g[index].item():.6g} ({int(bad.sum())} of {g.numel()} values differ by more than "
               f"atol={atol:g} + rtol={rtol:g}). {convention}")
        if callable(hint):
            hint = hint()
        if hint:
            msg += f" Hint: {hint}"
        fail(exercise, msg)


def aten_operators(word: str) -> tuple[str, ...]:
    """torch's own operators (``torch.ops.aten.*``) whose name contains ``word``, as answer
    names: the kernels behind a one-call torch function, which a learner can call directly."""
    return tuple(f"torch:ops.aten.{name}" for name in sorted({
        op.split("::")[1].split(".")[0] for op in torch._C._dispatch_get_all_op_names()
        if op.startswith("aten::") and word in op}))


def native_answer(answer: tuple[str, ...], *ops: str) -> tuple[str, ...]:
    """``answer`` and, where the CPU kernels load, their operators ``ops`` as a learner could
    call them (``torch.ops.minivllm_cpu.NAME``)."""
    from minivllm import cpu_kernels

    loaded = cpu_kernels.library() is not None
    return answer + tuple(f"torch:ops.minivllm_cpu.{op}" for op in ops if loaded)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4, rtol: float = 1e-4) -> bool:
    """For diagnostics: does ``a`` match ``b`` (shapes equal, values close)?"""
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a.detach().float(), b.detach().float(), atol=atol, rtol=rtol))


# -- the real model and engine the learner's components are plugged into ----------------------

PROMPT = "The paged KV cache stores keys and values in fixed-size blocks, so that"

# prompts for engine checks: two share a prefix (shared blocks), lengths differ (chunking)
ENGINE_PROMPTS = [
    "Answer in one short sentence, as a patient teacher would. What is the capital of France?",
    "Answer in one short sentence, as a patient teacher would. Name the three primary colors.",
    "def fibonacci(n):",
    PROMPT,
]


@functools.lru_cache(maxsize=1)
def bundled_model():
    """(model, tokenizer): the bundled SmolLM2-135M-Instruct, float32 on the CPU, loaded once."""
    from transformers import AutoTokenizer

    from minivllm.model.config import ModelConfig
    from minivllm.model.loader import load_model
    from minivllm.model_hub import bundled_model_path

    path = bundled_model_path()
    model = load_model(path, ModelConfig.from_pretrained(path), torch.device("cpu"), torch.float32,
                       show_progress=False)
    return model, AutoTokenizer.from_pretrained(path)


def write_tiny_checkpoint(name: str, **kwargs) -> str:
    """A tiny random-weight Llama (2 layers, hidden 64, 4 query heads over 2 KV heads): the folder
    of ``make_checkpoint(folder, "llama", **kwargs)``, written once into minivllm's cache (the
    graders of every notebook share it) without the "Writing model shards" progress bar."""
    import hashlib
    import os
    import shutil
    import tempfile

    from minivllm.model_hub import cache_dir
    from minivllm.testing import TINY_PRESETS, make_checkpoint

    key = repr((TINY_PRESETS["llama"], sorted(kwargs.items()), torch.__version__))
    root = os.path.join(cache_dir(), "course")
    folder = os.path.join(root, f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from transformers.utils import logging as hf_logging

    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        make_checkpoint(scratch, "llama", **kwargs)
        try:
            os.rename(scratch, folder)  # whole or not at all: config.json marks a finished folder
        except OSError:
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise  # (if it is there, another process wrote it first)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # left only if not renamed
        if shown:
            hf_logging.enable_progress_bar()
    return folder


@functools.lru_cache(maxsize=1)
def check_model_path() -> str:
    """The model the engine checks run: a tiny Llama with the bundled model's tokenizer. The
    engine checks compare schedules, block tables, samplers and caches, not what a model knows,
    and a step of this model costs a small fraction of a SmolLM2 step. Its weights are drawn
    at 10x the usual scale, so its greedy choices are far from ties: a different
    (correct) order of summation cannot flip a token, a wrong computation does."""
    from minivllm.model_hub import bundled_model_path

    return write_tiny_checkpoint("tiny-llama-tokenizer", tokenizer_from=bundled_model_path(),
                                 initializer_range=0.5)


@functools.lru_cache(maxsize=1)
def check_engine():
    """An engine on the check model with small blocks and a small step budget, so block tables
    are non-contiguous and prompts are prefilled in chunks. Components are swapped in and out."""
    from minivllm import LLM

    return LLM(check_model_path(), show_progress=False, device="cpu", block_size=8,
               num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=32, max_num_seqs=16)


class DecodeBackend(AttentionBackend):
    """The reference torch attention, except that each step's decodes are computed by
    ``decode(q [decodes, heads, d], kv_cache, metadata, scale)``: a learner's, in a checker."""

    name = "course-decode"

    def __init__(self, decode) -> None:
        self.decode = decode

    def forward(self, q, k, v, kv_cache, metadata, scale):
        from minivllm.attention.torch_backend import paged_prefill_attention, write_to_kv_cache

        write_to_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd].contiguous(), kv_cache, metadata, scale)
        if metadata.num_prefills:
            qsl = metadata.query_start_loc_cpu
            base, end = int(qsl[nd]), metadata.num_actual_tokens
            out[base:end] = paged_prefill_attention(
                q[base:end], kv_cache, [int(s) - base for s in qsl[nd:]],
                [int(s) for s in metadata.seq_lens_cpu[nd:]], metadata.block_tables[nd:], scale)
        return out


@contextmanager
def decodes_through(llm, decode):
    """While the block runs, every attention layer of ``llm`` decodes through ``decode`` (see
    ``DecodeBackend``; None: unchanged); afterwards the layers are restored, the KV cache zeroed."""
    runner = model_runner(llm)
    layers = runner.model.attention_layers()
    saved = [layer.backend for layer in layers]
    try:
        for layer in layers if decode is not None else ():
            layer.backend = DecodeBackend(decode)
        yield runner
    finally:
        for layer, backend in zip(layers, saved):
            layer.backend = backend
        for cache in runner.kv_caches:  # whatever the learner's code wrote is gone
            cache.zero_()


def greedy_token_ids(llm, prompts: list[str], max_tokens: int = 10) -> list[list[int]]:
    from minivllm import SamplingParams

    llm.llm_engine.reset_prefix_cache()  # nothing computed by another component is reused
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()
    return [o.outputs[0].token_ids for o in outs]


@functools.lru_cache(maxsize=1)
def reference_token_ids() -> tuple[tuple[int, ...], ...]:
    """The check engine's greedy tokens for ``ENGINE_PROMPTS`` with the package's own
    components, computed once: what a grader's run with the learner's component must equal."""
    return tuple(tuple(t) for t in greedy_token_ids(check_engine(), ENGINE_PROMPTS))


def compare_generations(
    exercise: str, what: str, llm, prompts: list[str], got: list[list[int]], expected: list[list[int]]
) -> None:
    tok = llm.get_tokenizer()
    if len(got) != len(expected):
        fail(exercise, f"{what}, the engine returned {len(got)} outputs for {len(expected)} prompts")
    for prompt, g, e in zip(prompts, got, expected):
        first = first_difference(g, e)
        if first is not None:
            ended = (f" (yours has {len(g)} tokens, expected {len(e)})"
                     if first == min(len(g), len(e)) else "")
            fail(exercise, f"{what}, the engine's greedy continuation of {prompt!r} goes wrong at "
                           f"output token {first}{ended}: expected {tok.decode(e)!r}, got "
                           f"{tok.decode(g)!r}")
