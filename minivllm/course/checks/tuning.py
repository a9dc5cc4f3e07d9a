"""Checker for exercise 5.2: the chunking knobs with the best mean TTFT under a P99 TPOT limit,
on settings drawn when grading, against the grader's grid search on the simulated engine."""

from __future__ import annotations

import functools
import random

from minivllm.course.capstone import chat_and_documents, config_problem, simulate_at_rate
from minivllm.course.checks.common import Exercise

RATES = (6.0, 10.0, 16.0, 24.0, 32.0)  # requests/s
# P99 TPOT limits (ms): a tight one and a loose one (no single choice is good for both), then any
TIGHT, LOOSE, MIDDLE = (12.0, 15.0), (50.0, 80.0), (20.0, 30.0)
MAX_NUM_SEQS, MARGIN = 64, 0.10  # a choice passes within MARGIN of the best mean TTFT
KEYS = ("max_num_batched_tokens", "long_prefill_token_threshold")
GRID = tuple((b, t) for b in (128, 256, 512, 1024, 2048, 4096)
             for t in (0, 64, 128, 256, 512, 1024) if t < b)
CONVENTION = (
    "Expected: choose_chunking(evaluate, tpot_limit_ms) returns a dict with exactly the keys "
    "max_num_batched_tokens (an int >= 16) and long_prefill_token_threshold (an int >= 0; 0: no "
    "cap), whose P99 TPOT (evaluate(budget, threshold)['p99_tpot_ms']) is at most tpot_limit_ms "
    f"and whose mean TTFT is within {MARGIN:.0%} of the best that a grid search finds under that "
    "limit.")
ANSWER = ("minivllm.course.checks.tuning:_grid_best", "minivllm.course.checks.tuning:draw_settings")


@functools.cache
def _run(budget: int, threshold: int, rate: float) -> dict:
    config = dict(zip(KEYS, (budget, threshold)), max_num_seqs=MAX_NUM_SEQS)
    run = simulate_at_rate(config, chat_and_documents(), rate)
    return {**{k: run[k] for k in ("mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms")},
            "p99_tpot_ms": run["p99_itl_ms"]}


def evaluate_chunking(max_num_batched_tokens: int, long_prefill_token_threshold: int,
                      rate: float = 16.0) -> dict:
    """One choice at ``rate`` requests/s: mean, P50 and P99 TTFT, and P99 TPOT (ms)."""
    return dict(_run(int(max_num_batched_tokens), int(long_prefill_token_threshold), float(rate)))


def _grid_best(rate: float, limit: float) -> dict | None:
    """The run of the grid's best choice under ``limit`` (None if none)."""
    within = [_run(*key, rate) for key in GRID if _run(*key, rate)["p99_tpot_ms"] <= limit]
    return min(within, key=lambda run: run["mean_ttft_ms"]) if within else None


def draw_settings(seed: int | None = None) -> list[tuple[float, float]]:
    """(rate, TPOT limit) settings: a tight limit, a loose one, and one of any."""
    rng = random.Random(seed) if seed is not None else random.SystemRandom()
    limits = [rng.choice(TIGHT), rng.choice(LOOSE), rng.choice(TIGHT + MIDDLE + LOOSE)]
    return [(rng.choice(RATES), limit) for limit in limits]


def check_chunking_choice(choose_chunking, exercise: str = "5.2", seed: int | None = None) -> None:
    """``choose_chunking(evaluate, tpot_limit_ms) -> {max_num_batched_tokens,
    long_prefill_token_threshold}``, on settings drawn now (``seed``: the same draw again)."""
    ex = Exercise(exercise, CONVENTION, ANSWER, allowed="the evaluate it is given")
    if isinstance(choose_chunking, dict) or not callable(choose_chunking):
        ex.fail(f"expected a function choose_chunking(evaluate, tpot_limit_ms), got "
                f"{type(choose_chunking).__name__}: the grader draws the arrival rate and the "
                "limit when it grades, so a fixed choice cannot be graded.")
    choose_chunking = ex.take(choose_chunking, "choose_chunking")
    settings = draw_settings(seed)
    for n, (rate, limit) in enumerate(settings, 1):
        evaluate = ex.provide(functools.partial(evaluate_chunking, rate=rate))
        choice = choose_chunking(evaluate, limit)
        if problem := config_problem(choice, KEYS):
            ex.fail(f"your choice {choice!r}: {problem}.")
        budget, threshold = (int(choice[k]) for k in KEYS)
        mine, best = _run(budget, threshold, rate), _grid_best(rate, limit)
        where = (f"setting {n} (drawn now: {rate:g} requests/s, P99 TPOT limit {limit:g} ms), "
                 f"your choice (max_num_batched_tokens={budget}, long_prefill_token_threshold="
                 f"{threshold}): mean TTFT {mine['mean_ttft_ms']:.0f} ms, P99 TPOT "
                 f"{mine['p99_tpot_ms']:.1f} ms")
        if mine["p99_tpot_ms"] > limit:
            ex.fail(f"{where}, over the limit: every decode in a step waits for the whole step, "
                    "and a step is as long as its tokens make it (a smaller "
                    "max_num_batched_tokens or long_prefill_token_threshold shortens the steps "
                    "that carry prefill chunks).")
        if mine["mean_ttft_ms"] > best["mean_ttft_ms"] * (1 + MARGIN):
            slower = mine["mean_ttft_ms"] / best["mean_ttft_ms"] - 1
            ex.fail(f"{where}, within the limit, but {slower:.0%} slower to the first token than "
                    "the best choice of the grader's grid search under that limit (more than "
                    f"{MARGIN:.0%}).", hint="too small a budget or cap spreads each prompt over "
                    "many steps; too large a cap (or none) lets a document's chunks take each "
                    "step's budget while the chats behind it wait.")
    ex.passed(f"on {len(settings)} settings drawn when it was graded (arrival rate and P99 TPOT "
              f"limit), your choices met the limit with a mean TTFT within {MARGIN:.0%} of the "
              "best a grid search finds, on the simulated H100.")
