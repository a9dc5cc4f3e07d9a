"""The checkers of chapters 07 and 08: each classic mistake fails with a CheckFailed that names
the convention or the mistake. (That a correct component passes, the solutions notebooks show
under nbval; 8.2's is cheap enough to check here too.)"""

import json
import queue
import time
import traceback

import numpy as np
import pytest

from minivllm.course import checks
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput
from tests.course_helpers import fails


# -- 7.1 the busy loop ---------------------------------------------------------------------------

class Loop:
    def __init__(self, engine_core, output_put):
        self.engine_core, self.output_put = engine_core, output_put
        self.input_queue = queue.Queue()
        self.running = True

    def wait_for_work(self):
        if not self.engine_core.has_unfinished_requests():
            self.handle(*self.input_queue.get())
            return True
        return False

    def drain(self):
        handled = False
        while self.running:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                break
            self.handle(*item)
            handled = True
        return handled

    def run_busy_loop(self):
        try:
            while self.running:
                handled = self.wait_for_work()
                handled = self.drain() or handled
                if not self.running:
                    break
                outputs = self.engine_core.step()
                if outputs or handled:
                    self.output_put(EngineCoreOutputs(outputs, self.engine_core.get_stats(),
                                                      timestamp=time.time()))
        except Exception:
            self.output_put(EngineCoreOutputs(engine_error=traceback.format_exc()))
            raise

    def handle(self, kind, payload):
        if kind == EngineCoreRequestType.ADD:
            self.engine_core.add_request(payload)
        elif kind == EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(payload)
        elif kind == EngineCoreRequestType.UTILITY:
            call_id, method, args = payload
            try:
                out = UtilityOutput(call_id, result=getattr(self.engine_core, method)(*args))
            except Exception as e:
                out = UtilityOutput(call_id, error=str(e))
            self.output_put(EngineCoreOutputs(utility_output=out))
        else:
            self.running = False


class BusyWaiting(Loop):
    def wait_for_work(self):
        while not self.engine_core.has_unfinished_requests() and self.input_queue.empty():
            time.sleep(0.001)
        return False


class OneMessagePerStep(Loop):
    def drain(self):
        try:
            self.handle(*self.input_queue.get_nowait())
            return True
        except queue.Empty:
            return False


@pytest.mark.parametrize("cls, fragment", [
    (BusyWaiting, "busy-wait"),
    (OneMessagePerStep, "drain the whole input queue"),
])
def test_busy_loop_mistakes_fail_naming_them(cls, fragment):
    fails(checks.check_busy_loop, cls, "Exercise 7.1", fragment)


class FailsOnTheRealCore(Loop):
    """Right on the fake core; raises in its third step of the real one, requests unfinished."""

    def run_busy_loop(self):
        real = type(self.engine_core).__name__ == "EngineCore"
        step, steps = self.engine_core.step, [0]

        def counted():
            steps[0] += 1
            if real and steps[0] == 3:
                raise RuntimeError("lost the engine")
            return step()
        self.engine_core.step = counted
        super().run_busy_loop()


def test_a_loop_failing_on_the_real_core_leaves_nothing_in_the_shared_engine():
    from minivllm.course.checks.common import check_engine
    from minivllm.course.views import engine_core

    fails(checks.check_busy_loop, FailsOnTheRealCore, "Exercise 7.1", "lost the engine")
    core = engine_core(check_engine())
    core.__dict__.pop("step", None)  # the loop's counting wrapper, on the shared core
    assert not core.has_unfinished_requests()
    manager = core.scheduler.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.num_blocks


def test_a_loop_that_delegates_to_the_package_fails():
    from minivllm.engine.core_proc import EngineCoreProc

    for cls in (EngineCoreProc, type("Delegating", (EngineCoreProc,), {})):
        with pytest.raises(checks.Delegated, match="EngineCoreProc, the package's own answer"):
            checks.check_busy_loop(cls)


# -- 7.2 incremental detokenization --------------------------------------------------------------

class Detok:
    def __init__(self, tokenizer, prompt_token_ids, params, hold=True, wait_for_chars=True):
        self.tok, self.skip = tokenizer, params.skip_special_tokens
        self.stop, self.include = list(params.stop or []), params.include_stop_str_in_output
        self.tokens = list(prompt_token_ids[-5:])
        self.prefix, self.read = 0, len(self.tokens)
        self.text, self.sent = "", 0
        self.hold, self.wait_for_chars = hold, wait_for_chars

    @property
    def output_text(self):
        return self.text

    def update(self, new):
        self.tokens += new
        known = self.tok.decode(self.tokens[self.prefix:self.read], skip_special_tokens=self.skip)
        full = self.tok.decode(self.tokens[self.prefix:], skip_special_tokens=self.skip)
        if len(full) <= len(known) or (self.wait_for_chars and full.endswith("\ufffd")):
            return None
        self.prefix, self.read = self.read, len(self.tokens)
        added = full[len(known):]
        self.text += added
        hits = [(i, s) for s in self.stop
                if (i := self.text.find(s, max(0, len(self.text) - len(added) - len(s) + 1))) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i + len(s) if self.include else i]
        return s

    def get_next_output_text(self, finished, delta):
        hold = max(map(len, self.stop)) - 1 if self.hold and self.stop and not self.include else 0
        end = len(self.text) if finished else max(0, len(self.text) - hold)
        if not delta:
            return self.text[:end]
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


@pytest.mark.parametrize("kwargs, fragment", [
    ({"hold": False}, "a stop string spanning tokens"),
    ({"wait_for_chars": False}, "multi-byte characters split across tokens"),
])
def test_detokenizer_mistakes_fail_naming_the_case(kwargs, fragment):
    cls = type("Mistaken", (Detok,), {"__init__": lambda self, t, p, s: Detok.__init__(
        self, t, p, s, **kwargs)})
    fails(checks.check_detokenizer, cls, "Exercise 7.2", fragment)


def test_a_detokenizer_that_delegates_to_the_package_fails():
    from minivllm.engine.detokenizer import SlowIncrementalDetokenizer

    for cls in (SlowIncrementalDetokenizer, type("Delegating", (SlowIncrementalDetokenizer,), {})):
        with pytest.raises(checks.Delegated, match="IncrementalDetokenizer, the package's own"):
            checks.check_detokenizer(cls)


# -- 8.2 the benchmark's metrics -----------------------------------------------------------------

def metrics(traces, duration_s, slos_ms, pooled_itl=True, percentile="linear"):
    ok = [t for t in traces if t["chunk_times"] and t["output_tokens"] == t["expected_tokens"]]
    ttft = [t["chunk_times"][0] - t["start"] for t in ok]
    e2el = [t["end"] - t["start"] for t in ok]
    tpot = [(e - f) / (t["output_tokens"] - 1) if t["output_tokens"] > 1 else None
            for t, f, e in zip(ok, ttft, e2el)]
    gaps = [np.diff(t["chunk_times"]).tolist() for t in ok]
    itl = [g for gs in gaps for g in gs] if pooled_itl else [np.mean(gs) for gs in gaps if gs]

    def stats(v):
        v = np.array(v) * 1000
        if not len(v):
            return {"mean_ms": float("nan"), "median_ms": float("nan"), "p99_ms": float("nan")}
        return {"mean_ms": v.mean(), "median_ms": np.percentile(v, 50, method=percentile),
                "p99_ms": np.percentile(v, 99, method=percentile)}

    out = {"completed": len(ok), "request_throughput": len(ok) / duration_s,
           "output_throughput": sum(t["output_tokens"] for t in ok) / duration_s,
           "ttft": stats(ttft), "tpot": stats([x for x in tpot if x is not None]),
           "itl": stats(itl), "e2el": stats(e2el)}
    if slos_ms:
        good = sum(all({"ttft": f, "tpot": p or 0.0, "e2el": e}[k] <= v / 1000
                       for k, v in slos_ms.items()) for f, p, e in zip(ttft, tpot, e2el))
        out["goodput"] = {"requests": good, "request_goodput": good / duration_s}
    return out


def test_benchmark_metrics_check_passes_a_correct_function(capsys):
    checks.check_benchmark_metrics(metrics)
    assert "Exercise 8.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, fragment", [
    ({"pooled_itl": False}, "itl."),
    ({"percentile": "nearest"}, "p99_ms"),
])
def test_benchmark_metrics_mistakes_fail(kwargs, fragment):
    fails(checks.check_benchmark_metrics,
          lambda *a: metrics(*a, **kwargs), "Exercise 8.2", fragment, "interpolated linearly")


# -- 8.1 the chat stream (a real server) ---------------------------------------------------------

async def no_role_chunk(request_id, model, outputs, include_usage):
    async for out in outputs:
        c = out.outputs[0]
        body = {"id": request_id, "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [{"index": 0, "delta": {"content": c.text},
                             "finish_reason": c.finish_reason if out.finished else None}]}
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


@pytest.mark.slow
def test_chat_stream_without_the_role_chunk_fails():
    fails(checks.check_chat_stream, no_role_chunk, "Exercise 8.1", "announce the role")
