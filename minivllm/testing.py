"""Random-weight checkpoints of real architectures, written with transformers.

Tests, notebooks and the GPU check script need models that load in a blink (tiny shapes) or
that have a real model's shapes without its download (throughput does not depend on the
weights' values). Both are built here with transformers' own classes and saved as ordinary
Hugging Face folders, so transformers stays an independent reference for correctness.
"""

from __future__ import annotations

import glob
import os
import shutil

# tiny shapes per family: each covers what makes the family different
TINY_PRESETS: dict[str, dict] = {
    # GQA (4 query heads over 2 KV heads), untied lm_head, llama3 rope scaling
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    ),
    # multi-head attention (no GQA) with tied embeddings
    "llama-tied": dict(
        model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
    ),
    # q/k/v bias, GQA, untied
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # per-head q/k RMSNorm, head_dim (32) != hidden / heads (16), tied
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}

# shapes for tensor parallelism at size 3 (the presets above have 4 heads): 6 query heads over one
# KV head (multi-query), so each rank keeps a replica of the KV head
TP_PRESETS: dict[str, dict] = {
    "llama-mqa6": dict(
        model_type="llama", hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=False,
    ),
}

# real shapes, random weights (for speed measurements)
REAL_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        tie_word_embeddings=True, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}

_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "chat_template*", "vocab.json",
                    "merges.txt")


def copy_tokenizer(src_folder: str, dst_folder: str) -> None:
    for pattern in _TOKENIZER_FILES:
        for path in glob.glob(os.path.join(src_folder, pattern)):
            shutil.copy(path, dst_folder)


def make_checkpoint(
    folder: str,
    preset: str | dict,
    tokenizer_from: str | None = None,
    seed: int = 0,
    dtype: str = "float32",
    **overrides,
) -> str:
    """Write a random-weight checkpoint (config.json + model.safetensors) into ``folder``.

    ``preset``: a key of TINY_PRESETS, TP_PRESETS or REAL_SHAPES, or a dict of config fields.
    ``tokenizer_from``: a model folder whose tokenizer files are copied alongside.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY_PRESETS.get(preset) or TP_PRESETS.get(preset) or REAL_SHAPES.get(preset)
                  or {}) if isinstance(
        preset, str) else dict(preset)
    if not fields:
        raise ValueError(f"unknown preset {preset!r}")
    fields = {
        "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.05, **fields, **overrides,
    }
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer_from:
        copy_tokenizer(tokenizer_from, folder)
    return folder


# -- reaching inside an in-process engine (tests, benchmarks and course checks look at its parts)

def engine_core(llm):
    """The ``EngineCore`` behind an ``LLM``, ``LLMEngine`` or ``AsyncLLM`` whose core runs in
    this process (its client holds it as ``engine_core``)."""
    client = getattr(llm, "llm_engine", llm).engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise ValueError(f"the engine core runs in another process ({type(client).__name__}): "
                         "its parts are not reachable from here")
    return core


def model_runner(llm):
    """The model runner of an in-process engine (``engine_core(llm).model_runner``)."""
    return engine_core(llm).model_runner
