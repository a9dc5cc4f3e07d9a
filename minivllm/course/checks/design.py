"""Design exercises graded by behaviour (5.3 priority preemption, 7.3 overlap scheduling): an
``EngineCore`` serves a workload drawn now; tokens, KV invariants and the exercise's property."""

from __future__ import annotations

import random
import threading
import time

from minivllm.course.grading import Exercise

ENGINE = dict(device="cpu", block_size=8, max_num_seqs=3, max_num_batched_tokens=32,
              enable_prefix_caching=False)


def _core(core_cls=None, **overrides):
    from minivllm.config import EngineArgs
    from minivllm.course.checks.common import check_model_path
    from minivllm.engine.core import EngineCore
    config = EngineArgs(model=check_model_path(), **{**ENGINE, **overrides}).create_config()
    return (core_cls or EngineCore)(config, show_progress=False)


def _request(rid: str, rng: random.Random, arrival: float, prompt_len: int, max_tokens: int,
             priority: int = 0):
    from minivllm import SamplingParams
    from minivllm.engine.messages import EngineCoreRequest
    return EngineCoreRequest(rid, [rng.randrange(10, 1000) for _ in range(prompt_len)],
                             SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             arrival_time=arrival, priority=priority)


def _drive(ex: Exercise, core, workload: list, max_steps: int, on_step=None, want=None,
           where: str = "") -> dict:
    """Add each ``(step, request)`` before its step and step until all finish, leaking no KV
    block; request id -> its tokens, which must equal ``want``'s if given. ``on_step(step,
    outputs, arrived ids)`` runs after each step."""
    from minivllm.testing import all_free_violations

    pending, tokens, finished = sorted(workload, key=lambda w: w[0]), {}, set()
    step = 0
    try:
        while pending or core.has_unfinished_requests():
            if step >= max_steps:
                left = sorted(set(tokens) - finished)
                ex.fail(f"after {max_steps} steps requests {left} have not finished: every "
                        "request must finish (none may starve or be lost)." if left else
                        f"after {max_steps} steps every request has finished, but the engine "
                        "still reports unfinished requests (has_unfinished_requests()).")
            while pending and pending[0][0] <= step:
                request = pending.pop(0)[1]
                core.add_request(request)
                tokens[request.request_id] = []
            outputs = core.step()
            for out in outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    finished.add(out.request_id)
            if on_step is not None:
                on_step(step, outputs, list(tokens))
            step += 1
        problems = all_free_violations(core.scheduler.kv_cache_manager)
        if problems:
            ex.fail("KV blocks leak: " + "; ".join(problems) + ".")
    finally:
        core.shutdown()
    for rid, expected in (want or {}).items():
        ex.compare_lists(f"{where}, request {rid}'s greedy tokens", tokens.get(rid, []), expected)
    return tokens


# -- 5.3 priority preemption ---------------------------------------------------------------------

PRIORITY_CONVENTION = (
    "Expected: a Scheduler subclass whose schedule() serves requests by request.priority (a lower "
    "value first, then the earlier arrival_time): a request is never admitted, nor resumed, "
    "while one that outranks it is waiting; when KV blocks run out it preempts the "
    "lowest-ranked running request, never one that outranks a request keeping its blocks; every "
    "request finishes with the package's greedy tokens and no KV block leaks.")
PRIORITY_DRAWS = 3  # workloads per grading: one draw may not tell the victim rules apart
PRIORITY_ANSWER = ("minivllm.core.scheduler:Scheduler.schedule",
                   "minivllm.core.scheduler:Scheduler._allocate_or_preempt",
                   "minivllm.core.scheduler_v0:PhaseSeparatedScheduler.schedule")  # v0's loop


def draw_priority_workload(rng: random.Random) -> list:
    """Six background requests (priorities 1-3) at step 0, two urgent ones (priority 0) later,
    over a KV cache too small for all: waiting and preemption are certain."""
    work = [(0, _request(f"bg{i}", rng, float(i), rng.randrange(20, 41), rng.randrange(16, 29),
                         rng.randrange(1, 4))) for i in range(6)]
    for j, step in enumerate(sorted(rng.sample(range(2, 9), 2))):
        work.append((step, _request(f"urgent{j}", rng, 10.0 + j, rng.randrange(8, 17),
                                    rng.randrange(28, 41), 0)))
    return work


def check_priority_scheduler(scheduler_cls, exercise: str = "5.3", seed: int | None = None) -> None:
    """The learner's scheduler on workloads drawn now (``seed``: the same draws again)."""
    ex = Exercise(exercise, PRIORITY_CONVENTION, PRIORITY_ANSWER, required=("schedule",),
                  allowed="make_scheduler_output, record_admission, _preempt, _try_admit and the "
                          "KV cache manager")
    scheduler_cls = ex.take(scheduler_cls, "scheduler")
    rng = random.Random(seed)  # None: a draw from the system's randomness
    preemptions = [_grade_priority(ex, scheduler_cls, draw_priority_workload(rng))
                   for _ in range(PRIORITY_DRAWS)]  # every draw graded before counting
    if not all(preemptions):
        ex.fail("the workload's KV cache cannot hold every request at once, but your scheduler "
                "never preempted one (preempted requests must be reported to "
                "make_scheduler_output).")
    ex.passed(f"{PRIORITY_DRAWS} workloads drawn when it was graded (8 requests each, two urgent "
              "arrivals) were served by priority: admissions in rank order, preemptions of the "
              "lowest-ranked request, the package's greedy tokens, no KV block leaked.")


def _grade_priority(ex: Exercise, scheduler_cls, workload: list) -> int:
    """Drive ``workload``, checking each step's trace against the ranks; how many preemptions."""
    from minivllm.testing import kv_cache_violations

    rank = {r.request_id: (r.priority, r.arrival_time) for _, r in workload}
    engine = dict(num_kv_blocks=12, max_model_len=96)
    want = _drive(ex, _core(**engine), workload, 400)
    core = _core(scheduler_cls=scheduler_cls, **engine)
    running, done, seen = set(), set(), {"steps": 0, "preempted": 0}

    def show(rid: str) -> str:
        return f"{rid} (priority {rank[rid][0]})"

    def on_step(step, outputs, arrived):
        problems = kv_cache_violations(core.scheduler)
        if problems:
            ex.fail(f"after step {step}: " + "; ".join(problems) + ".")
        trace = core.get_step_trace()
        if trace and trace[-1]["step"] >= seen["steps"]:
            entry = trace[-1]
            seen["steps"] = entry["step"] + 1
            admitted = {rid for rid, _, _ in entry["scheduled"]} - running
            for r in admitted:
                ahead = [w for w in set(arrived) - running - done - admitted if rank[w] < rank[r]]
                if ahead:
                    ex.fail(f"at step {step} you admitted {show(r)} while {show(ahead[0])} "
                            "was waiting: the request that outranks it goes first.")
            running.update(admitted)
            # a step's victims are a set (no order): each is checked against the requests that
            # kept their blocks through the step
            running.difference_update(entry["preempted"])
            seen["preempted"] += len(entry["preempted"])
            for v in entry["preempted"]:
                lower = [r for r in running if rank[r] > rank[v]]
                if lower:
                    ex.fail(f"at step {step} you preempted {show(v)} while {show(lower[0])}, "
                            "which it outranks, kept its KV blocks: preempt the lowest-ranked "
                            "running request.")
        finished = {out.request_id for out in outputs if out.finished}
        running.difference_update(finished)
        done.update(finished)

    _drive(ex, core, workload, 400, on_step, want, "with your scheduler")
    return seen["preempted"]


# -- 7.3 overlap scheduling ----------------------------------------------------------------------

OVERLAP_CONVENTION = (
    "Expected: an EngineCore subclass whose step() hands a step to the model and, while the model "
    "runs it, schedules the next one (the scheduler is called while a model step is in flight); "
    "step() returns the outputs of the steps that completed, every request ends with the "
    "package's greedy tokens, and no KV block leaks.")
OVERLAP_ANSWER = ("minivllm.engine.core:EngineCore.step",)
MODEL_DELAY_S = 0.05  # the instrumented runner's extra time per step: a window to schedule in


def _instrumented_classes():
    """A model runner ``MODEL_DELAY_S`` slower per step and a scheduler, both logging calls:
    (start, end, the SchedulerOutput the call ran or made; kept, so that ids stay unique)."""
    from minivllm.core.scheduler import Scheduler
    from minivllm.worker.model_runner import ModelRunner

    log, lock = {"model": [], "schedule": []}, threading.Lock()

    def timed(key, call, *args, delay=0.0):
        start = time.perf_counter()
        time.sleep(delay)
        out = call(*args)
        with lock:
            log[key].append((start, time.perf_counter(), args[0] if args else out))
        return out

    class TimedModelRunner(ModelRunner):
        def execute_model(self, scheduler_output):
            return timed("model", super().execute_model, scheduler_output, delay=MODEL_DELAY_S)

    class TimedScheduler(Scheduler):
        def schedule(self):
            return timed("schedule", super().schedule)

    return TimedModelRunner, TimedScheduler, log


def check_overlap_core(core_cls, exercise: str = "7.3", seed: int | None = None) -> None:
    """The learner's ``EngineCore`` on a workload drawn now: tokens, KV blocks and overlap."""
    ex = Exercise(exercise, OVERLAP_CONVENTION, OVERLAP_ANSWER, required=("step",),
                  allowed="the scheduler's and the executor's methods, and threads")
    core_cls = ex.take(core_cls, "engine core")
    rng = random.Random(seed)  # None: a draw from the system's randomness
    workload = [(rng.randrange(0, 9) if i else 0,
                 _request(f"r{i}", rng, float(i), rng.randrange(24, 65), rng.randrange(4, 9)))
                for i in range(6)]
    engine = dict(num_kv_blocks=64, max_model_len=96, max_num_batched_tokens=16, max_num_seqs=4)
    want = _drive(ex, _core(**engine), workload, 300)
    runner_cls, scheduler_cls, log = _instrumented_classes()
    core = _core(core_cls, model_runner_cls=runner_cls, scheduler_cls=scheduler_cls, **engine)
    _drive(ex, core, workload, 300, want=want, where="with your engine core")
    windows = [(a, b) for a, b, _ in log["model"]]
    executed = {id(out) for _, _, out in log["model"]}
    # a schedule() call counts only if the model then ran the step it made (not a decoy's)
    calls = [(s, e) for s, e, out in log["schedule"] if id(out) in executed]
    overlapped = sum(any(s < b and a < e for s, e in calls) for a, b in windows[:-1])
    if 3 * overlapped < len(windows) - 1:
        ex.fail(f"of your engine's {len(windows)} model steps, only {overlapped} had the scheduler "
                "called while the model ran them, for a step the model then ran (at least a "
                "third must): schedule step N+1 while step N is in flight (the model's step can "
                "run in another thread), not after it returns.")
    ex.passed(f"a workload drawn when it was graded ({len(workload)} requests) gave the package's "
              "greedy tokens, and in at least a third of the model steps the scheduler ran while "
              "the model did.")
