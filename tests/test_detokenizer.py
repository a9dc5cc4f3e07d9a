"""The front end's incremental detokenizers: the Rust stream and the classic offsets agree, a
stop string cuts the text, and a stream never shows text that a stop string then takes back."""

import random

import pytest

from minivllm.engine.messages import EngineCoreOutput
from minivllm.engine.detokenizer import (
    FastIncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    default_detokenizer_cls,
)
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.processor import load_tokenizer
from minivllm.model_hub import bundled_model_path
from minivllm.outputs import RequestOutputKind
from minivllm.sampling_params import SamplingParams

TEXT = ("Héllo wörld! 日本語のテキスト, emoji 🤖🚀 and code: def f(x): return x**2\n\tDone. "
        "Ünïcödé STOP here, then more text END.")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_model_path())


def test_the_bundled_tokenizer_gets_the_rust_stream(tokenizer):
    assert default_detokenizer_cls(tokenizer) is FastIncrementalDetokenizer


@pytest.mark.parametrize("seed", range(4))
def test_fast_and_slow_give_the_same_text_one_token_at_a_time(tokenizer, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT)
    prompt = [rng.randrange(len(tokenizer)) for _ in range(6)]
    texts = []
    for cls in (SlowIncrementalDetokenizer, FastIncrementalDetokenizer):
        d = cls(tokenizer, prompt, SamplingParams())
        for t in ids:
            d.update([t])
        texts.append(d.output_text)
    assert texts[0] == texts[1] == tokenizer.decode(ids)


def _stream(tokenizer, ids, params, cls, step=1):
    op = OutputProcessor(tokenizer, cls)
    op.add_request("r", None, [1, 2, 3], params, 0.0)
    deltas, aborted = [], []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        out = EngineCoreOutput("r", ids[i:i + step], finish_reason="length" if last else None)
        request_outputs, to_abort = op.process_outputs([out])
        aborted += to_abort
        deltas += [o.outputs[0] for o in request_outputs]
        if not op.has_unfinished_requests():
            break
    return deltas, aborted


@pytest.mark.parametrize("cls", [SlowIncrementalDetokenizer, FastIncrementalDetokenizer])
@pytest.mark.parametrize("include", [False, True])
def test_a_delta_stream_never_shows_the_start_of_a_stop_string(tokenizer, cls, include):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(stop=["STOP", "日本語のテ"], include_stop_str_in_output=include,
                            output_kind=RequestOutputKind.DELTA)
    deltas, aborted = _stream(tokenizer, ids, params, cls)
    text = "".join(d.text for d in deltas)
    expected = TEXT[: TEXT.index("日本語のテ") + (len("日本語のテ") if include else 0)]
    assert text == expected
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "日本語のテ"
    assert aborted == ["r"]
    # while running, a delta never ends inside what could still become a stop string
    shown = ""
    for d in deltas[:-1]:
        shown += d.text
        assert expected.startswith(shown)
        if not include:
            assert "日" not in shown


def test_cumulative_and_final_outputs_hold_back_until_the_end(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    params = SamplingParams(stop=["zeta!"], output_kind=RequestOutputKind.CUMULATIVE)
    deltas, _ = _stream(tokenizer, ids, params, FastIncrementalDetokenizer)
    for n, d in enumerate(deltas[:-1], 1):  # everything but the last len("zeta!") - 1 characters
        assert d.text == tokenizer.decode(ids[:n])[:-4]
    assert deltas[-1].text == "alpha beta gamma delta" and deltas[-1].finish_reason == "length"
