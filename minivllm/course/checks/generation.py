"""Checker for chapter 02's exercise 2.2: a generation loop with a KV cache.

``generate_with_cache(model, prompt_ids, n, block_size) -> n token ids``, greedy. On the check
model, for random prompts, lengths and block sizes, the tokens must equal the package's greedy
generation, and the recorded forward passes must be one prefill of the whole prompt at
positions 0..P-1, then one token per step at P, P+1, ...; anything else (no cache, a prompt fed
token by token, a wrong position) fails naming the forward. The package's own loop
(``minivllm.model.standalone.greedy_generate``) is refused.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from minivllm.course.checks.common import Exercise, check_model_path, fail, passed

CONVENTION = (
    "Expected: the first forward computes the whole prompt (P tokens at positions 0..P-1) and "
    "gives the first new token (the argmax of its last position's logits); every later forward "
    "feeds only the token just chosen, at the next position (P, P+1, ...), its keys and values "
    "joining the cache, and gives the next token. n new tokens take n forwards.")


@functools.lru_cache(maxsize=1)
def _model():
    from minivllm.model.config import ModelConfig
    from minivllm.model.loader import load_model

    path = check_model_path()
    return load_model(path, ModelConfig.from_pretrained(path), torch.device("cpu"), torch.float32,
                      show_progress=False)


def _reference(model, prompt: list[int], n: int) -> list[int]:
    """The package's greedy tokens (its loop equals recomputing without a cache: tests and
    chapter 02 check it), computed before the learner's loop runs."""
    from minivllm.model.standalone import greedy_generate

    return greedy_generate(model, prompt, n)[0]


class _Recorder:
    """Wraps ``model.forward``: records (token ids, positions) of every forward pass."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []
        self.forward = model.forward

    def __call__(self, input_ids, positions, *args, **kwargs):
        self.calls.append((torch.as_tensor(input_ids).tolist(),
                           torch.as_tensor(positions).tolist()))
        return self.forward(input_ids, positions, *args, **kwargs)

    def __enter__(self):
        self.model.forward = self
        return self

    def __exit__(self, *exc):
        del self.model.forward  # the class's forward again


def check_cached_generation(generate_with_cache, exercise: str = "2.2", seed: int = 0) -> None:
    """``generate_with_cache(model, prompt_ids, n, block_size) -> list of n token ids``."""
    generate_with_cache = Exercise(
        exercise, answer=["minivllm.model.standalone:greedy_generate"],
        allowed="single_sequence_metadata, get_attention_backend, model(...) and "
                "model.compute_logits").take(generate_with_cache, "generate_with_cache")
    model = _model()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    cases = [(1, 3, 16), (16, 4, 16), (17, 5, 4)] + [
        (int(rng.integers(1, 40)), int(rng.integers(1, 10)), int(rng.choice([1, 3, 8, 16])))
        for _ in range(3)]
    forwards = 0
    for prompt_len, n, block_size in cases:
        prompt = rng.integers(10, vocab, prompt_len).tolist()
        expected = _reference(model, prompt, n)
        for layer in model.attention_layers():  # the loop sets up its own cache
            layer.kv_cache, layer.backend = None, None
        what = (f"generate_with_cache(model, a {prompt_len}-token prompt, n={n}, "
                f"block_size={block_size})")
        with _Recorder(model) as rec:
            got = generate_with_cache(model, list(prompt), n, block_size)
        try:
            got = [int(t) for t in got]
        except (TypeError, ValueError):
            fail(exercise, f"{what} returned {type(got).__name__}; expected a list of {n} token "
                           f"ids (ints).")
        _check_forwards(exercise, what, rec.calls, prompt, n, got)
        if got != expected:
            first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                         min(len(got), len(expected)))
            fail(exercise, f"{what}: the forwards fed the right tokens at the right positions, "
                           f"but the new tokens differ from the package's greedy generation "
                           f"at token {first}: expected {expected}, got {got}. Take the argmax "
                           f"of the logits of the forward's last position. {CONVENTION}")
        forwards += len(rec.calls)
    lengths, blocks = [c[0] for c in cases], [c[2] for c in cases]
    passed(exercise, f"generate_with_cache gives the package's greedy tokens on {len(cases)} "
                     f"random prompts ({min(lengths)} to {max(lengths)} tokens, blocks of "
                     f"{min(blocks)} to {max(blocks)}), in {forwards} forwards: each prompt "
                     f"computed once, then one token per step.")


def _check_forwards(exercise: str, what: str, calls: list, prompt: list[int], n: int,
                    got: list[int]) -> None:
    P = len(prompt)
    if not calls:
        fail(exercise, f"{what} never ran the model. {CONVENTION}")
    ids, pos = calls[0]
    if ids != prompt or pos != list(range(P)):
        if len(ids) < P and ids == prompt[:len(ids)]:
            fail(exercise, f"{what}: the first forward fed {len(ids)} of the prompt's {P} tokens: "
                           f"prefill the whole prompt in one forward. {CONVENTION}")
        fail(exercise, f"{what}: the first forward fed tokens {_short(ids)} at positions "
                       f"{_short(pos)}; expected the prompt {_short(prompt)} at positions "
                       f"0..{P - 1}. {CONVENTION}")
    for step, (ids, pos) in enumerate(calls[1:], 1):
        if len(ids) != 1:
            fail(exercise, f"{what}: forward {step + 1} fed {len(ids)} tokens (positions "
                           f"{_short(pos)}); a decode step feeds only the token just chosen, the "
                           f"earlier ones' keys and values are in the cache. {CONVENTION}")
        if step - 1 < len(got) and ids != [got[step - 1]]:
            fail(exercise, f"{what}: forward {step + 1} fed token {ids[0]}; expected the token "
                           f"the previous forward chose ({got[step - 1]}). {CONVENTION}")
        if pos != [P + step - 1]:
            fail(exercise, f"{what}: forward {step + 1} fed its token at position {pos[0]}; "
                           f"expected position {P + step - 1} (the sequence's length before "
                           f"it). {CONVENTION}")
    if len(calls) != n or len(got) != n:
        fail(exercise, f"{what}: {len(calls)} forwards returned {len(got)} tokens; expected n={n} "
                       f"forwards and {n} tokens. {CONVENTION}")


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, ..., {values[-1]}]"
