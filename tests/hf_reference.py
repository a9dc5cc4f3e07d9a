"""transformers as the reference: greedy generation and logits on the same checkpoint."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate for one prompt (no padding); stops at EOS like ours."""
    model = hf_model(path)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_logits(path: str, prompt_ids: list[int]) -> torch.Tensor:
    model = hf_model(path)
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids])).logits[0].float()
