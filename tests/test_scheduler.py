"""Scheduling policy, checked step by step on the simulated engine (real scheduler, no model)."""

from minivllm.config import SchedulerConfig
from minivllm.core.request import Request
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler
from minivllm.sim.engine import SimEngine


def _sim(scheduler="v1", budget=16, max_num_seqs=8, num_blocks=64, chunked=True, threshold=0,
         caching=True, max_model_len=256):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, enable_chunked_prefill=chunked,
                          long_prefill_token_threshold=threshold)
    return SimEngine(num_blocks, 4, scheduler=scheduler, scheduler_config=cfg,
                     enable_prefix_caching=caching)


def _steps(sim):
    sim.run()
    return [dict(t["scheduled"]) for t in sim.step_trace]


def test_v1_runs_prefill_chunks_beside_decodes_under_the_budget():
    sim = _sim(budget=16)
    sim.add_request("chat", list(range(10, 18)), max_tokens=20)
    sim.add_request("long", list(range(100, 160)), max_tokens=2, arrival_time=0.05)
    steps = _steps(sim)
    assert all(sum(s.values()) <= 16 for s in steps)
    mixed = [s for s in steps if "chat" in s and s.get("long", 0) > 1]
    assert mixed, "the long prompt must be chunked beside the running decode"
    assert all(s["chat"] == 1 and s["long"] == 15 for s in mixed)
    # the chat request decoded in every step while the long prompt was prefilled
    chat_steps = [i for i, s in enumerate(steps) if "chat" in s]
    assert chat_steps == list(range(chat_steps[0], chat_steps[-1] + 1))


def test_v0_separates_prefill_and_decode_steps():
    sim = _sim("v0", budget=256, chunked=False)
    sim.add_request("chat", list(range(10, 18)), max_tokens=20)
    sim.add_request("long", list(range(100, 160)), max_tokens=2, arrival_time=0.05)
    steps = _steps(sim)
    for s in steps:
        assert set(s) == {"long"} or all(n == 1 for n in s.values()) or set(s) == {"chat"}
    long_step = next(i for i, s in enumerate(steps) if s.get("long", 0) > 1)
    assert steps[long_step] == {"long": 60}  # the whole prompt, alone: the decode stalls


def test_long_prefill_token_threshold_caps_each_chunk():
    sim = _sim(budget=64, threshold=8)
    sim.add_request("a", list(range(10, 40)), max_tokens=1)
    steps = _steps(sim)
    assert [s["a"] for s in steps] == [8, 8, 8, 6]


def test_chunked_prefill_off_schedules_whole_prompts_only():
    sim = _sim(budget=40, chunked=False, max_model_len=40)
    sim.add_request("a", list(range(10, 40)), max_tokens=3)  # 30 tokens
    sim.add_request("b", list(range(50, 70)), max_tokens=3)  # 20: does not fit beside a
    steps = _steps(sim)
    assert steps[0] == {"a": 30}
    assert {"b": 20}.items() <= steps[1].items()


def test_max_num_seqs_caps_running_requests():
    sim = _sim(budget=64, max_num_seqs=2)
    for i in range(4):
        sim.add_request(f"r{i}", [10 + i] * 5, max_tokens=3)
    steps = _steps(sim)
    assert max(len(s) for s in steps) == 2
    assert all(r.finished for r in sim.records.values())


def test_preemption_takes_the_latest_arrival_and_requeues_it_first():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    sched = Scheduler(cfg, kv)
    early = Request.from_prompt("early", list(range(10, 18)))  # 2 blocks
    late = Request.from_prompt("late", list(range(20, 28)))  # 2 blocks
    waiting = Request.from_prompt("waiting", list(range(30, 34)))
    for r in (early, late):
        sched.add_request(r)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"early", "late"}
    # pretend both generated tokens until the pool is nearly full
    for r in (early, late):
        r.append_output_token_ids([1, 2, 3, 4])
    sched.add_request(waiting)
    # early needs a 3rd block, late a 3rd block: only 2 free -> ok; then another round
    out = sched.schedule()
    for r in (early, late):
        r.append_output_token_ids([5, 6, 7, 8])
    out = sched.schedule()
    assert "late" in out.preempted_req_ids and late.num_preemptions == 1
    assert sched.waiting[0] is late and late.num_computed_tokens == 0
    assert sched.num_preemptions >= 1


def test_same_step_prefix_sharing():
    """Blocks are cached as soon as they are allocated: a request scheduled later in the same
    step already hits them."""
    sim = _sim(budget=64)
    prefix = list(range(10, 26))  # 4 full blocks
    sim.add_request("a", prefix + [1, 2], max_tokens=1)
    sim.add_request("b", prefix + [3, 4], max_tokens=1)
    steps = _steps(sim)
    assert steps[0] == {"a": 18, "b": 2}
    assert sim.records["b"].num_cached_tokens == 16


def test_preempted_request_recomputes_from_its_cached_prefix():
    sim = _sim(budget=64, num_blocks=10, max_num_seqs=4, max_model_len=40)
    for i in range(3):
        sim.add_request(f"r{i}", [10 + i] * 8, max_tokens=20)
    sim.run()
    preempted = [r for r in sim.records.values() if r.num_preemptions]
    assert preempted and all(r.finished for r in sim.records.values())
    assert all(len(r.token_times) == 20 for r in sim.records.values())
    assert sim.kv_cache_manager.get_num_free_blocks() == 10


def test_v0_scheduler_is_a_drop_in_replacement_for_v1():
    """The same engine with scheduler="v0" instead of "v1", on the same workload with an abort
    and prefix sharing: every other request gets the same number of tokens, the aborted one stops
    early in both, the prefix cache serves the second prompt in both, and every block returns
    to the pool; only the steps differ (v0 never mixes a prompt with decodes, v1 does here)."""
    runs = {}
    for kind, cls in (("v1", Scheduler), ("v0", PhaseSeparatedScheduler)):
        sim = _sim(kind, budget=64, max_model_len=64)
        assert type(sim.scheduler) is cls
        shared = list(range(200, 208))  # two full blocks both prompts start with
        sim.add_request("a", shared + [1, 2, 3], max_tokens=8)
        sim.add_request("b", shared + [4, 5], max_tokens=5, arrival_time=0.01)
        sim.add_request("gone", list(range(30, 42)), max_tokens=40)
        for _ in range(3):
            sim.step()
        sim.abort("gone")
        steps = _steps(sim)
        assert sim.kv_cache_manager.get_num_free_blocks() == 64
        runs[kind] = ({rid: (len(r.token_times), r.finished, r.num_cached_tokens)
                       for rid, r in sim.records.items()},
                      any(1 in s.values() and max(s.values()) > 1 for s in steps))
    (v1, v1_mixes), (v0, v0_mixes) = runs["v1"], runs["v0"]
    assert v0["a"] == v1["a"] == (8, True, 0) and v0["b"] == v1["b"] == (5, True, 8)  # 2 blocks
    for run in (v0, v1):  # stopped where it was aborted (how far it got is the schedule's)
        assert run["gone"][1] and 0 < run["gone"][0] < 40
    assert v1_mixes and not v0_mixes


def _scheduler(cls=Scheduler, caching=True):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return cls(cfg, KVCacheManager(32, 4, enable_caching=caching))


def test_a_request_with_nothing_to_compute_is_skipped_not_an_error():
    """schedule() twice before the runner's output (or a runner that sampled nothing): the
    running request has 0 new tokens; it is left out of the step, as vLLM does."""
    from minivllm.core.sched_output import ModelRunnerOutput

    for cls in (Scheduler, PhaseSeparatedScheduler):
        s = _scheduler(cls)
        s.add_request(Request.from_prompt("a", list(range(6))))
        first = s.schedule()
        assert first.num_scheduled_tokens == {"a": 6}
        second = s.schedule()  # a's token is not back yet
        assert second.total_num_scheduled_tokens == 0 and not second.num_scheduled_tokens
        s.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]]))
        assert s.schedule().num_scheduled_tokens == {"a": 1}
        # a runner that sampled nothing for it: skipped again, still no error
        assert s.schedule().total_num_scheduled_tokens == 0


def test_prefix_cache_counters_stay_empty_with_caching_off():
    on, off = _scheduler(caching=True), _scheduler(caching=False)
    for s in (on, off):
        s.add_request(Request.from_prompt("a", list(range(9))))
        s.schedule()
    assert on.get_stats()["prefix_cache_queries"] == 9
    assert off.get_stats()["prefix_cache_queries"] == 0 and off.get_stats()["prefix_cache_hits"] == 0
