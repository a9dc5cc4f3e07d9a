"""Sliding-window attention (Mistral; Qwen2 with use_sliding_window): token-identical to
transformers on tiny random checkpoints whose window is much shorter than the prompts, under
chunked prefill and prefix caching; the Triton backend refuses such a model with a clear
message."""

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.model.config import ModelConfig
from minivllm.testing import make_checkpoint
from tests.hf_reference import hf_greedy

WINDOW = 6
MISTRAL = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
               tie_word_embeddings=False)
# layer 0 full attention, layer 1 sliding (max_window_layers=1): both kinds in one model
QWEN2 = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
             sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=False)
PROMPTS = [list(range(100, 130)), list(range(100, 125)) + [7, 8, 9], [5] * 3, list(range(400, 419))]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def window_model(request, tmp_path_factory, bundled_path):
    preset = MISTRAL if request.param == "mistral" else QWEN2
    folder = str(tmp_path_factory.mktemp(request.param) / "m")
    return make_checkpoint(folder, preset, tokenizer_from=bundled_path, seed=5)


def test_config_reads_which_layers_slide(window_model):
    cfg = ModelConfig.from_pretrained(window_model)
    assert cfg.sliding_window == WINDOW
    assert cfg.sliding_window_layers == ([0, 1] if cfg.family == "llama" else [1])
    # Qwen2 without use_sliding_window attends fully, whatever sliding_window says
    plain = ModelConfig.from_dict({**QWEN2, "architectures": ["Qwen2ForCausalLM"],
                                   "vocab_size": 10, "use_sliding_window": False})
    assert plain.sliding_window is None


@pytest.mark.parametrize("engine_kwargs", [
    {}, dict(max_num_batched_tokens=7, block_size=4),  # chunks cross the window's edge
])
def test_greedy_tokens_equal_transformers(window_model, engine_kwargs):
    expected = [hf_greedy(window_model, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(window_model, show_progress=False, max_model_len=128, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [e[:NEW_TOKENS] for e in expected]
    # the same prompts again: served from the prefix cache, same tokens
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == got
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0


def test_window_changes_the_result(window_model, tmp_path, bundled_path):
    """Not a vacuous check: the same weights without the window give other tokens."""
    import json
    import shutil

    full = tmp_path / "full"
    shutil.copytree(window_model, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["sliding_window"] = None
    cfg.pop("layer_types", None)
    (full / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    windowed = LLM(window_model, show_progress=False, max_model_len=128).generate(
        prompts, params, use_tqdm=False)
    unwindowed = LLM(str(full), show_progress=False, max_model_len=128).generate(
        prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in windowed] != [o.outputs[0].token_ids for o in unwindowed]


def test_triton_backend_refuses_a_sliding_window_model(window_model):
    with pytest.raises(ValueError, match="sliding-window"):
        EngineArgs(model=window_model, attention_backend="triton", device="cpu").create_config()
