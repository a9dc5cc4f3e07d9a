"""Chapter 10's graders: the persistent batch (10.1), the graph runner's copy-pad-replay (10.2),
CUDA-graph capture sizes (10.3)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch

from minivllm.attention.backend import AttentionMetadata
from minivllm.course.checks.common import Exercise

BATCH_ANSWER = ("minivllm.worker.input_batch:InputBatch", "minivllm.worker.block_table:BlockTable")
RUNNER_ANSWER = ("minivllm.worker.cuda_graphs:DecodeCudaGraphs",)
SIZES_ANSWER = ("minivllm.course.checks.hotpath:optimal_padding",
                "minivllm.worker.cuda_graphs:cudagraph_batch_sizes")
BATCH_CONVENTION = (
    "Expected after apply(scheduler_output): rows 0 .. n-1 hold exactly the n requests scheduled "
    "this step (no holes: condense), and row r of request R holds R's tokens so far (prompt + "
    "sampled) in token_ids[r, :num_tokens[r]], its whole block table in "
    "block_table[r, :num_blocks[r]], and in num_computed_tokens[r] the tokens already computed "
    "before this step. A finished request is forgotten; a preempted one, or one given no tokens "
    "this step, leaves its row but is remembered (its tokens saved in its RequestState); a "
    "request resumed from preemption gets new_block_ids as its whole block table.")
SIZES_CONVENTION = (
    "Expected: a sorted list of at most max_graphs distinct batch sizes whose largest is "
    "max_batch; a batch of b runs the smallest size >= b and pays (size - b) padded rows. "
    "Minimise the expected padding, sum over b of probs[b] * (size(b) - b).")
GRAPH_CONVENTION = (
    "Expected: run(input_ids, positions, meta) for n decodes picks the smallest captured size >= "
    "n, copies the step's input_ids, positions, slot_mapping, seq_lens and block_tables into rows "
    "0..n-1 of the static buffers, makes rows n..size-1 padding (slot -1, seq_len 1, token 0, "
    "position 0, query_start_loc[i] = i), calls self.replay(size) and returns the first n rows of "
    "what it returns.")


# -- Exercise 10.1: the persistent batch ---------------------------------------------------------

def _trace_ops(rng: np.random.Generator, length: int) -> list[tuple]:
    """``length`` random adds (prefix, length, max_tokens), aborts and runs of steps."""
    ops = []
    for kind in (rng.choice(["add", "add", "abort", "step", "step"]) for _ in range(length)):
        if kind == "add":
            ops.append(("add", int(rng.integers(0, 3)), int(rng.integers(1, 30)),
                        int(rng.integers(1, 12))))
        else:
            ops.append((kind, int(rng.integers(0, 50) if kind == "abort" else rng.integers(1, 5))))
    return ops + [("step", 400)]


def _rows_of(ex: Exercise, batch, n: int, where: str) -> dict[str, dict]:
    """The learner's batch, row by row: {req_id: what its row holds}."""
    req_ids = list(batch.req_ids)
    if len([r for r in req_ids if r is not None]) != n or None in req_ids[:n]:
        ex.fail(f"{where}: req_ids is {req_ids}: expected the {n} scheduled requests in rows "
                f"0..{n - 1} and no other row in use.")
    for row, rid in enumerate(req_ids[:n]):
        if batch.row_of.get(rid) != row:
            ex.fail(f"{where}: request {rid!r} sits in row {row} but row_of says "
                    f"{batch.row_of.get(rid)}.")
    return {rid: {"num_computed_tokens": int(batch.num_computed_tokens[row]),
                  "block_ids": batch.block_table[row, : batch.num_blocks[row]].tolist(),
                  "token_ids": batch.token_ids[row, : batch.num_tokens[row]].tolist()}
            for row, rid in enumerate(req_ids[:n])}


def check_persistent_batch(batch_cls, exercise: str = "10.1", seed: int = 0,
                           num_traces: int = 24) -> None:
    """``batch_cls(max_num_reqs, max_model_len, max_blocks_per_req)`` with ``apply(so)`` and
    ``append_sampled(req_id, token)``, against the scheduler's state after every step."""
    from minivllm.config import SchedulerConfig
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.request import Request
    from minivllm.core.sched_output import ModelRunnerOutput
    from minivllm.core.scheduler import Scheduler
    from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler
    from minivllm.sampling_params import SamplingParams

    ex = Exercise(exercise, BATCH_CONVENTION, BATCH_ANSWER, "numpy")
    batch_cls = ex.take(batch_cls, "persistent batch")
    max_model_len, block_size, max_seqs, rng = 64, 4, 6, np.random.default_rng(seed)
    steps = preemptions = resumed = finished = unscheduled = 0
    prefixes = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24], []]
    for trace in range(num_traces):
        v0 = trace % 3 == 2  # v0 (chapter 04): a prefill step leaves every decode out
        budget = max_model_len if v0 else int(rng.choice([3, 8, 64]))
        config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                 max_model_len=max_model_len,
                                 long_prefill_token_threshold=int(rng.choice([0, 5])))
        kv = KVCacheManager(24, block_size, enable_caching=bool(rng.integers(0, 2)))
        scheduler = (PhaseSeparatedScheduler if v0 else Scheduler)(config, kv)
        batch, added = batch_cls(max_seqs, max_model_len, max_model_len // block_size), 0
        for op in _trace_ops(rng, int(rng.integers(8, 40))):
            if op[0] == "add":
                prompt = prefixes[op[1]] + [30 + (added * 7 + i) % 90 for i in range(op[2])]
                params = SamplingParams(temperature=0, max_tokens=op[3], ignore_eos=True)
                scheduler.add_request(Request.from_prompt(f"r{added}", prompt[: max_model_len - 1],
                                                          params))
                added += 1
            elif op[0] == "abort":
                scheduler.finish_requests([f"r{op[1] % max(added, 1)}"])
            for _ in range(op[1] if op[0] == "step" else 0):
                if not scheduler.has_unfinished_requests():
                    break
                out = scheduler.schedule()
                steps += 1
                preemptions += len(out.preempted_req_ids)
                resumed += sum(out.scheduled_cached_reqs.resumed_from_preemption)
                finished += len(out.finished_req_ids)
                unscheduled += len(set(batch.row_of) - set(out.num_scheduled_tokens)
                                   - out.finished_req_ids - out.preempted_req_ids)
                reqs = scheduler.requests  # what each scheduled request's row must hold
                expected = {rid: {"num_computed_tokens": reqs[rid].num_computed_tokens - n,
                                  "block_ids": list(kv.get_block_ids(rid)),
                                  "token_ids": list(reqs[rid].all_token_ids)}
                            for rid, n in out.num_scheduled_tokens.items()}
                batch.apply(out)
                where = f"trace {trace}, step {steps}"
                got = _rows_of(ex, batch, len(expected), where)
                for rid, want in expected.items():
                    if rid not in got:
                        ex.fail(f"{where}: request {rid!r} was scheduled but has no row (rows: "
                                f"{list(got)}).")
                    for key in want:
                        if got[rid][key] != want[key]:
                            ex.fail(f"{where}: request {rid!r}'s {key} is {got[rid][key]}, "
                                    f"expected {want[key]}.")
                # the model "samples" for the rows that reach the end of their known tokens
                sampled = [[int(rng.integers(100, 200))] if r.num_computed_tokens == r.num_tokens
                           else [] for r in map(scheduler.requests.get, out.num_scheduled_tokens)]
                for rid, tokens in zip(out.num_scheduled_tokens, sampled):
                    if tokens:
                        batch.append_sampled(rid, tokens[0])
                scheduler.update_from_output(
                    out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
        batch.apply(scheduler.schedule())  # everyone finished: the last finished ids reach it
        if any(r is not None for r in batch.req_ids) or batch.requests:
            ex.fail(f"trace {trace}: every request has finished, but the batch still holds rows "
                    f"{batch.req_ids} and requests {sorted(batch.requests)}")
    ex.passed(f"your batch matched a rebuild from the scheduler's state after each of {steps} "
              f"steps of {num_traces} random traces ({preemptions} preemptions, {resumed} "
              f"resumptions, {finished} finished requests, {unscheduled} times a running request "
              "got no tokens).")


# -- Exercise 10.3: CUDA-graph capture sizes -----------------------------------------------------

def expected_padding(sizes: list[int], probs: dict[int, float]) -> float:
    """Expected padded rows per step when batches of b come with probability probs[b]."""
    return sum(p * (min(s for s in sizes if s >= b) - b) for b, p in probs.items())


def optimal_padding(probs: dict[int, float], max_graphs: int, max_batch: int) -> float:
    """The least expected padding any choice of sizes achieves (dynamic programming)."""
    p, inf = [probs.get(b, 0.0) for b in range(max_batch + 1)], float("inf")
    best = [[0.0] + [inf] * max_graphs]  # best[j][k]: batches up to j on k sizes, the largest j
    for j in range(1, max_batch + 1):
        pad = [sum(p[b] * (j - b) for b in range(i + 1, j + 1)) for i in range(j)]  # i: the last
        best.append([inf] + [min(best[i][k - 1] + pad[i] for i in range(j))
                             for k in range(1, max_graphs + 1)])
    return min(best[max_batch])


def _random_distribution(rng, max_batch: int) -> dict[int, float]:
    """Mostly small batches, a bump around a typical load, or a few sizes only."""
    kind, b = rng.integers(0, 3), np.arange(1, max_batch + 1)
    if kind == 0:
        w = np.exp(-b / rng.uniform(2, 10))
    elif kind == 1:
        w = np.exp(-((b - rng.uniform(1, max_batch)) ** 2) / (2 * rng.uniform(1, 6) ** 2))
    else:
        w = np.zeros(max_batch)
        w[rng.choice(max_batch, size=4, replace=False)] = rng.uniform(0.1, 1, 4)
    return {int(i): float(x) for i, x in zip(b, w / w.sum()) if x > 0}


def check_capture_sizes(choose_capture_sizes, exercise: str = "10.3", seed: int = 0) -> None:
    """``choose_capture_sizes(probs: {batch: probability}, max_graphs, max_batch) -> sizes``."""
    ex = Exercise(exercise, SIZES_CONVENTION, SIZES_ANSWER)
    choose_capture_sizes = ex.take(choose_capture_sizes, "choose_capture_sizes")
    rng = np.random.default_rng(seed)
    cases = [(b, g) for b in (4, 16, 40) for g in (1, 2, 3, 6) for _ in range(3)]
    for max_batch, max_graphs in cases:
        probs = _random_distribution(rng, max_batch)
        got = choose_capture_sizes(dict(probs), max_graphs, max_batch)
        what = f"max_batch={max_batch}, max_graphs={max_graphs}"
        try:
            sizes = [int(s) for s in got]
        except TypeError:
            ex.fail(f"{what}: expected a list of ints, got {type(got).__name__}")
        if (sizes != sorted(set(sizes)) or not sizes or sizes[-1] != max_batch
                or len(sizes) > max_graphs or sizes[0] < 1):
            ex.fail(f"{what}: {sizes} is not a valid choice.")
        have, best = expected_padding(sizes, probs), optimal_padding(probs, max_graphs, max_batch)
        if have > best + 1e-9:
            ex.fail(f"{what}, batch sizes distributed as "
                    f"{ {b: round(p, 3) for b, p in probs.items() if p > 0.01} }: your sizes "
                    f"{sizes} pad {have:.3f} rows per step on average; the best choice pads "
                    f"{best:.3f}.")
    ex.passed(f"your capture sizes reach the least expected padding on {len(cases)} random "
              "batch-size distributions.")


# -- Exercise 10.2: copy, pad, replay ------------------------------------------------------------

def check_graph_runner(graph_runner_cls, exercise: str = "10.2", seed: int = 0) -> None:
    """``graph_runner_cls(replay, sizes, buffers)`` with ``run(input_ids, positions, meta)``:
    against a recording replay, then padded in the engine on a tiny Llama against unpadded."""
    ex = Exercise(exercise, GRAPH_CONVENTION, RUNNER_ANSWER,
                  "self.replay, self.sizes and self.buffers")
    graph_runner_cls = ex.take(graph_runner_cls, "graph runner")
    rng, sizes, ns = np.random.default_rng(seed), [1, 2, 4, 8, 16], (1, 2, 3, 5, 8, 9, 16)
    for n in ns:
        buffers = {name: torch.full(shape, 99, dtype=dtype) for name, shape, dtype in (
            ("input_ids", (16,), torch.int32), ("positions", (16,), torch.int64),
            ("slot_mapping", (16,), torch.int64), ("seq_lens", (16,), torch.int32),
            ("query_start_loc", (17,), torch.int32), ("block_tables", (16, 6), torch.int32))}
        calls = []

        def replay(size):  # records the buffers; "outputs" one row per row it was fed
            calls.append((size, {k: v.clone() for k, v in buffers.items()}))
            return buffers["input_ids"][:size, None] + 0.5 * buffers["positions"][:size, None]

        runner = graph_runner_cls(replay, list(sizes), buffers)
        ids = torch.as_tensor(rng.integers(1, 50, n), dtype=torch.int32)
        pos = torch.as_tensor(rng.integers(3, 40, n), dtype=torch.int64)
        meta = AttentionMetadata(
            num_actual_tokens=n, num_decodes=n, max_query_len=1, max_seq_len=40,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=(pos + 1).to(torch.int32),
            block_tables=torch.as_tensor(rng.integers(0, 30, (n, 6)), dtype=torch.int32),
            slot_mapping=torch.as_tensor(rng.integers(0, 200, n), dtype=torch.int64))
        out = runner.run(ids.clone(), pos.clone(), meta)
        size, what = next(s for s in sizes if s >= n), f"{n} decodes (captured sizes {sizes})"
        if len(calls) != 1:
            ex.fail(f"{what}: replay was called {len(calls)} times, expected once.")
        if calls[0][0] != size:
            ex.fail(f"{what}: replayed size {calls[0][0]}, expected {size}.")
        seen, pad = calls[0][1], size - n
        rows = [(name, seen[name][:size], [*step.tolist(), *[filler] * pad], "")
                for name, step, filler in (("input_ids", ids, 0), ("positions", pos, 0),
                                           ("slot_mapping", meta.slot_mapping, -1),
                                           ("seq_lens", meta.seq_lens, 1))]
        for name, have, expect, note in rows + [
                ("block_tables", seen["block_tables"][:n], meta.block_tables.tolist(),
                 f" (the step's block tables in rows 0..{n - 1})"),
                ("query_start_loc", seen["query_start_loc"][: size + 1], list(range(size + 1)),
                 ": every row, real or padding, is one token")]:
            if have.tolist() != expect:
                ex.fail(f"{what}: the static {name} buffer held {have.tolist()} at replay, "
                        f"expected {expect}{note}.")
        expect_out = ids[:, None] + 0.5 * pos[:, None]
        if not (isinstance(out, torch.Tensor) and torch.equal(out, expect_out)):
            ex.fail(f"{what}: run returned {getattr(out, 'shape', type(out).__name__)}, expected "
                    f"the first {n} rows of what replay returned.")
    steps = _graph_runner_in_engine(ex, graph_runner_cls)
    ex.passed(f"your runner filled and padded the static buffers right on {len(ns)} batch sizes, "
              f"and the tiny Llama, its {steps} decode steps run padded through your runner, "
              "generates the tokens of the unpadded eager run.")


def _graph_runner_in_engine(ex: Exercise, graph_runner_cls) -> int:
    """The tiny Llama's decode steps padded through the learner's runner against the unpadded
    eager run: the number of padded steps."""
    from minivllm import LLM
    from minivllm.course.checks.kernels import ENGINE, _compare_in_engine, _greedy, tiny_engine
    from minivllm.course.views import engine_core

    llm = LLM(tiny_engine().llm_engine.config.model_config.model_path,
              **{**ENGINE, "attention_backend": "triton"})
    runner = engine_core(llm).model_runner
    runner.capture_model(capture=False)  # the package's padded path, replaced below
    graphs = runner.cuda_graphs
    scratch = {k: getattr(graphs, k).clone() for k in (  # the learner's static buffers
        "input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables")}

    def replay(size):  # the model on a decode step of ``size`` rows of the static buffers
        meta = AttentionMetadata(
            num_actual_tokens=size, num_decodes=size, max_query_len=1,
            max_seq_len=graphs.max_model_len, query_start_loc=scratch["query_start_loc"][:size + 1],
            seq_lens=scratch["seq_lens"][:size], block_tables=scratch["block_tables"][:size],
            slot_mapping=scratch["slot_mapping"][:size])
        return graphs.model(scratch["input_ids"][:size], scratch["positions"][:size], meta)

    learner, padded_steps = graph_runner_cls(replay, list(graphs.sizes), scratch), []

    def run(input_ids, positions, meta):  # fresh tensors: the learner must copy
        meta = dataclasses.replace(meta, **{k: getattr(meta, k).clone() for k in (
            "query_start_loc", "seq_lens", "block_tables", "slot_mapping")})
        padded_steps.append(meta.num_seqs)
        return learner.run(input_ids.clone(), positions.clone(), meta)

    runner.cuda_graphs = SimpleNamespace(sizes=graphs.sizes, can_run=graphs.can_run, run=run)
    got = _greedy(llm)
    if not padded_steps:
        ex.fail("no decode step went through your runner (the check itself is broken)")
    _compare_in_engine(ex.fail, "graph runner (decodes padded through it)", got)
    return len(padded_steps)
