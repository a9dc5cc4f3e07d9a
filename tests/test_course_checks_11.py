"""The checker of chapter 11 (Exercise 11.1, tuning the scheduler for goodput under P99 targets
on the simulated engine): a correct tuner passes, and each classic mistake fails with a
CheckFailed that names the target missed (and by how much) or the convention broken."""

import functools

import pytest

from minivllm.course import checks
from minivllm.course.capstone import (
    GOODPUT_RATES, chat_and_documents, config_problem, evaluate_goodput, simulate_at_rate,
)
from minivllm.course.checks.capstone import MAX_EVALUATIONS, _reference_choice, draw_targets
from tests.course_helpers import fails


# targets 600/25, 400/50, 600/30 ms
_fails = functools.partial(fails, checks.check_goodput_tuner, seed=0, starts="Exercise 11.1: ")


def _config(budget, threshold, seqs):
    return {"max_num_batched_tokens": budget, "long_prefill_token_threshold": threshold,
            "max_num_seqs": seqs}


def sweep_tuner(evaluate, targets):
    """A plain search, not the solution's: the budget first (at 64 sequences), then the number
    of sequences at the best budget; the most goodput wins."""
    tried = {}
    for budget in (256, 384, 512, 768, 1024, 1536):
        tried[(budget, 0, 64)] = evaluate(_config(budget, 0, 64))["goodput"]
    best = max(tried, key=tried.get)
    for seqs in (16, 32, 256):
        tried[(best[0], 0, seqs)] = evaluate(_config(best[0], 0, seqs))["goodput"]
    return _config(*max(tried, key=tried.get))


def fixed(config):
    def tune(evaluate, targets):
        return dict(config) if isinstance(config, dict) else config
    return tune


@functools.lru_cache(maxsize=None)
def shortfall(budget, threshold, seqs):
    """(this choice's goodput, the grader's search's) on the simulated engine, for the first
    set of targets drawn with seed 0 at which the choice sustains less: what the grader must
    report. None if it never falls short."""
    workload = chat_and_documents()
    for targets in draw_targets(0):
        def goodput_of(config):
            return evaluate_goodput(config, workload, targets)
        mine = goodput_of(_config(budget, threshold, seqs))["goodput"]
        best = goodput_of(_reference_choice(goodput_of))["goodput"]
        if mine < best:
            return mine, best
    return None


# -- a correct answer ------------------------------------------------------------------------

def test_a_search_that_reaches_the_reference_passes(capsys):
    checks.check_goodput_tuner(sweep_tuner, seed=0)
    out = capsys.readouterr().out
    assert out.startswith("Exercise 11.1 passed") and "drawn when it was graded" in out, out


def test_the_drawn_targets_differ_and_the_references_goodput_is_inside_the_ladder():
    workload = chat_and_documents()
    assert draw_targets(0) == draw_targets(0) != draw_targets(1)
    for targets in draw_targets(0):
        reference = _reference_choice(lambda c: evaluate_goodput(c, workload, targets))
        assert config_problem(reference) is None
        ev = evaluate_goodput(reference, workload, targets)
        assert GOODPUT_RATES[0] < ev["goodput"] < GOODPUT_RATES[-1], (targets, ev["goodput"])


def test_the_simulation_is_deterministic():
    workload = chat_and_documents()
    config = _config(512, 0, 64)
    assert simulate_at_rate(config, workload, 12.0) == simulate_at_rate(config, workload, 12.0)


# -- typical mistakes ------------------------------------------------------------------------

def test_maximising_throughput_and_ignoring_the_itl_target_fails_naming_it():
    # a GPU's default budget: whole documents in one step, every decode in it waits
    _, best = shortfall(8192, 0, 256)
    message = _fails(fixed(_config(8192, 0, 256)), "P99 ITL", "> 25 ms (by",
                     f"grader's search sustains {best:g}", "max_num_batched_tokens")
    assert "max_num_batched_tokens=8192" in message


def test_a_budget_too_large_for_any_rate_says_it_misses_at_the_lowest_rate():
    lowest = f"even at the lowest rate, {GOODPUT_RATES[0]:g} requests/s"
    _fails(fixed(_config(2048, 0, 256)), lowest, "P99 ITL")


def test_too_few_sequences_fails_on_the_ttft_target():
    _fails(fixed(_config(512, 0, 4)), "P99 TTFT", "> 600 ms (by", "max_num_seqs")


@pytest.mark.parametrize("budget, where", [(512, "P99 ITL <= 50 ms"), (1024, "P99 ITL <= 25 ms")])
def test_one_fixed_choice_cannot_serve_every_drawn_set_of_targets(budget, where):
    _fails(fixed(_config(budget, 0, 64)), where, "(drawn now)")


def test_a_table_keyed_on_targets_fails_on_targets_drawn_at_grading():
    table = {(500.0, 25.0): _config(512, 0, 64), (400.0, 40.0): _config(1024, 0, 64)}

    def tune(evaluate, targets):
        return table.get((targets["p99_ttft_ms"], targets["p99_itl_ms"]), _config(512, 0, 64))

    _fails(tune, "(drawn now)", "the grader's search sustains")


def test_an_over_cautious_choice_reaches_less_goodput():
    mine, best = shortfall(256, 0, 64)
    assert 0 < mine < best
    _fails(fixed(_config(256, 0, 64)), f"sustains {mine:g} requests/s within them; the grader's "
           f"search sustains {best:g}.")


@pytest.mark.parametrize("returned, fragment", [
    ({"max_num_batched_tokens": 512, "max_num_seqs": 64}, "exactly the keys"),
    ({**_config(512, 0, 64), "enable_chunked_prefill": True}, "exactly the keys"),
    (_config("512", 0, 64), "max_num_batched_tokens must be an int"),
    (_config(512, 0.5, 64), "long_prefill_token_threshold must be an int"),
    (_config(512, -1, 64), "long_prefill_token_threshold must be in [0, 65536]"),
    (_config(512, 0, 0), "max_num_seqs must be in [1, 65536]"),
    ((512, 0, 64), "expected a dict"),
])
def test_a_malformed_choice_fails_with_the_convention(returned, fragment):
    _fails(fixed(returned), fragment, "Expected: tune(evaluate, targets)")


def test_too_many_evaluations_fail():
    def grid(evaluate, targets):
        for _ in range(MAX_EVALUATIONS + 5):  # each call counts, even of a choice tried before
            evaluate(_config(512, 0, 64))
        return _config(512, 0, 64)

    _fails(grid, f"more than {MAX_EVALUATIONS} times")


def test_evaluating_an_invalid_config_fails():
    def tune(evaluate, targets):
        evaluate({"max_num_batched_tokens": 512})
        return _config(512, 0, 64)

    _fails(tune, "tune called evaluate with an invalid config", "exactly the keys")


def test_returning_the_graders_reference_fails():
    from minivllm.course.checks import capstone

    def tune(evaluate, targets):
        return capstone._reference_choice(evaluate)

    _fails(tune, "_reference_choice", "the package's own answer", error=checks.Delegated)


def test_an_unsolved_exercise_raises_its_not_implemented_error():
    def tune(evaluate, targets):
        raise NotImplementedError("Exercise 11.1: search")

    with pytest.raises(NotImplementedError, match="Exercise 11.1"):
        checks.check_goodput_tuner(tune)


def test_evaluate_hands_out_copies():
    """A tuner that scribbles on what evaluate returned cannot change its own grade."""
    def tune(evaluate, targets):
        ev = evaluate(_config(256, 0, 64))
        ev["goodput"] = 99.0
        ev["runs"].clear()
        return _config(256, 0, 64)

    _fails(tune, "sustains 20 requests/s")
