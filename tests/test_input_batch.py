"""The persistent input batch against a from-scratch rebuild, step by step.

The scheduler sends the runner only what changed (``SchedulerOutput``); the runner keeps every
request in ``InputBatch`` rows and applies the diff. Random workloads — arrivals with shared
prefixes (prefix-cache hits), aborts, a KV pool small enough to preempt and resume, chunked
prefills under small budgets, both schedulers — drive the real scheduler and the real runner,
and every step's model inputs are compared with what a rebuild from the scheduler's own
``Request`` objects gives.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.config import EngineArgs, SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler
from minivllm.sampling_params import SamplingParams
from minivllm.worker.block_table import compute_slot_mapping
from minivllm.worker.model_runner import ModelRunner

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def config(tiny_llama):
    return EngineArgs(model=tiny_llama, block_size=BLOCK_SIZE, max_num_seqs=6,
                      max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN,
                      num_kv_blocks=24).create_config()


def expected_inputs(scheduler: Scheduler, out) -> dict[str, dict]:
    """Per scheduled request, what its model inputs must be, from the scheduler's own state."""
    expected = {}
    for rid, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        start = request.num_computed_tokens - n  # schedule() already advanced it
        positions = np.arange(start, start + n)
        blocks = scheduler.kv_cache_manager.get_block_ids(rid)
        expected[rid] = {
            "tokens": request.all_token_ids[start : start + n],
            "positions": positions.tolist(),
            "slots": compute_slot_mapping(blocks, positions, BLOCK_SIZE).tolist(),
            "seq_len": start + n,
            "blocks": blocks,
            "samples": start + n == request.num_tokens,
        }
    return expected


def actual_inputs(runner: ModelRunner, prepared) -> dict[str, dict]:
    input_ids, positions, meta, sample_rows, _ = prepared
    batch = runner.input_batch
    qsl = meta.query_start_loc_cpu
    got = {}
    for row, rid in enumerate(batch.req_ids[: batch.num_reqs]):
        a, b = qsl[row], qsl[row + 1]
        got[rid] = {
            "tokens": input_ids[a:b].tolist(),
            "positions": positions[a:b].tolist(),
            "slots": meta.slot_mapping[a:b].tolist(),
            "seq_len": int(meta.seq_lens_cpu[row]),
            "blocks": batch.block_table.block_table_np[
                row, : batch.block_table.num_blocks_per_row[row]].tolist(),
            "samples": row in set(sample_rows.tolist()),
        }
    # the attention kernels expect the single-token rows first
    lens = np.diff(qsl)
    assert (lens[: meta.num_decodes] == 1).all() and (lens[meta.num_decodes:] != 1).all()
    return got


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=5, max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, budget=st.sampled_from([3, 8, 64]), threshold=st.sampled_from([0, 5]),
       policy=st.sampled_from(["v1", "v0"]), caching=st.booleans())
def test_persistent_batch_matches_a_rebuild(config, ops, budget, threshold, policy, caching):
    if policy == "v0":
        budget = MAX_MODEL_LEN  # whole prompts in one step
    runner = ModelRunner(config, show_progress=False)
    runner.initialize_kv_cache(config.cache_config.num_kv_blocks)
    sched_config = SchedulerConfig(max_num_seqs=config.scheduler_config.max_num_seqs,
                                   max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
                                   long_prefill_token_threshold=threshold)
    kv = KVCacheManager(config.cache_config.num_kv_blocks, BLOCK_SIZE, enable_caching=caching)
    scheduler = (PhaseSeparatedScheduler if policy == "v0" else Scheduler)(sched_config, kv)
    prepared = []
    original = runner.prepare_inputs
    runner.prepare_inputs = lambda so: prepared.append(original(so)) or prepared[-1]

    prefixes = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24], []]
    added = 0
    preempted = resumed = 0
    for op in ops + [("step", 200)]:
        if op[0] == "add":
            _, prefix, length, max_tokens = op
            prompt = (prefixes[prefix] + [30 + (added * 7 + i) % 90 for i in range(length)])
            prompt = prompt[: MAX_MODEL_LEN - 1]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            scheduler.add_request(Request.from_prompt(f"r{added}", prompt, params))
            added += 1
        elif op[0] == "abort":
            scheduler.finish_requests([f"r{op[1] % max(added, 1)}"])
        else:
            for _ in range(op[1]):
                if not scheduler.has_unfinished_requests():
                    break
                out = scheduler.schedule()
                preempted += len(out.preempted_req_ids)
                resumed += sum(out.scheduled_cached_reqs.resumed_from_preemption)
                expected = expected_inputs(scheduler, out)
                runner_output = runner.execute_model(out)
                if out.total_num_scheduled_tokens:
                    assert actual_inputs(runner, prepared[-1]) == expected
                scheduler.update_from_output(out, runner_output)
    # every row is gone once every request is
    out = scheduler.schedule()
    runner.execute_model(out)
    assert runner.input_batch.num_reqs == 0 and not runner.requests


def test_diff_carries_only_new_blocks():
    """A running request's blocks are sent once: later steps carry only the ones it gained."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    sched.add_request(Request.from_prompt("a", list(range(10, 17)),
                                          SamplingParams(temperature=0, max_tokens=20)))
    first = sched.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["a"]
    assert first.scheduled_new_reqs[0].block_ids == kv.get_block_ids("a")  # 7 tokens: 2 blocks
    new_blocks = []
    for step in range(6):
        request = sched.requests["a"]
        request.append_output_token_ids([50 + step])  # as update_from_output would
        out = sched.schedule()
        assert not out.scheduled_new_reqs and out.scheduled_cached_reqs.req_ids == ["a"]
        new_blocks.append(out.scheduled_cached_reqs.new_block_ids[0])
    # positions 7..12 are computed in these steps: blocks 3 and 4 begin at positions 8 and 12
    assert [len(b) for b in new_blocks] == [0, 1, 0, 0, 0, 1]
    assert sum(new_blocks, []) == kv.get_block_ids("a")[2:]
