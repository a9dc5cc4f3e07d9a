"""Exercise 11.1: tune the scheduler for goodput under P99 targets, graded on the simulator.

The learner writes ``tune(evaluate, targets) -> config``: a search over the three knobs
(``max_num_batched_tokens``, ``long_prefill_token_threshold``, ``max_num_seqs``) that may call
``evaluate(config)`` at most ``MAX_EVALUATIONS`` times. ``evaluate`` runs the chapter's
workload on the simulated engine (the real scheduler and block manager, the cost model of
Llama-3-8B on an H100) and returns the config's goodput: the highest request rate of
``GOODPUT_RATES`` at which the P99 time to first token and the P99 inter-token latency both
stay within ``targets`` (``minivllm.course.capstone.evaluate_goodput``).

The grader draws the targets when it grades (``DRAWS`` sets: a tight inter-token target, a
loose one and one between; a fresh draw unless a seed is given), so no table of answers keyed on
the targets passes, and no fixed choice is right for all of them. For each set it runs the
learner's tuner and passes it when the choice is a valid config whose goodput reaches that of
the grader's own search (a sweep of the budget at 64 sequences, then of the number of
sequences at the best budget, evaluated the same way). A choice that falls short is told
which target it misses at the next rate up, and by how much, never which choice does better.
"""

from __future__ import annotations

import copy
import random

from minivllm.course.capstone import (
    GOODPUT_RATES, KNOBS, TARGET_KEYS, chat_and_documents, config_problem, evaluate_goodput,
)
from minivllm.course.checks.common import Exercise, fail, passed

MAX_EVALUATIONS = 20

TTFT_TARGETS_MS = (300.0, 400.0, 500.0, 600.0, 800.0)
MIDDLE_TTFT_MS = (400.0, 500.0, 600.0)  # where a tight and a loose ITL want different choices
TIGHT_ITL_MS, LOOSE_ITL_MS = (20.0, 25.0), (40.0, 50.0)
DRAWS = 3
SWEEP_BUDGETS = (256, 384, 512, 768, 1024, 1536)
SWEEP_SEQS = (16, 32, 256)


def draw_targets(seed: int | None = None) -> list[dict]:
    """Target sets: a tight P99 ITL, a loose one and one between (the last two with a P99 TTFT
    target where the best budget differs from the tight set's)."""
    rng = random.Random(seed) if seed is not None else random.SystemRandom()
    return [{"p99_ttft_ms": rng.choice(TTFT_TARGETS_MS), "p99_itl_ms": rng.choice(TIGHT_ITL_MS)},
            {"p99_ttft_ms": rng.choice(MIDDLE_TTFT_MS), "p99_itl_ms": rng.choice(LOOSE_ITL_MS)},
            {"p99_ttft_ms": rng.choice(MIDDLE_TTFT_MS), "p99_itl_ms": 30.0}]


def _config(budget: int, seqs: int) -> dict:
    return {"max_num_batched_tokens": budget, "long_prefill_token_threshold": 0,
            "max_num_seqs": seqs}


def _reference_choice(goodput_of) -> dict:
    """The grader's search: the budget at 64 sequences, then the number of sequences."""
    tried = {(b, 64): goodput_of(_config(b, 64))["goodput"] for b in SWEEP_BUDGETS}
    budget = max(tried, key=tried.get)[0]
    tried.update({(budget, n): goodput_of(_config(budget, n))["goodput"] for n in SWEEP_SEQS})
    return _config(*max(tried, key=tried.get))


CONVENTION = (
    "Expected: tune(evaluate, targets) returns a dict with exactly the keys "
    "max_num_batched_tokens (int >= 16), long_prefill_token_threshold (int >= 0; 0: no limit) and "
    "max_num_seqs (int >= 1), after at most "
    f"{MAX_EVALUATIONS} calls to evaluate(config), which returns {{'goodput': requests/s, 'runs': "
    "{rate: {'p99_ttft_ms', 'p99_itl_ms', ...}}, 'limit': the run at the lowest rate that missed a "
    "target, with its 'misses' (ms over each target), or None}.")

NAMES = {"p99_ttft_ms": "P99 TTFT", "p99_itl_ms": "P99 ITL"}
HINTS = {
    "p99_itl_ms": "every decode in a step waits for the whole step: a step that also carries "
                  "prefill chunks is as long as its tokens make it (max_num_batched_tokens, "
                  "long_prefill_token_threshold)",
    "p99_ttft_ms": "a request waits for a free seat (max_num_seqs) and then for its prompt's "
                   "chunks (max_num_batched_tokens, long_prefill_token_threshold); past the "
                   "engine's capacity the queue grows",
}


def _describe_misses(run: dict, targets: dict) -> str:
    parts = [f"{NAMES[k]} {run[k]:.1f} ms > {targets[k]:g} ms (by {run['misses'][k]:.1f} ms)"
             for k in TARGET_KEYS if k in run["misses"]]
    return " and ".join(parts)


def _show(config: dict) -> str:
    return ", ".join(f"{k}={int(config[k])}" for k in KNOBS)


ANSWER = ("minivllm.course.checks.capstone:_reference_choice",
          "minivllm.course.checks.capstone:draw_targets")


def check_goodput_tuner(tune, exercise: str = "11.1", seed: int | None = None) -> None:
    """``tune(evaluate, targets) -> {max_num_batched_tokens, long_prefill_token_threshold,
    max_num_seqs}``, graded on the simulated engine for target sets drawn now (``seed``: the
    same draw again)."""
    ex = Exercise(exercise, CONVENTION, ANSWER, allowed="the evaluate it is given")
    tune = ex.take(tune, "tune")
    workload = chat_and_documents()
    for targets in draw_targets(seed):
        memo: dict[tuple, dict] = {}
        calls = [0]

        def goodput_of(config: dict) -> dict:
            key = tuple(int(config[k]) for k in KNOBS)
            if key not in memo:
                memo[key] = evaluate_goodput(config, workload, targets)
            return memo[key]

        @ex.provide
        def evaluate(config):
            problem = config_problem(config)
            if problem:
                fail(exercise, f"tune called evaluate with an invalid config ({problem}). "
                               f"{CONVENTION}")
            calls[0] += 1
            if calls[0] > MAX_EVALUATIONS:
                fail(exercise, f"tune called evaluate more than {MAX_EVALUATIONS} times for "
                               f"targets {targets}: search the knobs with fewer evaluations (each "
                               "is a set of simulated serving runs). " + CONVENTION)
            return copy.deepcopy(goodput_of(config))

        got = tune(evaluate, dict(targets))
        problem = config_problem(got)
        if problem:
            fail(exercise, f"for targets {targets}, tune returned {got!r}: {problem}. {CONVENTION}")
        mine, ref = goodput_of(got), goodput_of(_reference_choice(goodput_of))
        where = (f"for targets P99 TTFT <= {targets['p99_ttft_ms']:g} ms, P99 ITL <= "
                 f"{targets['p99_itl_ms']:g} ms (drawn now), your choice ({_show(got)})")
        if mine["goodput"] < ref["goodput"]:
            limit = mine["limit"]
            missed = sorted(limit["misses"], key=lambda k: -limit["misses"][k] / targets[k])
            if mine["goodput"] == 0:
                fail(exercise, f"{where} misses the targets even at the lowest rate, "
                               f"{limit['rate']:g} requests/s: {_describe_misses(limit, targets)}. "
                               f"The grader's search sustains {ref['goodput']:g} requests/s. "
                               f"Hint: {HINTS[missed[0]]}.")
            fail(exercise, f"{where} sustains {mine['goodput']:g} requests/s within them; the "
                           f"grader's search sustains {ref['goodput']:g}. At "
                           f"{limit['rate']:g} requests/s yours misses: "
                           f"{_describe_misses(limit, targets)}. Hint: {HINTS[missed[0]]}.")
    passed(exercise, f"your tuner's choices reach the goodput of the grader's search for "
                     f"{DRAWS} sets of targets drawn when it was graded, within "
                     f"{MAX_EVALUATIONS} evaluations each.")


__all__ = ["check_goodput_tuner", "draw_targets", "MAX_EVALUATIONS", "GOODPUT_RATES"]
