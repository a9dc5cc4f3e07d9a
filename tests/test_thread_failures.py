"""A failure in any thread that moves requests or outputs is a clean EngineDeadError for every
request in flight (and for /health) within a second, never a hang. One failure is injected into
each thread in turn: the front end's output thread, the core process's input thread, its
output thread."""

import asyncio
import time

import pytest

from minivllm import EngineArgs, SamplingParams
from minivllm.core.scheduler import Scheduler
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.exceptions import EngineDeadError

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytestmark = pytest.mark.slow

LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
PROMPTS = ["Hello there", "The capital of France is", "def f(x):"]


class UnencodableStatsScheduler(Scheduler):
    """Reports a statistic msgpack cannot encode once a request named "poison" arrives (the
    core process's output thread then fails to encode the step's outputs)."""

    def get_stats(self) -> dict:
        stats = super().get_stats()
        if "poison" in self.requests:
            stats["oops"] = object()
        return stats


async def _collect(engine, prompt, params, rid):
    return [out async for out in engine.generate(prompt, params, rid)]


async def _all_fail_within_a_second(engine, inject, match: str) -> None:
    gens = [asyncio.ensure_future(_collect(engine, p, LONG, f"r{i}")) for i, p in enumerate(PROMPTS)]
    while (await engine.get_stats())["num_running"] < len(PROMPTS):
        await asyncio.sleep(0.01)
    inject()
    injected = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*gens, return_exceptions=True), 10)
    assert time.monotonic() - injected < 1.0
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert match in str(results[0]), results[0]
    with pytest.raises(EngineDeadError):  # what /health asks: it answers 503 from now on
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await _collect(engine, "Hi", LONG, "late")


def _run(tiny_llama, inject, match: str, **engine_kwargs) -> None:
    async def run():
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=tiny_llama, max_model_len=2048, multiprocess=True, **engine_kwargs),
            show_progress=False)
        try:
            await _all_fail_within_a_second(engine, lambda: inject(engine), match)
        finally:
            engine.shutdown()
        assert not engine.engine_core.proc.is_alive()

    asyncio.run(run())


def test_front_end_output_thread_failure(tiny_llama, monkeypatch):
    from minivllm.engine import serial

    def inject(engine):
        def broken(data):
            raise ValueError("injected: undecodable output")

        monkeypatch.setattr(serial, "decode_outputs", broken)

    _run(tiny_llama, inject, "front end's output thread failed")


def test_core_input_thread_failure(tiny_llama):
    from minivllm.engine.messages import EngineCoreRequestType

    def inject(engine):  # a message the core's input thread cannot decode
        engine.engine_core.input_socket.send_multipart(
            [EngineCoreRequestType.ADD.value, b"\xc1 not msgpack"])

    _run(tiny_llama, inject, "input thread failed")


def test_core_output_thread_failure(tiny_llama):
    def inject(engine):
        asyncio.ensure_future(_collect(engine, "x", LONG, "poison"))

    _run(tiny_llama, inject, "output thread failed", scheduler_cls=UnencodableStatsScheduler)
