"""Checkers for chapter 07 (the engine core in its own process): the busy loop, 7.1.

``check_busy_loop(proc_cls)``: the learner's loop (``input_queue``, ``run_busy_loop()``) runs
on a thread over a fake core that logs every call: idle, it blocks on the queue; messages
waiting when a step ends are handled before the next; utility calls are answered between steps
(errors as errors); outputs reach ``output_put`` with the stats; SHUTDOWN ends the loop; a
step's exception is reported as ``engine_error``, then raised. Then it drives the real engine
core on the check model: the same greedy tokens as ``LLM``.
"""

from __future__ import annotations

import queue
import threading
import time

from minivllm.engine.messages import EngineCoreOutput
from minivllm.course.checks.common import Exercise, check_engine, fail, passed
from minivllm.engine import core_proc
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput

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


class FakeRequest:
    def __init__(self, request_id: str, num_tokens: int) -> None:
        self.request_id, self.num_tokens = request_id, num_tokens


class FakeCore:
    """Logs every call; each step gives every running request one token (``request_id:k``)."""

    def __init__(self, step_time: float = 0.002) -> None:
        self.log: list[tuple] = []
        self.running: dict[str, list[int]] = {}  # id -> [tokens so far, tokens wanted]
        self.step_time = step_time
        self.during_step: dict[int, callable] = {}  # step number -> called inside that step
        self.fail_at_step: int | None = None
        self.num_steps = 0
        self.idle_polls = 0
        self.lock = threading.Lock()

    def add_request(self, request) -> None:
        self.log.append(("add", request.request_id))
        self.running[request.request_id] = [0, request.num_tokens]

    def abort_requests(self, request_ids) -> None:
        self.log.append(("abort", tuple(request_ids)))
        for rid in request_ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        if not self.running:
            self.idle_polls += 1
        return bool(self.running)

    def step(self) -> list[EngineCoreOutput]:
        if not self.running:
            self.idle_polls += 1
            self.log.append(("empty step",))
            return []
        self.num_steps += 1
        n = self.num_steps
        self.log.append(("step", n, tuple(sorted(self.running))))
        if self.fail_at_step == n:
            raise RuntimeError("the fake core's step failed (on purpose)")
        if n in self.during_step:
            self.during_step.pop(n)()
        time.sleep(self.step_time)
        outputs = []
        for rid, state in list(self.running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outputs.append(EngineCoreOutput(rid, [state[0]], finish_reason="length" if done else None))
            if done:
                del self.running[rid]
        return outputs

    def get_stats(self) -> dict:
        return {"num_running": len(self.running), "num_steps": self.num_steps}

    def echo(self, *args):
        return list(args)

    def explode(self):
        raise ValueError("boom")


class Recorder:
    """``output_put``: logs what the loop hands out, into the core's log (one timeline)."""

    def __init__(self, core: FakeCore) -> None:
        self.core = core
        self.items: list[EngineCoreOutputs] = []
        self.event = threading.Event()

    def __call__(self, outputs) -> None:
        self.items.append(outputs)
        self.core.log.append(("put", outputs))
        self.event.set()


def _start(proc_cls, core: FakeCore, exercise: str, prefill: list | None = None):
    recorder = Recorder(core)
    proc = proc_cls(core, recorder)
    if not isinstance(getattr(proc, "input_queue", None), queue.Queue):
        fail(exercise, "the loop needs self.input_queue, a queue.Queue the IO thread fills. "
                       + CONVENTION)
    for item in prefill or []:
        proc.input_queue.put(item)
    errors: list[BaseException] = []

    def run():
        try:
            proc.run_busy_loop()
        except BaseException as e:  # noqa: BLE001 - reported to the checker
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True, name="learner-busy-loop")
    thread.start()
    return proc, recorder, thread, errors


def _wait(predicate, thread: threading.Thread, timeout: float = 5.0) -> bool:
    """Wait until ``predicate()``, or the loop's thread ended (it raised), or the timeout."""
    end = time.time() + timeout
    while time.time() < end and thread.is_alive():
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def _stop(proc, thread, exercise: str, errors: list) -> None:
    proc.input_queue.put((SHUTDOWN, None))
    thread.join(timeout=5)
    if thread.is_alive():
        fail(exercise, "the loop did not return within 5 s of a SHUTDOWN message. " + CONVENTION)
    if errors and not isinstance(errors[0], Exception):
        raise errors[0]
    if errors:
        if isinstance(errors[0], (AssertionError, NotImplementedError)):
            raise errors[0]  # a CheckFailed from inside the loop, or an unsolved exercise
        fail(exercise, f"the loop raised {type(errors[0]).__name__}: {errors[0]}. " + CONVENTION)


def _tokens_out(recorder: Recorder) -> dict[str, list]:
    got: dict[str, list] = {}
    for item in recorder.items:
        for out in item.outputs or []:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def check_busy_loop(proc_cls, exercise: str = "7.1") -> None:
    """``proc_cls(engine_core, output_put)``: has ``input_queue`` and ``run_busy_loop()``."""
    if not isinstance(proc_cls, type):
        fail(exercise, f"expected a class (proc_cls(engine_core, output_put)), got {proc_cls!r}")
    proc_cls = Exercise(exercise, answer=("minivllm.engine.core_proc:EngineCoreProc",),
                        allowed="queue, self.engine_core's methods and self.output_put").take(
        proc_cls, "engine core loop")
    _check_fake_core(proc_cls, exercise)
    num_tokens = _check_real_core(proc_cls, exercise)
    passed(exercise, f"{proc_cls.__name__} blocks when idle, drains every waiting message before "
                     f"each step, lands aborts before the next step, answers utility calls "
                     f"between steps, reports a failing step, stops on SHUTDOWN, and drives the "
                     f"real engine core to the reference's {num_tokens} greedy tokens.")


def _check_fake_core(proc_cls, exercise: str) -> None:
    # 1. messages waiting before the loop starts all land before the first step
    core = FakeCore()
    prefill = [(ADD, FakeRequest(f"r{i}", 4)) for i in range(5)]
    proc, rec, thread, errors = _start(proc_cls, core, exercise, prefill)
    if not _wait(lambda: not core.running and core.num_steps >= 4, thread):
        _stop(proc, thread, exercise, errors)
        fail(exercise, f"5 requests of 4 tokens each were queued; after 5 s the fake core had run "
                       f"{core.num_steps} steps. " + CONVENTION)
    steps = [e for e in core.log if e[0] == "step"]
    if steps[0][2] != tuple(f"r{i}" for i in range(5)):
        _stop(proc, thread, exercise, errors)
        fail(exercise, f"5 ADD messages were waiting before the loop started, but the first step "
                       f"ran with {list(steps[0][2])}: drain the whole input queue (get_nowait "
                       f"until queue.Empty) before each step, not one message per step. "
                       + CONVENTION)
    got = _tokens_out(rec)
    if got != {f"r{i}": [1, 2, 3, 4] for i in range(5)}:
        _stop(proc, thread, exercise, errors)
        fail(exercise, f"the outputs handed to output_put carry these tokens: {got}; expected "
                       f"every step's outputs, in order ([1, 2, 3, 4] per request). " + CONVENTION)
    if any(item.outputs and item.scheduler_stats is None for item in rec.items):
        _stop(proc, thread, exercise, errors)
        fail(exercise, "outputs were handed out without scheduler_stats: the front end's /metrics "
                       "reads them from every batch. " + CONVENTION)

    # 2. idle: no polling
    time.sleep(0.05)
    polls = core.idle_polls
    time.sleep(0.3)
    if core.idle_polls - polls > 3:
        _stop(proc, thread, exercise, errors)
        fail(exercise, f"with no request left, the loop asked the fake core "
                       f"{core.idle_polls - polls} times in 0.3 s whether it had work (or stepped "
                       f"it): a busy-wait burns a core the front end needs. Block on "
                       f"input_queue.get() while the core has no unfinished request. " + CONVENTION)

    # 3. wakes up for a new request
    start = time.time()
    proc.input_queue.put((ADD, FakeRequest("late", 2)))
    if not _wait(lambda: _tokens_out(rec).get("late") == [1, 2], thread, timeout=2):
        _stop(proc, thread, exercise, errors)
        fail(exercise, "after a quiet spell, a new ADD was not served within 2 s: the loop must "
                       "wake up when a message arrives. " + CONVENTION)
    wake = time.time() - start

    # 4. messages arriving during a step land before the next one; utility calls between steps
    base = core.num_steps
    mark = len(core.log)

    def arrivals():
        proc.input_queue.put((ADD, FakeRequest("b", 5)))
        proc.input_queue.put((ABORT, ["a"]))
        proc.input_queue.put((UTILITY, (7, "get_stats", [])))
        proc.input_queue.put((UTILITY, (8, "echo", [1, "x"])))
        proc.input_queue.put((UTILITY, (9, "no_such_method", [])))
        proc.input_queue.put((UTILITY, (10, "explode", [])))

    core.during_step[base + 2] = arrivals
    proc.input_queue.put((ADD, FakeRequest("a", 50)))
    if not _wait(lambda: "b" not in core.running and core.num_steps >= base + 4, thread):
        _stop(proc, thread, exercise, errors)
        fail(exercise, "messages sent while a step ran were never handled. " + CONVENTION)
    log = core.log[mark:]
    idx_step2 = next(i for i, e in enumerate(log) if e[0] == "step" and e[1] == base + 2)
    idx_step3 = next(i for i, e in enumerate(log) if e[0] == "step" and e[1] == base + 3)
    between = log[idx_step2 + 1:idx_step3]
    if ("abort", ("a",)) not in between or ("add", "b") not in between:
        _stop(proc, thread, exercise, errors)
        fail(exercise, f"an ADD and an ABORT arrived during step {base + 2}; the next step ran "
                       f"with {list(log[idx_step3][2])} (expected ['b']: 'a' aborted, 'b' added). "
                       f"Everything waiting is handled before the next step. " + CONVENTION)
    answers = {e[1].utility_output.call_id: e[1].utility_output for e in between
               if e[0] == "put" and e[1].utility_output is not None}
    if set(answers) != {7, 8, 9, 10}:
        _stop(proc, thread, exercise, errors)
        fail(exercise, f"four utility calls arrived during a step; between it and the next step "
                       f"the loop answered call ids {sorted(answers)} (expected [7, 8, 9, 10]), "
                       f"each as its own EngineCoreOutputs(utility_output=UtilityOutput(...)). "
                       + CONVENTION)
    want = {7: core.get_stats().keys(), 8: [1, "x"]}
    if not isinstance(answers[7], UtilityOutput) or not isinstance(answers[7].result, dict) or \
            answers[7].error is not None or set(answers[7].result) != set(want[7]):
        _stop(proc, thread, exercise, errors)
        fail(exercise, f"get_stats() answered {answers[7]!r}: expected UtilityOutput(7, "
                       f"result=engine_core.get_stats()). " + CONVENTION)
    if answers[8].result != [1, "x"] or answers[8].error is not None:
        _stop(proc, thread, exercise, errors)
        fail(exercise, f"echo(1, 'x') answered {answers[8]!r}: the args list is spread over the "
                       f"call, getattr(engine_core, method)(*args). " + CONVENTION)
    for call_id, what in ((9, "an unknown method"), (10, "a method that raises")):
        if not answers[call_id].error or answers[call_id].result is not None:
            _stop(proc, thread, exercise, errors)
            fail(exercise, f"{what} answered {answers[call_id]!r}: expected UtilityOutput with "
                           f"error set (a message), so the caller raises and the loop lives on. "
                           + CONVENTION)
    _stop(proc, thread, exercise, errors)
    if thread.is_alive():
        fail(exercise, "the loop is still running after SHUTDOWN. " + CONVENTION)

    # 5. a failing step is reported, then raised
    core = FakeCore()
    core.fail_at_step = 2
    proc, rec, thread, errors = _start(proc_cls, core, exercise, [(ADD, FakeRequest("x", 5))])
    thread.join(timeout=5)
    if thread.is_alive():
        _stop(proc, thread, exercise, errors)
        fail(exercise, "the fake core's step raised, and the loop kept running: a fatal error ends "
                       "the loop (raise it) after telling the front end. " + CONVENTION)
    if not any(item.engine_error for item in rec.items):
        fail(exercise, "the fake core's step raised, and no EngineCoreOutputs(engine_error=...) "
                       "reached output_put: the front end would wait forever. Catch, put "
                       "EngineCoreOutputs(engine_error=traceback.format_exc()), re-raise. "
                       + CONVENTION)
    if not errors:
        fail(exercise, "the fake core's step raised, and run_busy_loop returned normally: "
                       "re-raise after reporting, so the process exits with an error. " + CONVENTION)
    del wake


def _check_real_core(proc_cls, exercise: str) -> int:
    from minivllm import SamplingParams
    from minivllm.course.checks.common import ENGINE_PROMPTS, greedy_token_ids

    llm = check_engine()
    expected = greedy_token_ids(llm, ENGINE_PROMPTS, max_tokens=8)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    got: dict[str, list[int]] = {}
    done = threading.Event()
    finished: set[str] = set()

    def put(outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs or []:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        if outputs.engine_error or len(finished) == len(ENGINE_PROMPTS):
            done.set()

    proc = proc_cls(core, put)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(ENGINE_PROMPTS):
        request, _ = engine.processor.process(f"loop-{i}", prompt, params)
        proc.input_queue.put((ADD, request))
    thread = threading.Thread(target=proc.run_busy_loop, daemon=True)
    engine.reset_prefix_cache()
    thread.start()
    ok = done.wait(timeout=120)
    proc.input_queue.put((SHUTDOWN, None))
    thread.join(timeout=10)
    engine.reset_prefix_cache()
    if not ok:
        fail(exercise, "on the real engine core, 4 requests of 8 tokens did not finish within "
                       "120 s. " + CONVENTION)
    for i, want in enumerate(expected):
        if got.get(f"loop-{i}") != list(want):
            fail(exercise, f"on the real engine core, request {i} got tokens "
                           f"{got.get(f'loop-{i}')}, expected {list(want)}. " + CONVENTION)
    return sum(len(e) for e in expected)
