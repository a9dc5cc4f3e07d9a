"""Exercise 7.1: the engine core's busy loop, over a call-logging fake core, then the real one."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

from minivllm.course.checks.common import ENGINE_PROMPTS, Exercise, check_engine, greedy_token_ids
from minivllm.engine.messages import (
    EngineCoreOutput, EngineCoreOutputs, EngineCoreRequestType, UtilityOutput,
)

ADD, ABORT, UTILITY, SHUTDOWN = (EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT,
                                 EngineCoreRequestType.UTILITY, EngineCoreRequestType.SHUTDOWN)

CONVENTION = ("Expected: run_busy_loop() repeats until SHUTDOWN: if the core has no unfinished "
              "request, block on input_queue.get() (no polling); then handle every message "
              "waiting (get_nowait until queue.Empty): ADD -> engine_core.add_request(payload), "
              "ABORT -> engine_core.abort_requests(payload), UTILITY (call_id, method, args) -> "
              "output_put(EngineCoreOutputs(utility_output=UtilityOutput(call_id, result=... or "
              "error=...))), SHUTDOWN -> stop; then outputs = engine_core.step() and, if there are "
              "outputs or a message was handled, output_put(EngineCoreOutputs(outputs=outputs, "
              "scheduler_stats=engine_core.get_stats(), timestamp=time.time())).")

ANSWERED_WITH_ERROR = ("expected UtilityOutput with error set (a message), so the caller raises "
                       "and the loop lives on.")
UTILITY_CALLS = [  # (call id, method, args, is its answer right?, what else was expected)
    (7, "get_stats", [], lambda a: isinstance(a, UtilityOutput) and isinstance(a.result, dict)
     and a.error is None and set(a.result) == {"num_running", "num_steps"},
     "get_stats() answered {}: expected UtilityOutput(7, result=engine_core.get_stats())."),
    (8, "echo", [1, "x"], lambda a: a.result == [1, "x"] and a.error is None,
     "echo(1, 'x') answered {}: the args list is spread over the call, "
     "getattr(engine_core, method)(*args)."),
    (9, "no_such_method", [], lambda a: a.error and a.result is None,
     "an unknown method answered {}: " + ANSWERED_WITH_ERROR),
    (10, "explode", [], lambda a: a.error and a.result is None,
     "a method that raises answered {}: " + ANSWERED_WITH_ERROR),
]


def _request(request_id: str, num_tokens: int):
    return SimpleNamespace(request_id=request_id, num_tokens=num_tokens)


class FakeCore:
    """Logs every call and output (``put``); each step gives every running request a token."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.log, self.items = [], []  # the timeline, the outputs handed out
        self.running: dict[str, list[int]] = {}  # id -> [tokens so far, tokens wanted]
        self.during_step: dict[int, callable] = {}  # step number -> called inside that step
        self.fail_at_step = fail_at_step
        self.num_steps = self.idle_polls = 0

    def put(self, outputs) -> None:
        self.items.append(outputs)
        self.log.append(("put", outputs))

    def tokens(self) -> dict[str, list]:
        got: dict[str, list] = {}
        for item in self.items:
            for out in item.outputs or []:
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        return got

    def add_request(self, request) -> None:
        self.log.append(("add", request.request_id))
        self.running[request.request_id] = [0, request.num_tokens]

    def abort_requests(self, request_ids) -> None:
        self.log.append(("abort", tuple(request_ids)))
        for rid in request_ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        self.idle_polls += not self.running
        return bool(self.running)

    def step(self) -> list[EngineCoreOutput]:
        if not self.running:
            self.idle_polls += 1
            self.log.append(("empty step",))
            return []
        self.num_steps += 1
        self.log.append(("step", self.num_steps, tuple(sorted(self.running))))
        if self.fail_at_step == self.num_steps:
            raise RuntimeError("the fake core's step failed (on purpose)")
        if self.num_steps in self.during_step:
            self.during_step.pop(self.num_steps)()
        time.sleep(0.002)
        for state in self.running.values():
            state[0] += 1
        outputs = [EngineCoreOutput(rid, [n], finish_reason="length" if n >= wanted else None)
                   for rid, (n, wanted) in self.running.items()]
        self.running = {rid: s for rid, s in self.running.items() if s[0] < s[1]}
        return outputs

    def get_stats(self) -> dict:
        return {"num_running": len(self.running), "num_steps": self.num_steps}

    def echo(self, *args):
        return list(args)

    def explode(self):
        raise ValueError("boom")


class _Loop:
    """The learner's loop running on a thread over ``core``; ``expect`` stops it, then fails."""

    def __init__(self, ex: Exercise, proc_cls, core, waiting=(), output_put=None) -> None:
        self.ex, self.core, self.errors = ex, core, []
        self.proc = proc_cls(core, output_put or core.put)
        if not isinstance(getattr(self.proc, "input_queue", None), queue.Queue):
            ex.fail("the loop needs self.input_queue, a queue.Queue the IO thread fills.")
        self.put(*waiting)
        self.thread = threading.Thread(target=self._run, daemon=True, name="learner-busy-loop")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.proc.run_busy_loop()
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.errors.append(e)

    def put(self, *messages) -> None:
        for message in messages:
            self.proc.input_queue.put(message)

    def wait(self, predicate, timeout: float = 5.0) -> bool:
        end = time.time() + timeout
        while time.time() < end and self.thread.is_alive() and not predicate():
            time.sleep(0.005)
        return predicate()

    def expect(self, ok, message: str) -> None:
        if not ok:
            self.stop()
            self.ex.fail(message)

    def stop(self) -> None:
        self.put((SHUTDOWN, None))
        self.thread.join(timeout=5)
        if self.thread.is_alive():
            self.ex.fail("the loop did not return within 5 s of a SHUTDOWN message.")
        if self.errors:
            error = self.errors[0]
            if not isinstance(error, Exception) or isinstance(error, (AssertionError,
                                                                      NotImplementedError)):
                raise error  # a CheckFailed from inside the loop, or an unsolved exercise
            self.ex.fail(f"the loop raised {type(error).__name__}: {error}.")


def check_busy_loop(proc_cls, exercise: str = "7.1") -> None:
    """``proc_cls(engine_core, output_put)``: has ``input_queue`` and ``run_busy_loop()``."""
    ex = Exercise(exercise, CONVENTION, ("minivllm.engine.core_proc:EngineCoreProc",),
                  allowed="queue, self.engine_core's methods and self.output_put")
    if not isinstance(proc_cls, type):
        ex.fail(f"expected a class (proc_cls(engine_core, output_put)), got {proc_cls!r}.")
    proc_cls = ex.take(proc_cls, "engine core loop")
    _check_fake_core(ex, proc_cls)
    num_tokens = _check_real_core(ex, proc_cls)
    ex.passed(f"{proc_cls.__name__} blocks when idle, drains every waiting message before "
              f"each step, lands aborts before the next step, answers utility calls "
              f"between steps, reports a failing step, stops on SHUTDOWN, and drives the "
              f"real engine core to the reference's {num_tokens} greedy tokens.")


def _check_fake_core(ex: Exercise, proc_cls) -> None:
    core = FakeCore()  # 1. messages waiting before the loop starts all land before the first step
    loop = _Loop(ex, proc_cls, core, [(ADD, _request(f"r{i}", 4)) for i in range(5)])
    loop.expect(loop.wait(lambda: not core.running and core.num_steps >= 4),
                f"5 requests of 4 tokens each were queued; after 5 s the fake core had run "
                f"{core.num_steps} steps.")
    first = next(e for e in core.log if e[0] == "step")
    loop.expect(first[2] == tuple(f"r{i}" for i in range(5)),
                f"5 ADD messages were waiting before the loop started, but the first step ran "
                f"with {list(first[2])}: drain the whole input queue (get_nowait until "
                f"queue.Empty) before each step, not one message per step.")
    loop.expect(core.tokens() == {f"r{i}": [1, 2, 3, 4] for i in range(5)},
                f"the outputs handed to output_put carry these tokens: {core.tokens()}; expected "
                f"every step's outputs, in order ([1, 2, 3, 4] per request).")
    loop.expect(not any(item.outputs and item.scheduler_stats is None for item in core.items),
                "outputs were handed out without scheduler_stats: the front end's /metrics "
                "reads them from every batch.")
    time.sleep(0.05)  # 2. idle: no polling
    polls = core.idle_polls
    time.sleep(0.3)
    loop.expect(core.idle_polls - polls <= 3,
                f"with no request left, the loop asked the fake core {core.idle_polls - polls} "
                f"times in 0.3 s whether it had work (or stepped it): a busy-wait burns a core "
                f"the front end needs. Block on input_queue.get() while the core has no "
                f"unfinished request.")
    loop.put((ADD, _request("late", 2)))  # 3. wakes up for a new request
    loop.expect(loop.wait(lambda: core.tokens().get("late") == [1, 2], timeout=2),
                "after a quiet spell, a new ADD was not served within 2 s: the loop must wake up "
                "when a message arrives.")
    # 4. messages arriving during a step land before the next one; utility calls between steps
    base, mark = core.num_steps, len(core.log)
    core.during_step[base + 2] = lambda: loop.put(
        (ADD, _request("b", 5)), (ABORT, ["a"]),
        *((UTILITY, (call_id, method, args)) for call_id, method, args, _, _ in UTILITY_CALLS))
    loop.put((ADD, _request("a", 50)))
    loop.expect(loop.wait(lambda: "b" not in core.running and core.num_steps >= base + 4),
                "messages sent while a step ran were never handled.")
    log = core.log[mark:]
    step2, step3 = (next(i for i, e in enumerate(log) if e[0] == "step" and e[1] == base + n)
                    for n in (2, 3))
    between = log[step2 + 1:step3]
    loop.expect(("abort", ("a",)) in between and ("add", "b") in between,
                f"an ADD and an ABORT arrived during step {base + 2}; the next step ran with "
                f"{list(log[step3][2])} (expected ['b']: 'a' aborted, 'b' added). Everything "
                f"waiting is handled before the next step.")
    answers = {e[1].utility_output.call_id: e[1].utility_output for e in between
               if e[0] == "put" and e[1].utility_output is not None}
    loop.expect(set(answers) == {7, 8, 9, 10},
                f"four utility calls arrived during a step; between it and the next step the "
                f"loop answered call ids {sorted(answers)} (expected [7, 8, 9, 10]), each as its "
                f"own EngineCoreOutputs(utility_output=UtilityOutput(...)).")
    for call_id, _, _, right, message in UTILITY_CALLS:
        loop.expect(right(answers[call_id]), message.format(repr(answers[call_id])))
    loop.stop()
    loop = _Loop(ex, proc_cls, FakeCore(fail_at_step=2), [(ADD, _request("x", 5))])  # 5. errors
    loop.thread.join(timeout=5)
    loop.expect(not loop.thread.is_alive(),
                "the fake core's step raised, and the loop kept running: a fatal error ends the "
                "loop (raise it) after telling the front end.")
    if not any(item.engine_error for item in loop.core.items):
        ex.fail("the fake core's step raised, and no EngineCoreOutputs(engine_error=...) reached "
                "output_put: the front end would wait forever. Catch, put "
                "EngineCoreOutputs(engine_error=traceback.format_exc()), re-raise.")
    if not loop.errors:
        ex.fail("the fake core's step raised, and run_busy_loop returned normally: re-raise "
                "after reporting, so the process exits with an error.")


def _check_real_core(ex: Exercise, proc_cls) -> int:
    from minivllm import SamplingParams

    llm = check_engine()
    expected = greedy_token_ids(llm, ENGINE_PROMPTS, max_tokens=8)
    engine = llm.llm_engine
    got, finished, done = {}, set(), threading.Event()

    def put(outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs or []:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        if outputs.engine_error or len(finished) == len(ENGINE_PROMPTS):
            done.set()

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = [(ADD, engine.processor.process(f"loop-{i}", prompt, params)[0])
                for i, prompt in enumerate(ENGINE_PROMPTS)]
    engine.reset_prefix_cache()
    core = engine.engine_core.engine_core
    loop = _Loop(ex, proc_cls, core, requests, output_put=put)
    try:
        ok = loop.wait(done.is_set, timeout=120)
        loop.stop()  # raises what the loop raised
    finally:  # a loop that failed leaves no request in the shared engine (if it has stopped)
        if not loop.thread.is_alive():
            core.abort_requests([f"loop-{i}" for i in range(len(ENGINE_PROMPTS))
                                 if f"loop-{i}" not in finished])
        engine.reset_prefix_cache()
    if not ok:
        ex.fail("on the real engine core, 4 requests of 8 tokens did not finish within 120 s.")
    for i, want in enumerate(expected):
        if got.get(f"loop-{i}") != list(want):
            ex.fail(f"on the real engine core, request {i} got tokens {got.get(f'loop-{i}')}, "
                    f"expected {list(want)}.")
    return sum(len(e) for e in expected)
