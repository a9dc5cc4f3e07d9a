"""Exercise 11.1: tune the scheduler for goodput under P99 targets, graded on the simulator.

The learner writes ``tune(evaluate, targets) -> config``: a search over the three knobs
(``max_num_batched_tokens``, ``long_prefill_token_threshold``, ``max_num_seqs``) that may call
``evaluate(config)`` at most ``MAX_EVALUATIONS`` times. ``evaluate`` runs the chapter's
workload on the simulated engine (the real scheduler and block manager, the cost model of
Llama-3-8B on an H100) and returns the config's goodput: the highest request rate of
``GOODPUT_RATES`` at which the P99 time to first token and the P99 inter-token latency both
stay within ``targets`` (``minivllm.course.capstone.evaluate_goodput``).

The grader runs the learner's tuner on two sets of targets and passes it when each choice is a
valid config whose goodput reaches that of a reference choice (found by a grid search over
256-8192 tokens, thresholds none-1024, 4-256 sequences, and re-evaluated here, so it follows the
scheduler as it is). A choice that falls short is told which target it misses at the next rate
up, and by how much. While the tuner runs, the reference choices (``CASES``) are out of its reach.
"""

from __future__ import annotations

import copy
import sys

from minivllm.course.capstone import (
    GOODPUT_RATES, KNOBS, TARGET_KEYS, chat_and_documents, config_problem, evaluate_goodput,
)
from minivllm.course.checks.common import fail, passed

MAX_EVALUATIONS = 20

# (targets, the reference choice: the best of the grid search for those targets)
CASES = (
    ({"p99_ttft_ms": 500.0, "p99_itl_ms": 25.0},
     {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 0, "max_num_seqs": 64}),
    ({"p99_ttft_ms": 400.0, "p99_itl_ms": 40.0},
     {"max_num_batched_tokens": 1024, "long_prefill_token_threshold": 0, "max_num_seqs": 64}),
)

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


class _Hidden:
    """Stands in for ``CASES`` while the learner's tuner runs: the references are the grader's."""

    def __init__(self, exercise: str) -> None:
        self.exercise = exercise

    def _refuse(self, *args, **kwargs):
        fail(self.exercise, "tune reads the grader's reference choices (checks.capstone.CASES); "
                            "search with evaluate instead")

    __getitem__ = __iter__ = __len__ = _refuse


def _describe_misses(run: dict, targets: dict) -> str:
    parts = [f"{NAMES[k]} {run[k]:.1f} ms > {targets[k]:g} ms (by {run['misses'][k]:.1f} ms)"
             for k in TARGET_KEYS if k in run["misses"]]
    return " and ".join(parts)


def _show(config: dict) -> str:
    return ", ".join(f"{k}={int(config[k])}" for k in KNOBS)


def check_goodput_tuner(tune, exercise: str = "11.1") -> None:
    """``tune(evaluate, targets) -> {max_num_batched_tokens, long_prefill_token_threshold,
    max_num_seqs}``, graded on the simulated engine for two sets of P99 targets."""
    workload = chat_and_documents()
    cases = CASES
    report = []
    for targets, reference in cases:
        memo: dict[tuple, dict] = {}
        calls = [0]

        def goodput_of(config: dict) -> dict:
            key = tuple(int(config[k]) for k in KNOBS)
            if key not in memo:
                memo[key] = evaluate_goodput(config, workload, targets)
            return memo[key]

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

        module = sys.modules[__name__]
        module.CASES = _Hidden(exercise)
        try:
            got = tune(evaluate, dict(targets))
        finally:
            module.CASES = cases
        problem = config_problem(got)
        if problem:
            fail(exercise, f"for targets {targets}, tune returned {got!r}: {problem}. {CONVENTION}")
        mine, ref = goodput_of(got), goodput_of(reference)
        where = (f"for targets P99 TTFT <= {targets['p99_ttft_ms']:g} ms, P99 ITL <= "
                 f"{targets['p99_itl_ms']:g} ms, your choice ({_show(got)})")
        if mine["goodput"] < ref["goodput"]:
            limit = mine["limit"]
            missed = sorted(limit["misses"], key=lambda k: -limit["misses"][k] / targets[k])
            if mine["goodput"] == 0:
                fail(exercise, f"{where} misses the targets even at the lowest rate, "
                               f"{limit['rate']:g} requests/s: {_describe_misses(limit, targets)}. "
                               f"The reference choice sustains {ref['goodput']:g} requests/s. "
                               f"Hint: {HINTS[missed[0]]}.")
            fail(exercise, f"{where} sustains {mine['goodput']:g} requests/s within them; the "
                           f"reference choice sustains {ref['goodput']:g}. At "
                           f"{limit['rate']:g} requests/s yours misses: "
                           f"{_describe_misses(limit, targets)}. Hint: {HINTS[missed[0]]}.")
        report.append(f"{mine['goodput']:g} requests/s ({_show(got)}; the reference's: "
                      f"{ref['goodput']:g}) in {calls[0]} evaluations")
    passed(exercise, "your tuner's choices reach the reference's goodput for both sets of "
                     f"targets: {'; '.join(report)}.")


__all__ = ["check_goodput_tuner", "CASES", "MAX_EVALUATIONS", "GOODPUT_RATES"]
