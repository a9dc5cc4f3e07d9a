"""vLLM's RequestOutputKind: cumulative, delta and final-only outputs carry the same result."""

import asyncio

import pytest

from minivllm import SamplingParams
from minivllm.engine.async_llm import RequestOutputCollector
from minivllm.engine.llm_engine import LLMEngine
from minivllm.config import EngineArgs
from minivllm.outputs import CompletionOutput, RequestOutput, RequestOutputKind

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_llama), show_progress=False)


def _run(engine, kind, **params):
    outputs: dict[str, list[RequestOutput]] = {}
    for i, prompt in enumerate(PROMPTS):
        sp = SamplingParams(temperature=0, max_tokens=12, output_kind=kind, **params)
        engine.add_request(f"{kind.name}-{i}", prompt, sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return [outputs[f"{kind.name}-{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("stop", [None, [" the", "e"]])
def test_delta_and_final_only_carry_what_cumulative_does(engine, stop):
    cumulative = _run(engine, RequestOutputKind.CUMULATIVE, stop=stop)
    delta = _run(engine, RequestOutputKind.DELTA, stop=stop)
    final = _run(engine, RequestOutputKind.FINAL_ONLY, stop=stop)
    for c, d, f in zip(cumulative, delta, final):
        last = c[-1].outputs[0]
        assert last.finish_reason is not None and c[-1].finished
        # cumulative: each output extends the previous one
        for a, b in zip(c, c[1:]):
            assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        # delta: the pieces add up to the cumulative result, none of them repeats an earlier one
        assert "".join(o.outputs[0].text for o in d) == last.text
        assert sum((o.outputs[0].token_ids for o in d), []) == last.token_ids
        assert [o.finished for o in d] == [False] * (len(d) - 1) + [True]
        # final only: one output, the whole result
        assert len(f) == 1 and f[0].finished
        assert f[0].outputs[0].text == last.text and f[0].outputs[0].token_ids == last.token_ids
        assert f[0].outputs[0].finish_reason == last.finish_reason


def test_collector_merges_deltas_a_slow_consumer_missed():
    def out(text, ids, finished=False):
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, ids,
                                                                  finish_reason="length" if finished else None)],
                             finished)

    async def main():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        collector.put(out("Hel", [5]))
        collector.put(out("lo", [6]))
        collector.put(out(" you", [7], finished=True))
        merged = await collector.get()
        assert merged.outputs[0].text == "Hello you" and merged.outputs[0].token_ids == [5, 6, 7]
        assert merged.finished and merged.outputs[0].finish_reason == "length"
        cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        cumulative.put(out("Hel", [5]))
        cumulative.put(out("Hello", [5, 6]))
        assert (await cumulative.get()).outputs[0].text == "Hello"  # the newest replaces

    asyncio.run(main())


def test_output_kind_is_validated():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
