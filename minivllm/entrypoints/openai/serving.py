"""/v1/completions and /v1/chat/completions on top of ``AsyncLLM``.

Each handler turns the request into prompts and ``SamplingParams`` (every mistake a 400 before
anything reaches the engine), starts one ``AsyncLLM.generate`` per prompt, then either waits
for the final outputs (one JSON body) or streams server-sent events: one chunk per new piece
of text, a last chunk with the finish reason, usage when ``stream_options.include_usage`` asks
for it (and on every chunk with vLLM's ``continuous_usage_stats``), and ``data: [DONE]``. Usage
counts, as vLLM's does, the prompt tokens served from the prefix cache
(``prompt_tokens_details.cached_tokens``). A stream asks the engine for DELTA outputs (each carries only the
new text and tokens, so a chunk costs what it carries); a full response for FINAL_ONLY (one
output, at the end).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.exceptions import EngineDeadError
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    SamplingRequest,
    error_from_value_error,
)
from minivllm.outputs import RequestOutput, RequestOutputKind


def engine_dead_error(e: EngineDeadError) -> RequestError:
    return RequestError(f"the engine is not available: {e}", status=503, type="server_error",
                        code="engine_dead")


async def chat_completion_stream_generator(
    request_id: str, model: str, outputs: AsyncIterator[RequestOutput], include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """One chat completion's server-sent events, from the engine's DELTA outputs.

    A first chunk with the role, one chunk per new piece of text (``delta.content``), the
    finish reason on the last one, then (``include_usage``) a chunk with no choices and the
    token counts, and ``data: [DONE]``. Every chunk carries the same id, ``created`` and model;
    with ``include_usage``, every chunk but the usage one says ``"usage": null``, unless
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``) puts the usage so far on each.
    """
    created = int(time.time())

    def event(choices: list, usage: dict | None = None) -> str:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    num_prompt_tokens = num_output_tokens = num_cached_tokens = 0

    def so_far() -> dict | None:
        if not continuous_usage:
            return None
        return usage_dict(num_prompt_tokens, num_output_tokens, num_cached_tokens)

    yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}], so_far())
    async for out in outputs:
        c = out.outputs[0]  # a DELTA output: only what is new
        num_prompt_tokens = len(out.prompt_token_ids)
        num_output_tokens += len(c.token_ids)
        num_cached_tokens = out.num_cached_tokens
        if not c.text and not out.finished:
            continue
        choice = {"index": 0, "delta": {"content": c.text} if c.text else {}, "logprobs": None,
                  "finish_reason": c.finish_reason if out.finished else None}
        if out.finished:
            choice["stop_reason"] = c.stop_reason
        yield event([choice], so_far())
    if include_usage:
        yield event([], usage_dict(num_prompt_tokens, num_output_tokens, num_cached_tokens))
    yield "data: [DONE]\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 chat_stream=None) -> None:
        """``chat_stream``: the function that writes a chat completion's server-sent events
        (default ``chat_completion_stream_generator``; the course plugs the learner's in)."""
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_model_len = engine.config.model_config.max_model_len
        self.chat_stream = chat_stream or chat_completion_stream_generator

    # -- turning a request into engine inputs ----------------------------------------------
    def check_model(self, request: SamplingRequest) -> str:
        if request.model is not None and request.model not in self.served_model_names:
            raise RequestError(f"The model `{request.model}` does not exist.", param="model",
                               status=404, code="model_not_found")
        return request.model or self.served_model_names[0]

    def _process(self, request_id: str, prompt, request: SamplingRequest, max_tokens: int | None,
                 max_tokens_param: str = "max_tokens"):
        params = request.to_sampling_params(max_tokens, max_tokens_param)
        try:
            core_request, text = self.engine.processor.process(request_id, prompt, params)
        except ValueError as e:
            raise error_from_value_error(e) from None
        n = len(core_request.prompt_token_ids)
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the "
                "completion). Please reduce the prompt or max_tokens.", param=max_tokens_param)
        prompt_input = {"prompt_token_ids": core_request.prompt_token_ids, "prompt": text}
        return prompt_input, core_request.sampling_params

    def completion_inputs(self, request: CompletionRequest, request_id: str) -> list:
        prompts = request.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise RequestError("prompt: must not be empty", param="prompt")
        return [
            self._process(f"{request_id}-{i}", p if isinstance(p, str) else {"prompt_token_ids": p},
                          request, request.max_tokens)
            for i, p in enumerate(prompts)
        ]

    def chat_inputs(self, request: ChatCompletionRequest, request_id: str) -> list:
        if not request.messages:
            raise RequestError("messages: must not be empty", param="messages")
        try:
            prompt = self.engine.processor.apply_chat_template(
                [m.to_template_dict() for m in request.messages])
        except ValueError as e:
            raise error_from_value_error(e) from None
        return [self._process(request_id, prompt, request, request.requested_max_tokens,
                              request.max_tokens_param)]

    def generators(self, inputs: list, request_id: str,
                   stream: bool = False) -> list[AsyncIterator[RequestOutput]]:
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        for _, params in inputs:
            params.output_kind = kind
        if len(inputs) == 1:
            return [self.engine.generate(inputs[0][0], inputs[0][1], request_id)]
        return [self.engine.generate(p, sp, f"{request_id}-{i}") for i, (p, sp) in enumerate(inputs)]

    # -- responses ---------------------------------------------------------------------------
    async def full_response(self, chat: bool, request_id: str, model: str, gens: list) -> dict:
        finals = await asyncio.gather(*[_last(g) for g in gens])
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            choice = {"index": i, "logprobs": None, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append(choice)
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": _usage(finals),
        }

    async def stream_response(self, chat: bool, request_id: str, model: str, gens: list,
                              include_usage: bool,
                              continuous_usage: bool = False) -> AsyncIterator[str]:
        """``include_usage``: a last chunk without choices carries the usage of the whole
        request; ``continuous_usage`` (vLLM's ``continuous_usage_stats``): every chunk also
        carries its choice's usage so far."""
        if chat:  # one prompt, one generator
            # the course's replacement stream functions take the four arguments only
            extra = {"continuous_usage": True} if continuous_usage else {}
            try:
                async for event in self.chat_stream(request_id, model, gens[0], include_usage,
                                                    **extra):
                    yield event
            except EngineDeadError as e:
                yield f"data: {json.dumps(engine_dead_error(e).to_dict())}\n\n"
                yield "data: [DONE]\n\n"
            return
        created = int(time.time())
        obj = "text_completion"
        num_prompt_tokens = [0] * len(gens)
        num_output_tokens = [0] * len(gens)
        num_cached_tokens = [0] * len(gens)

        def chunk(choices: list, usage: dict | None = None) -> str:
            body = {"id": request_id, "object": obj, "created": created, "model": model,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def usage_of(i: int) -> dict | None:
            if not continuous_usage:
                return None
            return usage_dict(num_prompt_tokens[i], num_output_tokens[i], num_cached_tokens[i])

        try:
            async for i, out in merge_async_iterators(gens):
                c = out.outputs[0]  # a DELTA output: only what is new
                delta = c.text
                num_prompt_tokens[i] = len(out.prompt_token_ids)
                num_output_tokens[i] += len(c.token_ids)
                num_cached_tokens[i] = out.num_cached_tokens
                if not delta and not out.finished:
                    continue
                choice = {"index": i, "logprobs": None,
                          "finish_reason": c.finish_reason if out.finished else None}
                if out.finished:
                    choice["stop_reason"] = c.stop_reason
                choice["text"] = delta
                yield chunk([choice], usage_of(i))
            if include_usage:
                yield chunk([], usage_dict(sum(num_prompt_tokens), sum(num_output_tokens),
                                           sum(num_cached_tokens)))
        except EngineDeadError as e:
            yield f"data: {json.dumps(engine_dead_error(e).to_dict())}\n\n"
        yield "data: [DONE]\n\n"


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async for out in gen:
        pass
    return out


def _usage(finals: list[RequestOutput]) -> dict:
    return usage_dict(sum(len(o.prompt_token_ids) for o in finals),
                      sum(len(o.outputs[0].token_ids) for o in finals),
                      sum(o.num_cached_tokens for o in finals))


def usage_dict(prompt: int, completion: int, cached: int) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens
    the prefix cache served (their K/V were reused, not recomputed), as vLLM reports them."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def merge_async_iterators(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    If the consumer stops (client gone), every iterator is cancelled, so every request aborts.
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def new_request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
