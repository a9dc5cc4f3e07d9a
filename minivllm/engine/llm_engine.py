"""LLMEngine: the synchronous front end with vLLM's step API.

    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.request_id, out.outputs[0].text)

It owns the tokenizer (text in, text out) and talks to the engine core through a client, so
the core may live in this process or in another one.
"""

from __future__ import annotations

from minivllm.config import EngineArgs, EngineConfig
from minivllm.engine.core_client import make_client
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.processor import Processor, PromptType, load_tokenizer
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(mc.tokenizer_path)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, config.detokenizer_cls)
        self.engine_core = make_client(config, show_progress=show_progress)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, show_progress: bool = True) -> "LLMEngine":
        return cls(args.create_config(), show_progress=show_progress)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        core_request, text = self.processor.process(request_id, prompt, params, arrival_time, cache_salt)
        self.output_processor.add_request(
            request_id, text, core_request.prompt_token_ids, core_request.sampling_params,
            core_request.arrival_time,
        )
        self.engine_core.add_request(core_request)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that advanced."""
        outputs = self.engine_core.get_output()
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return request_outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_stats(self) -> dict:
        """KV blocks, prefix-cache hits, preemptions, steps, queue lengths."""
        return self.engine_core.call_utility("get_stats")

    def get_step_trace(self) -> list[dict]:
        """Per step: which requests got how many tokens (prefill chunk or decode), budget, time."""
        return self.engine_core.call_utility("get_step_trace")

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.call_utility("reset_prefix_cache")

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        self.engine_core.shutdown()
