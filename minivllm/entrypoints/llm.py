"""``LLM``: offline batched generation, vLLM's front door.

    from minivllm import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput, RequestOutputKind
from minivllm.sampling_params import SamplingParams


class LLM:
    """Load a model and generate for many prompts at once (continuous batching underneath).

    ``model``: None for the bundled model, a local Hugging Face folder, or a hub name.
    Any other keyword is an engine argument (see ``EngineArgs``): ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``scheduler="v0"``, ...
    """

    def __init__(self, model: str | None = None, show_progress: bool = True, **kwargs) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, show_progress=show_progress)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        prompts: a str, a list of str, or dicts {"prompt_token_ids": [...]}.
        sampling_params: one for all prompts, or one per prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts: must be a non-empty str or list of prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts"
                )
        return self._run(list(prompts), params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            self.llm_engine.processor.apply_chat_template(c, add_generation_prompt)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, params: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, sp in zip(ids, prompts, params):
                if sp is None or isinstance(sp, SamplingParams):
                    # only each request's final output is wanted: nothing is built per step
                    sp = (sp or SamplingParams()).clone()
                    sp.output_kind = RequestOutputKind.FINAL_ONLY
                engine.add_request(rid, prompt, sp)
                added.append(rid)
        except BaseException:
            # a bad prompt in the batch must not leave the others queued
            engine.abort_request(added)
            raise
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(finished) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in ids]

