"""The model's shape, read straight from a Hugging Face ``config.json``.

No transformers class is used at run time: the fields a Llama-family decoder needs are few, and
reading them here shows exactly which ones matter. Both config formats are understood: the
classic one (``rope_theta`` + ``rope_scaling``) and transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

# architecture name in config.json -> model family (the classes live in minivllm.model.llama)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    architecture: str
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    # sliding-window attention (Mistral; Qwen2/3 with use_sliding_window): a query at position p
    # sees keys p - sliding_window < k <= p, in the layers listed in sliding_window_layers
    sliding_window: int | None = None
    sliding_window_layers: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: torch.dtype = torch.float32

    @classmethod
    def from_pretrained(cls, folder: str) -> "ModelConfig":
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model: {folder!r} has no config.json; is it a Hugging Face model folder?")
        with open(path) as f:
            cfg = json.load(f)
        gen_path = os.path.join(folder, "generation_config.json")
        gen = {}
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return cls.from_dict(cfg, gen)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict | None = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model: architecture {archs or cfg.get('model_type')} is not supported; "
                f"minivllm runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]

        # rotary parameters: transformers >= 5 nests them in rope_parameters
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"model: rope scaling type {kind!r} is not supported (only 'llama3')")
            else:
                scaling["rope_type"] = "llama3"

        eos: list[int] = []
        for src in (generation_config or {}, cfg):
            e = src.get("eos_token_id")
            if e is None:
                continue
            for t in e if isinstance(e, list) else [e]:
                if t not in eos:
                    eos.append(t)

        window, window_layers = _sliding_window(cfg, family)
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=window,
            sliding_window_layers=window_layers,
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=_TORCH_DTYPES.get(str(dtype_name), torch.float32),
        )

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the checkpoint's positions cover (vLLM's "derived max_model_len").

        Rope scaling is taken into account: a scaling type that stretches the positions by
        ``factor`` multiplies the trained length, except llama3's, whose ``max_position_embeddings``
        is already the stretched length (``original_max_position_embeddings`` is the trained one).
        """
        length = self.max_position_embeddings
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "llama3") and "factor" in scaling:
            base = scaling.get("original_max_position_embeddings", length)
            length = int(base * scaling["factor"])
        return length

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if layer_idx in self.sliding_window_layers else None

    def num_parameters(self) -> int:
        """Parameters of the model this config describes (its weights' bytes = this x the dtype's
        size): embeddings, lm_head unless tied, and per layer q/k/v (with their bias), o, the
        gated MLP and the norms."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        per_layer = attention + 3 * h * self.intermediate_size + norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers (what a KV block is made of)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


def _sliding_window(cfg: dict[str, Any], family: str) -> tuple[int | None, list[int]]:
    """(window, the layers that use it), as transformers reads the config.

    ``layer_types`` ("sliding_attention" / "full_attention" per layer) wins when present.
    Otherwise Mistral slides in every layer when ``sliding_window`` is set; Qwen2/3 only with
    ``use_sliding_window``, and then in the layers from ``max_window_layers`` on.
    """
    window = cfg.get("sliding_window")
    num_layers = cfg["num_hidden_layers"]
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return None, []
    if cfg.get("layer_types"):
        layers = [i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"]
    elif family in ("qwen2", "qwen3"):
        layers = list(range(cfg.get("max_window_layers", 0), num_layers))
    else:
        layers = list(range(num_layers))
    return (int(window), layers) if layers else (None, [])
