"""Bad input raises a ValueError naming the field; the engine keeps serving; no block leaks."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.testing import engine_core


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, show_progress=False, max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="x"), "seed"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, field",
    [
        ("", "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ("word " * 100, "max_model_len"),
        ({"prompt_token_ids": [1, 2, "x"]}, "prompt_token_ids"),
        ({"prompt_token_ids": [10**9]}, "prompt_token_ids"),
        (42, "prompt"),
        ({"text": "hi"}, "prompt"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_serving(llm, prompt, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["a fine prompt", prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    # nothing of the failed batch stays queued, and the next request is served
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.llm_engine.get_stats()["kv_blocks_used"] == 0


def test_min_tokens_beyond_the_room_left_without_max_tokens(llm):
    # max_tokens defaults to what max_model_len leaves after the prompt; min_tokens must fit it
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate("hello there", SamplingParams(min_tokens=1000), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.get_stats()["kv_blocks_used"] == 0


def test_bad_sampling_params_type(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate("hi", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_duplicate_request_id(llm):
    engine = llm.llm_engine
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["kv_blocks_used"] == 0


def test_bad_chat_messages(llm):
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user"}], use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(model="/no/such/folder"), "model"),
        (dict(model="not-a-hub-name/with/slashes"), "model"),
        (dict(model="NoSuchOrg/no-such-model"), "model"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs="many"), "max_num_seqs"),
        (dict(dtype="float8"), "dtype"),
        (dict(scheduler="v2"), "scheduler"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(attention_backend="cuda-magic"), "attention_backend"),
        (dict(not_an_arg=1), "not_an_arg"),
    ],
)
def test_bad_engine_args(tiny_llama, kwargs, field):
    kwargs.setdefault("model", tiny_llama)
    model = kwargs.pop("model")
    with pytest.raises(ValueError, match=field):
        LLM(model, show_progress=False, **kwargs)


def test_budget_too_small_without_chunking(tiny_llama):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(tiny_llama, show_progress=False, max_model_len=256, max_num_batched_tokens=64,
            enable_chunked_prefill=False)


def test_kv_cache_too_small_for_max_model_len(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, show_progress=False, max_model_len=256, num_kv_blocks=4, block_size=16)


def test_aborted_requests_reach_the_runner_even_when_nothing_is_scheduled(llm):
    """The core hands finished ids to the runner on a step that computes nothing, so the
    runner's persistent batch never keeps the row of a request that is gone."""
    engine = llm.llm_engine
    core = engine_core(engine)
    runner_rows = core.model_runner.input_batch.req_id_to_index
    engine.add_request("gone", "hello", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert "gone" in runner_rows
    engine.abort_request("gone")
    engine.step()  # nothing left to schedule
    assert "gone" not in runner_rows
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["kv_blocks_used"] == 0


def test_step_trace_is_bounded(tiny_llama):
    """The step trace keeps the last trace_steps steps only (0: none), whatever the uptime."""
    for keep in (0, 5):
        llm = LLM(tiny_llama, show_progress=False, max_model_len=64, trace_steps=keep)
        llm.generate("hello", SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
        trace = llm.llm_engine.get_step_trace()
        assert len(trace) == keep
        if keep:
            assert trace[-1]["step"] == llm.llm_engine.get_stats()["num_steps"]
