"""Checkers for chapter 10 (the CPU's share of a step): the persistent batch (10.1), the
graph runner's copy-pad-replay (10.2), CUDA-graph capture sizes (10.3).

10.1 drives the engine's real schedulers (v1 and v0) and KV cache manager over random traces
(shared prefixes, aborts, preemptions, chunked prefills, running requests left out of a step)
and after every step compares the learner's batch, row by row, with a rebuild from scratch.
"""

from __future__ import annotations

import numpy as np

from minivllm.course.checks.common import Exercise, fail, passed

# -- Exercise 10.1: the persistent batch ---------------------------------------------------------

BATCH_CONVENTION = (
    "Expected after apply(scheduler_output): rows 0 .. n-1 hold exactly the n requests scheduled "
    "this step (no holes: condense), and row r of request R holds R's tokens so far (prompt + "
    "sampled) in token_ids[r, :num_tokens[r]], its whole block table in "
    "block_table[r, :num_blocks[r]], and in num_computed_tokens[r] the tokens already computed "
    "before this step. A finished request is forgotten; a preempted one, or one given no tokens "
    "this step, leaves its row but is remembered (its tokens saved in its RequestState); a "
    "request resumed from preemption gets new_block_ids as its whole block table.")


BATCH_ANSWER = ("minivllm.worker.input_batch:InputBatch", "minivllm.worker.block_table:BlockTable")
RUNNER_ANSWER = ("minivllm.worker.cuda_graphs:DecodeCudaGraphs",)
SIZES_ANSWER = ("minivllm.course.checks.hotpath:optimal_padding",
                "minivllm.worker.cuda_graphs:cudagraph_batch_sizes")


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
    batch_cls = Exercise(exercise, answer=BATCH_ANSWER, allowed="numpy").take(
        batch_cls, "persistent batch")
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
    choose_capture_sizes = Exercise(exercise, answer=SIZES_ANSWER).take(
        choose_capture_sizes, "choose_capture_sizes")
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


# -- Exercise 10.2: copy, pad, replay ------------------------------------------------------------

GRAPH_CONVENTION = (
    "Expected: run(input_ids, positions, meta) for n decodes picks the smallest captured size >= "
    "n, copies the step's input_ids, positions, slot_mapping, seq_lens and block_tables into rows "
    "0..n-1 of the static buffers, makes rows n..size-1 padding (slot -1, seq_len 1, token 0, "
    "position 0, query_start_loc[i] = i), calls self.replay(size) and returns the first n rows of "
    "what it returns.")


class _Recorder:
    """What the learner's runner handed to replay(): a copy of the static buffers."""

    def __init__(self, buffers: dict) -> None:
        self.buffers = buffers
        self.calls: list[tuple[int, dict]] = []

    def __call__(self, size: int):
        import torch

        self.calls.append((size, {k: v.clone() for k, v in self.buffers.items()}))
        # the "graph's output": one row per padded row, identifying what row it was fed
        return (self.buffers["input_ids"][:size].to(torch.float32)[:, None]
                + 0.5 * self.buffers["positions"][:size].to(torch.float32)[:, None])


def _static_buffers(max_size: int, max_blocks: int) -> dict:
    import torch

    return {"input_ids": torch.full((max_size,), 99, dtype=torch.int32),
            "positions": torch.full((max_size,), 99, dtype=torch.int64),
            "slot_mapping": torch.full((max_size,), 99, dtype=torch.int64),
            "seq_lens": torch.full((max_size,), 99, dtype=torch.int32),
            "query_start_loc": torch.full((max_size + 1,), 99, dtype=torch.int32),
            "block_tables": torch.full((max_size, max_blocks), 99, dtype=torch.int32)}


def check_graph_runner(graph_runner_cls, exercise: str = "10.2", seed: int = 0) -> None:
    """``graph_runner_cls(replay, sizes, buffers)`` with ``run(input_ids, positions, meta)``:
    first against a recording replay (what lands in the static buffers), then inside the engine
    on a tiny Llama (Triton attention in the interpreter), padded against unpadded."""
    graph_runner_cls = Exercise(exercise, answer=RUNNER_ANSWER,
                                allowed="self.replay, self.sizes and self.buffers").take(
        graph_runner_cls, "graph runner")
    import torch

    from minivllm.attention.backend import AttentionMetadata

    rng = np.random.default_rng(seed)
    sizes = [1, 2, 4, 8, 16]
    cases = 0
    for n in (1, 2, 3, 5, 8, 9, 16):
        buffers = _static_buffers(16, 6)
        replay = _Recorder(buffers)
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
        size = next(s for s in sizes if s >= n)
        what = f"{n} decodes (captured sizes {sizes})"
        if len(replay.calls) != 1:
            fail(exercise, f"{what}: replay was called {len(replay.calls)} times, expected once. "
                           f"{GRAPH_CONVENTION}")
        got_size, seen = replay.calls[0]
        if got_size != size:
            fail(exercise, f"{what}: replayed size {got_size}, expected {size}. {GRAPH_CONVENTION}")
        want = {"input_ids": (ids, 0), "positions": (pos, 0), "slot_mapping": (meta.slot_mapping, -1),
                "seq_lens": (meta.seq_lens, 1)}
        for name, (real, pad) in want.items():
            have = seen[name][:size]
            expect = torch.cat([real.to(have.dtype), torch.full((size - n,), pad, dtype=have.dtype)])
            if not torch.equal(have, expect):
                fail(exercise, f"{what}: the static {name} buffer held {have.tolist()} at replay, "
                               f"expected {expect.tolist()}. {GRAPH_CONVENTION}")
        if not torch.equal(seen["block_tables"][:n], meta.block_tables):
            fail(exercise, f"{what}: the static block_tables buffer does not hold the step's block "
                           f"tables in rows 0..{n - 1}. {GRAPH_CONVENTION}")
        qsl = seen["query_start_loc"][: size + 1]
        if not torch.equal(qsl, torch.arange(size + 1, dtype=qsl.dtype)):
            fail(exercise, f"{what}: query_start_loc held {qsl.tolist()} at replay, expected "
                           f"0..{size}: every row, real or padding, is one token. {GRAPH_CONVENTION}")
        expect_out = ids.to(torch.float32)[:, None] + 0.5 * pos.to(torch.float32)[:, None]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, 1) or not torch.equal(
                out, expect_out):
            fail(exercise, f"{what}: run returned {getattr(out, 'shape', type(out).__name__)}, "
                           f"expected the first {n} rows of what replay returned. {GRAPH_CONVENTION}")
        cases += 1
    steps = _graph_runner_in_engine(exercise, graph_runner_cls)
    passed(exercise, f"your runner filled and padded the static buffers right on {cases} batch "
                     f"sizes, and the tiny Llama, its {steps} decode steps run padded through your "
                     "runner, generates the tokens of the unpadded eager run.")


def _graph_runner_in_engine(exercise: str, graph_runner_cls) -> None:
    from minivllm import LLM
    from minivllm.course.checks.kernels import ENGINE, _greedy, _reference_tokens, tiny_engine
    from minivllm.course.views import engine_core

    # the unpadded eager run: the same engine settings, plain-torch attention, no padding
    eager = [list(t) for t in _reference_tokens()]
    llm = LLM(tiny_engine().llm_engine.config.model_config.model_path,
              **{**ENGINE, "attention_backend": "triton"})
    runner = engine_core(llm).model_runner
    runner.capture_model(capture=False)  # the package's padded path, replaced below
    graphs = runner.cuda_graphs
    buffers = {"input_ids": graphs.input_ids, "positions": graphs.positions,
               "slot_mapping": graphs.slot_mapping, "seq_lens": graphs.seq_lens,
               "query_start_loc": graphs.query_start_loc, "block_tables": graphs.block_tables}
    scratch = {k: v.clone() for k, v in buffers.items()}  # the learner's static buffers

    def replay(size):
        return graphs.model(scratch["input_ids"][:size], scratch["positions"][:size],
                            _metadata(scratch, size, graphs.max_model_len))

    learner = graph_runner_cls(replay, list(graphs.sizes), scratch)
    padded_steps = []

    class Adapter:
        sizes = graphs.sizes

        def can_run(self, meta):
            return graphs.can_run(meta)

        def run(self, input_ids, positions, meta):  # fresh tensors: the learner must copy
            import dataclasses

            meta = dataclasses.replace(meta, **{k: getattr(meta, k).clone() for k in (
                "query_start_loc", "seq_lens", "block_tables", "slot_mapping")})
            padded_steps.append(meta.num_seqs)
            return learner.run(input_ids.clone(), positions.clone(), meta)

    runner.cuda_graphs = Adapter()
    got = _greedy(llm)
    if not padded_steps:
        fail(exercise, "no decode step went through your runner (the check itself is broken)")
    for i, (g, e) in enumerate(zip(got, eager)):
        if g != e:
            fail(exercise, f"inside the engine (tiny Llama, decodes padded through your runner), "
                           f"request {i} generated {g}, the unpadded eager run {e}. "
                           f"{GRAPH_CONVENTION}")
    return len(padded_steps)


def _metadata(buffers: dict, size: int, max_model_len: int):
    from minivllm.attention.backend import AttentionMetadata

    return AttentionMetadata(
        num_actual_tokens=size, num_decodes=size, max_query_len=1, max_seq_len=max_model_len,
        query_start_loc=buffers["query_start_loc"][: size + 1], seq_lens=buffers["seq_lens"][:size],
        block_tables=buffers["block_tables"][:size], slot_mapping=buffers["slot_mapping"][:size])
