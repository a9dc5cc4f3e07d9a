"""Exercise 2.2: a greedy generation loop with a KV cache, graded by its tokens and by the
(token ids, positions) of every forward pass it runs on the check model."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import numpy as np
import torch

from minivllm.course.checks.common import Exercise, check_model_path, first_difference

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


@contextmanager
def _recording(model):
    """Yields the (token ids, positions) of every forward pass ``model`` runs meanwhile."""
    calls, forward = [], model.forward

    def record(input_ids, positions, *args, **kwargs):
        calls.append((torch.as_tensor(input_ids).tolist(), torch.as_tensor(positions).tolist()))
        return forward(input_ids, positions, *args, **kwargs)
    model.forward = record
    try:
        yield calls
    finally:
        del model.forward  # the class's forward again


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, ..., {values[-1]}]"


def _forward_problem(calls: list, prompt: list[int], n: int, got: list[int]) -> str | None:
    """What the recorded forwards did wrong; None for one prefill, then one token per step."""
    P = len(prompt)
    if not calls:
        return "never ran the model."
    ids, pos = calls[0]
    if len(ids) < P and ids == prompt[:len(ids)]:
        return (f"the first forward fed {len(ids)} of the prompt's {P} tokens: prefill the whole "
                "prompt in one forward.")
    if ids != prompt or pos != list(range(P)):
        return (f"the first forward fed tokens {_short(ids)} at positions {_short(pos)}; expected "
                f"the prompt {_short(prompt)} at positions 0..{P - 1}.")
    for step, (ids, pos) in enumerate(calls[1:], 1):
        if len(ids) != 1:
            return (f"forward {step + 1} fed {len(ids)} tokens (positions {_short(pos)}); a decode "
                    "step feeds only the token just chosen, the earlier ones' keys and values are "
                    "in the cache.")
        if step - 1 < len(got) and ids != [got[step - 1]]:
            return (f"forward {step + 1} fed token {ids[0]}; expected the token the previous "
                    f"forward chose ({got[step - 1]}).")
        if pos != [P + step - 1]:
            return (f"forward {step + 1} fed its token at position {pos[0]}; expected position "
                    f"{P + step - 1} (the sequence's length before it).")
    if len(calls) != n or len(got) != n:
        return (f"{len(calls)} forwards returned {len(got)} tokens; expected n={n} forwards and "
                f"{n} tokens.")
    return None


def check_cached_generation(generate_with_cache, exercise: str = "2.2", seed: int = 0) -> None:
    """``generate_with_cache(model, prompt_ids, n, block_size) -> list of n token ids``."""
    from minivllm.model.standalone import greedy_generate
    ex = Exercise(exercise, CONVENTION, ["minivllm.model.standalone:greedy_generate"],
                  allowed="single_sequence_metadata, get_attention_backend, model(...) and "
                          "model.compute_logits")
    generate_with_cache = ex.take(generate_with_cache, "generate_with_cache")
    model, rng = _model(), np.random.default_rng(seed)
    cases = [(1, 3, 16), (16, 4, 16), (17, 5, 4)] + [  # (prompt length, n, block size)
        (int(rng.integers(1, 40)), int(rng.integers(1, 10)), int(rng.choice([1, 3, 8, 16])))
        for _ in range(3)]
    forwards = 0
    for prompt_len, n, block_size in cases:
        prompt = rng.integers(10, model.config.vocab_size, prompt_len).tolist()
        expected = greedy_generate(model, prompt, n)[0]  # before the learner's loop runs
        for layer in model.attention_layers():  # the loop sets up its own cache
            layer.kv_cache, layer.backend = None, None
        what = (f"generate_with_cache(model, a {prompt_len}-token prompt, n={n}, "
                f"block_size={block_size})")
        with _recording(model) as calls:
            got = generate_with_cache(model, list(prompt), n, block_size)
        try:
            got = [int(t) for t in got]
        except (TypeError, ValueError):
            ex.fail(f"{what} returned {type(got).__name__}; expected a list of {n} token ids.")
        problem = _forward_problem(calls, prompt, n, got)
        if problem is None and got != expected:
            problem = (f"the forwards fed the right tokens at the right positions, but the new "
                       f"tokens differ from the package's greedy generation at token "
                       f"{first_difference(got, expected)}: expected {expected}, got {got}. Take "
                       "the argmax of the logits of the forward's last position.")
        if problem:
            ex.fail(f"{what}: {problem}")
        forwards += len(calls)
    lengths, blocks = [c[0] for c in cases], [c[2] for c in cases]
    ex.passed(f"generate_with_cache gives the package's greedy tokens on {len(cases)} "
              f"random prompts ({min(lengths)} to {max(lengths)} tokens, blocks of "
              f"{min(blocks)} to {max(blocks)}), in {forwards} forwards: each prompt "
              f"computed once, then one token per step.")
