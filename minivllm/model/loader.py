"""Load a checkpoint's safetensors into the from-scratch model, by name.

The model is built on the ``meta`` device (no memory, no random init), cast to the serving
dtype there, materialised empty on the target device, then every parameter is filled from the
checkpoint. Nothing is left
uninitialised silently: a missing tensor is an error.

With tensor parallelism each parameter belongs to a layer that knows its rank's slice
(``weight_loader`` in ``parallel_layers.py``): the loader hands it a lazy safetensors slice
(``safe_open(...).get_slice``), so each rank reads from the file only the rows or columns it
keeps. A replicated parameter (a norm) is read whole.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from minivllm.model.config import ModelConfig
from minivllm.model.llama import LlamaForCausalLM
from minivllm.progress import progress_bar

_MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}


def _checkpoint_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {folder!r}")
    return files


def load_model(
    folder: str,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    show_progress: bool = True,
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = _MODEL_CLASSES[config.family](config)
    # cast while the parameters are still meta (free), then materialise in the serving dtype:
    # never a float32 copy of the model on the device (4 bytes a parameter, then 2 more)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty() unties shared parameters: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, folder, show_progress=show_progress)
    return model.eval()


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, folder: str, show_progress: bool = True) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    files = _checkpoint_files(folder)
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    bar = progress_bar("Loading weights", total=total, unit="tensors", disable=not show_progress)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                bar.update(1)
                if "rotary_emb.inv_freq" in name:
                    continue  # a cache some checkpoints carry; we recompute it
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                target, shard = _target(model, name)
                if target not in params:
                    raise ValueError(f"model: checkpoint tensor {name!r} has no place in the model")
                param = params[target]
                module = model.get_submodule(target.rsplit(".", 1)[0])
                loader = getattr(module, "weight_loader", None)
                if loader is None:
                    tensor = f.get_tensor(name)
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"model: {name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                else:
                    try:
                        loader(param, f.get_slice(name), shard)
                    except ValueError as e:
                        raise ValueError(f"{e} (loading {name})") from None
                loaded.add(target if shard is None else f"{target}#{shard}")
    bar.close()
    missing = []
    for name, param in model.named_parameters():
        packed = name.split(".")[-2]
        if packed in ("qkv_proj", "gate_up_proj"):
            n = len(model.shard_sizes(packed))
            missing += [f"{name}#{s}" for s in range(n) if f"{name}#{s}" not in loaded]
        elif name not in loaded and not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            missing.append(name)
    if missing:
        raise ValueError(f"model: the checkpoint in {folder!r} lacks {missing[:5]} ...")


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, int | None]:
    """Checkpoint name -> (parameter name in our model, shard index inside a packed one)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.packed_modules:
            packed, shard = model.packed_modules[part]
            return ".".join(parts[:i] + [packed] + parts[i + 1 :]), shard
    return name, None
