"""The from-scratch model against transformers on the same weights: logits and greedy tokens."""

import pytest
import torch

from minivllm.model.config import ModelConfig
from minivllm.model.loader import load_model
from minivllm.model.standalone import sequence_logits
from tests.hf_reference import hf_logits

# float32 on CPU: differences come only from the order of floating-point sums
LOGITS_ATOL = 2e-4


def _load(path):
    return load_model(path, ModelConfig.from_pretrained(path), torch.device("cpu"), torch.float32,
                      show_progress=False)


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_tiny_family_logits_match_transformers(tiny_models, family):
    path = tiny_models[family]
    ids = torch.randint(3, 30000, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = sequence_logits(_load(path), ids)
    ref = hf_logits(path, ids)
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


def test_family_features_are_exercised(tiny_models):
    cfgs = {name: ModelConfig.from_pretrained(p) for name, p in tiny_models.items()}
    assert cfgs["llama"].num_key_value_heads < cfgs["llama"].num_attention_heads  # GQA
    assert cfgs["llama"].rope_scaling["rope_type"] == "llama3"
    assert not cfgs["llama"].tie_word_embeddings and cfgs["llama-tied"].tie_word_embeddings
    assert cfgs["qwen2"].attention_bias and cfgs["qwen3"].qk_norm
    assert cfgs["qwen3"].head_dim * cfgs["qwen3"].num_attention_heads != cfgs["qwen3"].hidden_size


def test_bundled_model_logits_match_transformers(bundled_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_path)
    ids = tok.encode("The paged KV cache stores keys and values in fixed-size blocks, so that")
    ours = sequence_logits(_load(bundled_path), ids)
    ref = hf_logits(bundled_path, ids)
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5, 16, 23])
def test_chunked_prefill_gives_same_logits(tiny_models, chunk):
    model = _load(tiny_models["qwen3"])
    ids = list(range(100, 150))
    whole = sequence_logits(model, ids)
    chunked = sequence_logits(model, ids, chunk_size=chunk, block_size=8)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)


def test_unknown_architecture_is_rejected():
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "num_attention_heads": 2,
                               "hidden_size": 8})


def test_num_parameters_counts_what_transformers_builds(tiny_models):
    from transformers import AutoModelForCausalLM

    for name, path in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(path)
        assert ModelConfig.from_pretrained(path).num_parameters() == sum(
            p.numel() for p in model.parameters()), name  # tied weights are counted once
