"""Checker for chapter 05's exercise 5.2: choose the chunking knobs, graded on the simulator.

The learner picks ``max_num_batched_tokens`` and ``long_prefill_token_threshold`` for the best
mean time to first token (TTFT) while the P99 time per output token (TPOT: the gaps between a
request's consecutive tokens) stays within ``TPOT_LIMIT_MS``, on chapter 11's serving workload
(chats and, now and then, a long document; ``capstone.chat_and_documents``) arriving at
``RATE`` requests/s on the simulated engine: the real v1 scheduler and block manager, the cost
model of Llama-3-8B on one H100 (``minivllm.sim``). ``evaluate_chunking`` runs one choice,
through the same ``capstone.simulate_at_rate`` that grades chapter 11's tuner.

The grader runs the choice, checks the TPOT limit, and runs a grid search itself (``GRID``,
26 choices, a few seconds): the choice passes when its mean TTFT is within ``MARGIN`` of the
grid's best that meets the limit. It says what it measured either way.
"""

from __future__ import annotations

import functools

from minivllm.course.capstone import chat_and_documents, config_problem, simulate_at_rate
from minivllm.course.checks.common import fail, passed

RATE = 16.0  # requests/s
TPOT_LIMIT_MS = 20.0
MAX_NUM_SEQS = 64
MARGIN = 0.10  # a choice passes within 10% of the grid's best mean TTFT
KEYS = ("max_num_batched_tokens", "long_prefill_token_threshold")
BUDGETS = (128, 256, 512, 1024, 2048, 4096)
THRESHOLDS = (0, 64, 128, 256, 512, 1024)
GRID = tuple((b, t) for b in BUDGETS for t in THRESHOLDS if t < b)

CONVENTION = (
    f"Expected: a dict with exactly the keys max_num_batched_tokens (an int >= 16) and "
    f"long_prefill_token_threshold (an int >= 0; 0: no cap), whose P99 TPOT on the simulated "
    f"workload at {RATE:g} requests/s is at most {TPOT_LIMIT_MS:g} ms, and whose mean TTFT is "
    f"within {MARGIN:.0%} of the best that a grid search finds under that limit.")


@functools.lru_cache(maxsize=None)
def _run(max_num_batched_tokens: int, long_prefill_token_threshold: int) -> dict:
    config = {"max_num_batched_tokens": max_num_batched_tokens,
              "long_prefill_token_threshold": long_prefill_token_threshold,
              "max_num_seqs": MAX_NUM_SEQS}
    run = simulate_at_rate(config, chat_and_documents(), RATE)
    return {"mean_ttft_ms": run["mean_ttft_ms"], "p50_ttft_ms": run["p50_ttft_ms"],
            "p99_ttft_ms": run["p99_ttft_ms"], "p99_tpot_ms": run["p99_itl_ms"]}


def evaluate_chunking(max_num_batched_tokens: int, long_prefill_token_threshold: int) -> dict:
    """One choice on the simulated workload: mean, P50 and P99 TTFT, and P99 TPOT (ms)."""
    return dict(_run(int(max_num_batched_tokens), int(long_prefill_token_threshold)))


def grid_best() -> tuple[tuple[int, int], dict, int]:
    """The grid's best choice under the TPOT limit: ((budget, threshold), its run, choices
    within the limit)."""
    within = [(key, _run(*key)) for key in GRID if _run(*key)["p99_tpot_ms"] <= TPOT_LIMIT_MS]
    key, run = min(within, key=lambda kr: kr[1]["mean_ttft_ms"])
    return key, run, len(within)


def _show(budget: int, threshold: int) -> str:
    return f"max_num_batched_tokens={budget}, long_prefill_token_threshold={threshold}"


def _problem(choice) -> str | None:
    return config_problem(choice, KEYS)


def check_chunking_choice(choice, exercise: str = "5.2") -> None:
    """``choice``: {max_num_batched_tokens, long_prefill_token_threshold}."""
    problem = _problem(choice)
    if problem:
        fail(exercise, f"your choice {choice!r}: {problem}. {CONVENTION}")
    budget, threshold = (int(choice[k]) for k in KEYS)
    mine = _run(budget, threshold)
    (best_b, best_t), best, feasible = grid_best()
    measured = (f"your choice ({_show(budget, threshold)}): mean TTFT {mine['mean_ttft_ms']:.0f} "
                f"ms, P99 TPOT {mine['p99_tpot_ms']:.1f} ms")
    reference = (f"the best of a grid search over {len(GRID)} choices ({feasible} within the "
                 f"limit) is {_show(best_b, best_t)}: mean TTFT {best['mean_ttft_ms']:.0f} ms, "
                 f"P99 TPOT {best['p99_tpot_ms']:.1f} ms")
    if mine["p99_tpot_ms"] > TPOT_LIMIT_MS:
        fail(exercise, f"{measured}, over the {TPOT_LIMIT_MS:g} ms limit: every decode in a step "
                       f"waits for the whole step, and a step is as long as its tokens make it "
                       f"(a smaller max_num_batched_tokens or long_prefill_token_threshold "
                       f"shortens the steps that carry prefill chunks). For comparison, "
                       f"{reference}. {CONVENTION}")
    if mine["mean_ttft_ms"] > best["mean_ttft_ms"] * (1 + MARGIN):
        fail(exercise, f"{measured}, within the limit, but {reference}; yours is "
                       f"{mine['mean_ttft_ms'] / best['mean_ttft_ms'] - 1:.0%} slower to the first "
                       f"token, more than {MARGIN:.0%}. Hint: too small a budget or cap spreads "
                       f"each prompt over many steps; too large a cap (or none) lets a "
                       f"document's chunks take each step's budget while the chats behind it "
                       f"wait. {CONVENTION}")
    passed(exercise, f"{measured} (limit {TPOT_LIMIT_MS:g} ms); {reference}. Yours is within "
                     f"{MARGIN:.0%} of it, on the simulated H100 at {RATE:g} requests/s.")
