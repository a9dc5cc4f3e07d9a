"""max_model_len: derived from the model's config, checked against it (rope scaling counted),
longer only when the user insists (MINIVLLM_ALLOW_LONG_MAX_MODEL_LEN=1), and then it runs."""

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.config import ALLOW_LONG_MAX_MODEL_LEN_ENV
from minivllm.model.config import ModelConfig
from minivllm.testing import make_checkpoint


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, bundled_path) -> str:
    """A tiny llama trained (so to speak) for 32 positions."""
    folder = str(tmp_path_factory.mktemp("short") / "m")
    return make_checkpoint(folder, "llama-tied", tokenizer_from=bundled_path, seed=3,
                           max_position_embeddings=32)


def test_default_is_derived_from_the_config(short_model, monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    assert EngineArgs(model=short_model).create_config().model_config.max_model_len == 32
    config = EngineArgs(model=short_model, max_model_len=20).create_config()
    assert config.model_config.max_model_len == 20


def test_longer_than_the_model_is_refused_unless_allowed(short_model, monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    with pytest.raises(ValueError, match=rf"max_model_len \(33\).*{ALLOW_LONG_MAX_MODEL_LEN_ENV}=1"):
        EngineArgs(model=short_model, max_model_len=33).create_config()
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    with pytest.warns(UserWarning, match="may be wrong"):
        cfg = EngineArgs(model=short_model, max_model_len=80).create_config()
    assert cfg.model_config.max_model_len == 80
    # the rotary table reaches every position the engine may now use
    assert cfg.model_config.hf_config.max_position_embeddings == 80


def test_allowed_long_context_runs_past_the_trained_positions(short_model, monkeypatch):
    """Before the check, position 32 indexed past the rotary table: IndexError, engine dead."""
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    with pytest.warns(UserWarning):
        llm = LLM(short_model, show_progress=False, max_model_len=64, max_num_batched_tokens=64)
    out = llm.generate({"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert llm.llm_engine.get_stats()["kv_blocks_used"] == 0


def test_rope_scaling_is_counted():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8,
                intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=4096)
    assert ModelConfig.from_dict(base).derived_max_model_len == 4096
    # llama3's max_position_embeddings is already the stretched length (Llama 3.1: 131072 over
    # an original 8192): not multiplied again
    llama3 = {**base, "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}
    assert ModelConfig.from_dict(llama3).derived_max_model_len == 131072
    # a scaling that stretches the trained length by its factor (counted, as vLLM does)
    cfg = ModelConfig.from_dict(base)
    cfg.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    assert cfg.derived_max_model_len == 8192


def test_a_prompt_of_exactly_max_model_len_tokens_gets_one_token(short_model):
    """A context that fills max_model_len still samples the token after it (nothing is fed
    back: the request then ends with "length"), and the engine keeps serving."""
    llm = LLM(short_model, show_progress=False, max_model_len=24, max_num_batched_tokens=24)
    full = {"prompt_token_ids": list(range(100, 124))}
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0, max_tokens=5)):
        out = llm.generate([full], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "length"
    # beside a request that keeps decoding, in the same steps
    both = llm.generate([full, {"prompt_token_ids": [100, 101]}],
                        SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in both] == [1, 6]
    with pytest.raises(ValueError, match="longer than max_model_len"):
        llm.generate([{"prompt_token_ids": list(range(100, 125))}], use_tqdm=False)
    assert llm.llm_engine.get_stats()["kv_blocks_used"] == 0
