"""AsyncLLM over both clients (core on a thread here, core in its own process), the
multi-process LLM, and what happens when the core dies or the front end is stopped."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.exceptions import EngineDeadError
from minivllm.testing import engine_core

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.slow

PROMPTS = ["Hello there", "The capital of France is", "def f(x):", "One two three four five six"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module", params=[False, True], ids=["inprocess", "multiprocess"])
def engine(request, tiny_llama, loop):
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=tiny_llama, max_model_len=512, multiprocess=request.param),
        show_progress=False)
    yield engine
    engine.shutdown()
    if request.param:
        assert not engine.engine_core.proc.is_alive()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama, show_progress=False, max_model_len=512)


async def _collect(engine, prompt, params, rid):
    return [out async for out in engine.generate(prompt, params, rid)]


async def _wait_until_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


def test_concurrent_streams_equal_offline(engine, offline, loop):
    refs = offline.generate(PROMPTS, GREEDY, use_tqdm=False)

    async def run():
        return await asyncio.gather(*[_collect(engine, p, GREEDY, f"s{i}")
                                      for i, p in enumerate(PROMPTS)])

    for outs, ref in zip(loop.run_until_complete(run()), refs):
        assert len(outs) > 1 and [o.finished for o in outs][-1] and not outs[0].finished
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, growing
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].text == ref.outputs[0].text


def test_leaving_early_or_cancelling_aborts_and_frees_kv_blocks(engine, loop):
    async def run():
        before = (await engine.get_stats())["num_steps"]
        async for out in engine.generate("Once upon a time", LONG, "leave"):
            if len(out.outputs[0].token_ids) >= 3:
                break  # closes the generator: the request is aborted

        async def consume():
            async for _ in engine.generate("A long story", LONG, "cancel"):
                pass

        task = asyncio.ensure_future(consume())
        while (await engine.get_stats())["num_running"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await _wait_until_idle(engine)
        assert stats["num_steps"] - before < 2 * LONG.max_tokens  # both stopped early
        assert not engine.output_processor.requests and not engine.collectors

    loop.run_until_complete(run())


def test_abort_from_outside_ends_the_stream(engine, loop):
    async def run():
        gen = engine.generate("Once upon a time", LONG, "ext")
        first = await gen.__anext__()
        assert not first.finished
        await engine.abort("ext")
        rest = [out async for out in gen]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        await _wait_until_idle(engine)

    loop.run_until_complete(run())


def test_stop_string_finishes_and_frees(engine, offline, loop):
    full = offline.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full.strip().split()[0]

    async def run():
        outs = await _collect(engine, PROMPTS[1], SamplingParams(temperature=0, max_tokens=12,
                                                                 stop=[stop]), "stop")
        await _wait_until_idle(engine)
        return outs[-1].outputs[0]

    out = loop.run_until_complete(run())
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_bad_input_and_duplicate_id_raise_value_error(engine, loop):
    async def run():
        with pytest.raises(ValueError, match="prompt"):
            await _collect(engine, "", GREEDY, "bad")
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, {"prompt_token_ids": [5] * 600}, GREEDY, "long")
        gen = engine.generate("Hi", LONG, "dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, "Hi", GREEDY, "dup")
        await gen.aclose()
        outs = await _collect(engine, "Hi", GREEDY, "after")
        assert outs[-1].finished
        await _wait_until_idle(engine)

    loop.run_until_complete(run())


def test_utility_calls(engine, loop):
    async def run():
        await _collect(engine, "The quick brown fox jumps over the lazy dog " * 4, GREEDY, "u")
        trace = await engine.get_step_trace()
        assert trace and {"step", "num_scheduled_tokens", "scheduled"} <= set(trace[-1])
        assert (await engine.get_stats())["kv_blocks_cached"] > 0
        assert await engine.reset_prefix_cache() is True
        assert (await engine.get_stats())["kv_blocks_cached"] == 0
        with pytest.raises(RuntimeError, match="no utility method"):
            await engine.engine_core.call_utility_async("_private")
        assert engine.scheduler_stats is not None  # the stats that ride along with outputs

    loop.run_until_complete(run())


def test_core_process_death_fails_requests_fast(tiny_llama):
    async def run():
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=tiny_llama, max_model_len=512, multiprocess=True), show_progress=False)
        try:
            gens = [asyncio.ensure_future(_collect(engine, p, LONG, f"d{i}"))
                    for i, p in enumerate(PROMPTS)]
            while (await engine.get_stats())["num_running"] < len(PROMPTS):
                await asyncio.sleep(0.01)
            os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*gens, return_exceptions=True), 10)
            assert time.monotonic() - killed < 1.5  # noticed within a second (+ scheduling)
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert "exit code -9" in str(results[0])
            assert engine.errored
            with pytest.raises(EngineDeadError):
                await _collect(engine, "Hi", GREEDY, "late")
            with pytest.raises(EngineDeadError):
                await engine.get_stats()
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_core_loop_error_fails_requests_inprocess(tiny_llama):
    async def run():
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, max_model_len=512),
                                           show_progress=False)
        core = engine_core(engine)
        step = core.step

        def failing_step():
            if core.num_steps >= 3:
                raise RuntimeError("injected failure")
            return step()

        core.step = failing_step
        try:
            with pytest.raises(EngineDeadError, match="injected failure"):
                await asyncio.wait_for(_collect(engine, "Hi", LONG, "x"), 10)
            assert engine.errored
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_output_handler_failure_fails_requests_instead_of_hanging(tiny_llama):
    async def run():
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, max_model_len=512),
                                           show_progress=False)

        def broken(outputs):
            raise KeyError("bug")

        engine.output_processor.process_outputs = broken
        try:
            with pytest.raises(EngineDeadError, match="output handler failed"):
                await asyncio.wait_for(_collect(engine, "Hi", GREEDY, "x"), 10)
            assert engine.errored
            with pytest.raises(EngineDeadError):
                await engine.check_health()
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_multiprocess_llm_equals_inprocess(tiny_llama, offline):
    llm = LLM(tiny_llama, show_progress=False, max_model_len=512, multiprocess=True)
    try:
        outs = llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False)
        refs = offline.generate(PROMPTS * 3, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
        stats = llm.llm_engine.get_stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_steps"] > 0
        assert llm.llm_engine.get_step_trace()
        proc = llm.llm_engine.engine_core.proc
    finally:
        llm.llm_engine.shutdown()
    assert not proc.is_alive()


def test_bad_engine_argument_in_core_process_is_a_value_error(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, show_progress=False, max_model_len=512, num_kv_blocks=2, multiprocess=True)


_SCRIPT = """
import signal, sys, time
from minivllm import LLM
if __name__ == "__main__":
    # as when started from a terminal: a test runner's workers may have SIGINT ignored, which
    # their children would inherit (Python then never raises KeyboardInterrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(sys.argv[1], show_progress=False, max_model_len=512, multiprocess=True)
    print(llm.llm_engine.engine_core.proc.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_stopping_the_front_end_leaves_no_orphan(tiny_llama, tmp_path, sig):
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script), tiny_llama], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        core_pid = int(proc.stdout.readline())
        proc.send_signal(sig)
        # a few seconds on an idle machine; the margin is for a CI box under heavy load
        proc.wait(timeout=90)
        core = psutil.Process(core_pid) if psutil.pid_exists(core_pid) else None
        if core is not None:
            core.wait(timeout=10)  # raises TimeoutExpired if the core outlives its front end
    finally:
        if proc.poll() is None:
            proc.kill()


def test_offline_llm_needs_no_server_packages(tiny_llama):
    code = textwrap.dedent(f"""
        import sys
        for name in ("zmq", "msgspec", "fastapi", "uvicorn", "starlette", "pydantic",
                     "prometheus_client", "httpx"):
            sys.modules[name] = None  # importing any of them now fails
        from minivllm import LLM, SamplingParams
        from minivllm.entrypoints.cli import build_parser
        build_parser()
        llm = LLM({tiny_llama!r}, show_progress=False, max_model_len=512)
        print(len(llm.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def test_serve_without_server_packages_says_what_to_install():
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from minivllm.entrypoints.cli import main\n"
            "sys.exit(main(['serve']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "pip install 'minivllm[serve]'" in out.stderr and "Traceback" not in out.stderr
