"""Input processing: validate a prompt and its parameters, tokenize, build an EngineCoreRequest.

Everything that can be wrong with a request is caught here, in the front end, with a
``ValueError`` that names the field — before the request reaches the scheduler, so a bad
request costs no KV block and cannot disturb the others.
"""

from __future__ import annotations

import time

from minivllm.config import EngineConfig
from minivllm.engine.messages import EngineCoreRequest
from minivllm.sampling_params import SamplingParams, is_utf8

PromptType = str | dict


# tokenizer classes that are the generic fast tokenizer over tokenizer.json: loaded directly,
# AutoTokenizer would only pick the same class after importing transformers' model-config
# machinery (seconds of start-up in every process that loads a tokenizer)
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str):
    """The model folder's tokenizer, as ``AutoTokenizer.from_pretrained(path)`` loads it."""
    import json
    import os

    import transformers

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    cls = getattr(transformers, name, None) if name in _GENERIC_TOKENIZER_CLASSES else None
    if cls is not None and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return cls.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


class Processor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.model_config.hf_config.vocab_size
        eos = list(config.model_config.hf_config.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if tok_eos is not None and tok_eos not in eos:
            eos.append(tok_eos)
        self.eos_token_ids = eos

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) from a str or a dict prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer; pass {'prompt_token_ids': [...]}")
            if not is_utf8(prompt):
                raise ValueError("prompt: is not valid unicode (it holds a lone surrogate)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise ValueError("prompt_token_ids: must be a list of ints")
                text = prompt.get("prompt")
                return (text if isinstance(text, str) else None), list(ids)
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
        raise ValueError(
            "prompt: must be a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
            f"got {type(prompt).__name__}"
        )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        if not isinstance(request_id, str) or not request_id or not is_utf8(request_id):
            raise ValueError(f"request_id: must be a non-empty str, got {request_id!r}")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt
                                       or not is_utf8(cache_salt)):
            raise ValueError(f"cache_salt: must be a non-empty str, got {cache_salt!r}")
        text, ids = self.tokenize_prompt(prompt)
        self.validate_prompt_ids(ids)
        params = params.clone()
        if params.top_k >= self.vocab_size:  # keeps every token: the same as no top-k at all
            params.top_k = 0
        if params.max_tokens is None:
            params.max_tokens = self.config.model_config.max_model_len - len(ids) or 1
            if params.min_tokens > params.max_tokens:
                raise ValueError(
                    f"min_tokens ({params.min_tokens}) must not exceed the {params.max_tokens} "
                    f"tokens left after the {len(ids)}-token prompt within max_model_len "
                    f"({self.config.model_config.max_model_len})")
        core_request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            cache_salt=cache_salt,
        )
        return core_request, text

    def validate_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt: must not be empty (it has no tokens)")
        if len(ids) > self.config.model_config.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens is longer than max_model_len "
                f"({self.config.model_config.max_model_len})"
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> dict:
        """A conversation -> {'prompt': text, 'prompt_token_ids': ids} via the model's template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        if not isinstance(conversation, list) or not conversation or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in conversation
        ):
            raise ValueError(
                "messages: must be a non-empty list of {'role': str, 'content': str} dicts"
            )
        if not all(is_utf8(m["content"]) and is_utf8(m["role"]) for m in conversation):
            raise ValueError("messages: content is not valid unicode (it holds a lone surrogate)")
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}
