"""Checkers for chapter 10 (the CPU's share of a step): the persistent batch (10.1), the
graph runner's copy-pad-replay (10.2), CUDA-graph capture sizes (10.3).

10.1 drives the engine's real schedulers (v1, and v0 whose prefill steps leave every running
decode out) and KV cache manager over random traces — arrivals
that share prefixes (prefix-cache hits), aborts, a KV pool small enough to preempt and resume,
budgets small enough to chunk prefills and to leave running requests out of a step — and after
every step compares the learner's batch, row by row, with a rebuild from scratch: the
scheduler's own ``Request`` objects and block tables.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import numpy as np

from minivllm.course.checks.common import fail, passed

# -- Exercise 10.1: the persistent batch ---------------------------------------------------------

BATCH_CONVENTION = (
    "Expected after apply(scheduler_output): rows 0 .. n-1 hold exactly the n requests scheduled "
    "this step (no holes: condense), and row r of request R holds R's tokens so far (prompt + "
    "sampled) in token_ids[r, :num_tokens[r]], its whole block table in "
    "block_table[r, :num_blocks[r]], and in num_computed_tokens[r] the tokens already computed "
    "before this step. A finished request is forgotten; a preempted one, or one given no tokens "
    "this step, leaves its row but is remembered (its tokens saved in its RequestState); a "
    "request resumed from preemption gets new_block_ids as its whole block table.")


@contextmanager
def _hidden(exercise: str, targets: list[tuple[str, str]]):
    saved = []
    for module_name, attr in targets:
        module = importlib.import_module(module_name)
        original = getattr(module, attr)

        class Refused:
            def __init__(self, *args, _name=f"{module_name}.{attr}", **kwargs):
                fail(exercise, f"your code used {_name}, the package's own version: the exercise "
                               "asks you to write it (the grader hides minivllm's)")

        saved.append((module, attr, original))
        setattr(module, attr, Refused)
    try:
        yield
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)


def _trace_ops(rng: np.random.Generator, length: int) -> list[tuple]:
    ops = []
    for _ in range(length):
        kind = rng.choice(["add", "add", "abort", "step", "step"])
        if kind == "add":
            ops.append(("add", int(rng.integers(0, 3)), int(rng.integers(1, 30)),
                        int(rng.integers(1, 12))))
        elif kind == "abort":
            ops.append(("abort", int(rng.integers(0, 50))))
        else:
            ops.append(("step", int(rng.integers(1, 5))))
    return ops + [("step", 400)]


def _expected_rows(scheduler, out) -> dict[str, dict]:
    rows = {}
    for rid, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        rows[rid] = {"token_ids": list(request.all_token_ids),
                     "block_ids": list(scheduler.kv_cache_manager.get_block_ids(rid)),
                     "num_computed_tokens": request.num_computed_tokens - n}
    return rows


def _learner_rows(exercise: str, batch, n: int, where: str) -> dict[str, dict]:
    req_ids = list(batch.req_ids)
    if len([r for r in req_ids if r is not None]) != n or any(r is None for r in req_ids[:n]):
        fail(exercise, f"{where}: req_ids is {req_ids}: expected the {n} scheduled requests in "
                       f"rows 0..{n - 1} and no other row in use. {BATCH_CONVENTION}")
    rows = {}
    for row, rid in enumerate(req_ids[:n]):
        rows[rid] = {
            "token_ids": batch.token_ids[row, : batch.num_tokens[row]].tolist(),
            "block_ids": batch.block_table[row, : batch.num_blocks[row]].tolist(),
            "num_computed_tokens": int(batch.num_computed_tokens[row]),
        }
        if batch.row_of.get(rid) != row:
            fail(exercise, f"{where}: request {rid!r} sits in row {row} but row_of says "
                           f"{batch.row_of.get(rid)}. {BATCH_CONVENTION}")
    return rows


def check_persistent_batch(batch_cls, exercise: str = "10.1", seed: int = 0,
                           num_traces: int = 24) -> None:
    """``batch_cls(max_num_reqs, max_model_len, max_blocks_per_req)`` with ``apply(so)`` and
    ``append_sampled(req_id, token)``, against a rebuild after every step of random traces."""
    from minivllm.config import SchedulerConfig
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.request import Request
    from minivllm.core.sched_output import ModelRunnerOutput
    from minivllm.core.scheduler import Scheduler
    from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler
    from minivllm.sampling_params import SamplingParams

    block_size, max_model_len, num_blocks, max_seqs = 4, 64, 24, 6
    rng = np.random.default_rng(seed)
    steps = preemptions = resumed = finished = unscheduled = 0
    prefixes = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24], []]
    for trace in range(num_traces):
        v0 = trace % 3 == 2  # v0 (chapter 04): a prefill step leaves every decode out
        budget = max_model_len if v0 else int(rng.choice([3, 8, 64]))
        threshold = int(rng.choice([0, 5]))
        caching = bool(rng.integers(0, 2))
        config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                 max_model_len=max_model_len, long_prefill_token_threshold=threshold)
        kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        scheduler = (PhaseSeparatedScheduler if v0 else Scheduler)(config, kv)
        with _hidden(exercise, [("minivllm.worker.input_batch", "InputBatch")]):
            batch = batch_cls(max_seqs, max_model_len, -(-max_model_len // block_size))
        added = 0
        for op in _trace_ops(rng, int(rng.integers(8, 40))):
            if op[0] == "add":
                _, prefix, length, max_tokens = op
                prompt = (prefixes[prefix] + [30 + (added * 7 + i) % 90 for i in range(length)])
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                scheduler.add_request(Request.from_prompt(f"r{added}", prompt[: max_model_len - 1],
                                                          params))
                added += 1
                continue
            if op[0] == "abort":
                scheduler.finish_requests([f"r{op[1] % max(added, 1)}"])
                continue
            for _ in range(op[1]):
                if not scheduler.has_unfinished_requests():
                    break
                out = scheduler.schedule()
                steps += 1
                preemptions += len(out.preempted_req_ids)
                resumed += sum(out.scheduled_cached_reqs.resumed_from_preemption)
                finished += len(out.finished_req_ids)
                unscheduled += len(set(batch.row_of) - set(out.num_scheduled_tokens)
                                   - out.finished_req_ids - out.preempted_req_ids)
                expected = _expected_rows(scheduler, out)
                with _hidden(exercise, [("minivllm.worker.input_batch", "InputBatch")]):
                    batch.apply(out)
                where = f"trace {trace}, step {steps}"
                got = _learner_rows(exercise, batch, len(expected), where)
                for rid, want in expected.items():
                    have = got.get(rid)
                    if have is None:
                        fail(exercise, f"{where}: request {rid!r} was scheduled but has no row "
                                       f"(rows: {list(got)}). {BATCH_CONVENTION}")
                    for key in ("num_computed_tokens", "block_ids", "token_ids"):
                        if have[key] != want[key]:
                            fail(exercise, f"{where}: request {rid!r}'s {key} is {have[key]}, "
                                           f"expected {want[key]}. {BATCH_CONVENTION}")
                # the model "samples" for the rows that reach the end of their known tokens
                sampled = []
                for rid, n in out.num_scheduled_tokens.items():
                    request = scheduler.requests[rid]
                    if request.num_computed_tokens == request.num_tokens:
                        token = int(rng.integers(100, 200))
                        batch.append_sampled(rid, token)
                        sampled.append([token])
                    else:
                        sampled.append([])
                scheduler.update_from_output(
                    out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
        out = scheduler.schedule()  # everyone finished: the last finished ids reach the batch
        batch.apply(out)
        if any(r is not None for r in batch.req_ids) or batch.requests:
            fail(exercise, f"trace {trace}: every request has finished, but the batch still holds "
                           f"rows {batch.req_ids} and requests {sorted(batch.requests)}")
    passed(exercise, f"your batch matched a rebuild from the scheduler's state after each of "
                     f"{steps} steps of {num_traces} random traces ({preemptions} preemptions, "
                     f"{resumed} resumptions, {finished} finished requests, {unscheduled} times a "
                     "running request got no tokens).")


# -- Exercise 10.3: CUDA-graph capture sizes -----------------------------------------------------

SIZES_CONVENTION = (
    "Expected: a sorted list of at most max_graphs distinct batch sizes whose largest is "
    "max_batch; a batch of b runs the smallest size >= b and pays (size - b) padded rows. "
    "Minimise the expected padding, sum over b of probs[b] * (size(b) - b).")


def expected_padding(sizes: list[int], probs: dict[int, float]) -> float:
    """Expected padded rows per step when batches of b come with probability probs[b]."""
    total = 0.0
    for b, p in probs.items():
        size = next(s for s in sorted(sizes) if s >= b)
        total += p * (size - b)
    return total


def optimal_padding(probs: dict[int, float], max_graphs: int, max_batch: int) -> float:
    """The least expected padding any choice of sizes achieves (dynamic programming)."""
    batches = range(1, max_batch + 1)
    p = np.array([probs.get(b, 0.0) for b in batches])
    # cost[i][j]: padding of batches i+1..j (1-based sizes) all served by size j
    best = {0: [0.0] + [float("inf")] * max_graphs}  # best[j][k]: sizes up to j, k graphs used
    for j in range(1, max_batch + 1):
        row = [float("inf")] * (max_graphs + 1)
        for i in range(0, j):  # previous size i (0: none)
            seg = sum(p[b - 1] * (j - b) for b in range(i + 1, j + 1))
            prev = best[i]
            for k in range(1, max_graphs + 1):
                if prev[k - 1] + seg < row[k]:
                    row[k] = prev[k - 1] + seg
        best[j] = row
    return min(best[max_batch])


def _random_distribution(rng, max_batch: int) -> dict[int, float]:
    kind = rng.integers(0, 3)
    b = np.arange(1, max_batch + 1)
    if kind == 0:  # mostly small batches
        w = np.exp(-b / rng.uniform(2, 10))
    elif kind == 1:  # a bump around a typical load
        w = np.exp(-((b - rng.uniform(1, max_batch)) ** 2) / (2 * rng.uniform(1, 6) ** 2))
    else:  # a few sizes only
        w = np.zeros(max_batch)
        w[rng.choice(max_batch, size=4, replace=False)] = rng.uniform(0.1, 1, 4)
    w = w / w.sum()
    return {int(i): float(x) for i, x in zip(b, w) if x > 0}


def check_capture_sizes(choose_capture_sizes, exercise: str = "10.3", seed: int = 0) -> None:
    """``choose_capture_sizes(probs: {batch: probability}, max_graphs, max_batch) -> sizes``."""
    rng = np.random.default_rng(seed)
    cases = 0
    for max_batch in (4, 16, 40):
        for max_graphs in (1, 2, 3, 6):
            for _ in range(3):
                probs = _random_distribution(rng, max_batch)
                got = choose_capture_sizes(dict(probs), max_graphs, max_batch)
                what = f"max_batch={max_batch}, max_graphs={max_graphs}"
                try:
                    sizes = [int(s) for s in got]
                except TypeError:
                    fail(exercise, f"{what}: expected a list of ints, got {type(got).__name__}")
                if (sizes != sorted(set(sizes)) or not sizes or sizes[-1] != max_batch
                        or len(sizes) > max_graphs or sizes[0] < 1):
                    fail(exercise, f"{what}: {sizes} is not a valid choice. {SIZES_CONVENTION}")
                have, best = expected_padding(sizes, probs), optimal_padding(probs, max_graphs,
                                                                           max_batch)
                if have > best + 1e-9:
                    fail(exercise, f"{what}, batch sizes distributed as "
                                   f"{ {b: round(p, 3) for b, p in probs.items() if p > 0.01} }: "
                                   f"your sizes {sizes} pad {have:.3f} rows per step on average; "
                                   f"the best choice pads {best:.3f}. {SIZES_CONVENTION}")
                cases += 1
    passed(exercise, f"your capture sizes reach the least expected padding on {cases} random "
                     "batch-size distributions.")
