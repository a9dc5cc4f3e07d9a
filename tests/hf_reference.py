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


def hf_greedy_agrees(path: str, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
    """Teacher forcing: transformers' argmax at every position of prompt + output, in one forward.

    Returns the positions (indices into ``output_ids``) where transformers would have picked
    another token. Empty means transformers' greedy decoding produces ``output_ids`` itself (by
    induction over the steps: each token is the argmax given the ones before it), at the cost of
    one forward pass instead of one per generated token.
    """
    model = hf_model(path)
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0]
    n = len(prompt_ids)
    picks = logits[n - 1:n - 1 + len(output_ids)].argmax(-1).tolist()
    return [i for i, (a, b) in enumerate(zip(picks, output_ids)) if a != b]


def hf_logits(path: str, prompt_ids: list[int]) -> torch.Tensor:
    model = hf_model(path)
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids])).logits[0].float()
