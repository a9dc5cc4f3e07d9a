"""The front end's half of a request: detokenization, stop strings, metrics, output kinds.

The engine core only sees token ids. Turning them back into text, one step at a time, and
cutting the text at a stop string happen here (``detokenizer.py``); when a stop string
appears the request is finished with reason "stop" and the core is told to abort it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.engine.messages import EngineCoreOutput
from minivllm.engine.detokenizer import (  # noqa: F401  (find_stop_string: re-exported)
    IncrementalDetokenizer,
    default_detokenizer_cls,
    find_stop_string,
)
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from minivllm.sampling_params import SamplingParams


@dataclass
class RequestState:
    """The front end's view of one request. Its text lives in the detokenizer (in pieces,
    joined only when an output needs all of it), so a step costs O(new tokens)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs: tokens the previous output already carried

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def to_output(self) -> RequestOutput:
        delta = self.params.output_kind is RequestOutputKind.DELTA
        finished = self.finish_reason is not None
        text = ""
        if self.detokenizer is not None:
            text = self.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = self.output_token_ids[self.num_sent_tokens:]
            self.num_sent_tokens = len(self.output_token_ids)
        else:
            token_ids = list(self.output_token_ids)
        # positional arguments: this runs once per request per step (the fields' order is
        # CompletionOutput's and RequestOutput's, in outputs.py)
        completion = CompletionOutput(0, text, token_ids, None, None, self.finish_reason,
                                      self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             finished, self.metrics, self.metrics.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer, detokenizer_cls: type | None = None) -> None:
        """``detokenizer_cls``: what turns a request's tokens into text (default: the fastest
        the tokenizer allows, see ``detokenizer.default_detokenizer_cls``)."""
        self.tokenizer = tokenizer
        self.detokenizer_cls = detokenizer_cls or (
            default_detokenizer_cls(tokenizer) if tokenizer is not None else None)
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = self.detokenizer_cls(self.tokenizer, prompt_token_ids, params)
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detok, RequestMetrics(arrival_time)
        )

    def abort_requests(self, request_ids: list[str]) -> list[RequestState]:
        return [s for rid in request_ids if (s := self.requests.pop(rid, None)) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply the core's new tokens. Returns (outputs to hand out, requests the core must abort)."""
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue  # aborted by the user meanwhile
            self._update_metrics(state, out)
            state.output_token_ids.extend(out.new_token_ids)
            if out.finished:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.detokenizer is not None:
                stop = state.detokenizer.update(out.new_token_ids)
                if stop is not None:
                    state.finish_reason, state.stop_reason = "stop", stop
                    if not out.finished:
                        to_abort.append(out.request_id)
            finished = state.finish_reason is not None
            if finished:
                state.metrics.finished_time = out.timestamp
                del self.requests[out.request_id]
            if finished or state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                request_outputs.append(state.to_output())
        return request_outputs, to_abort

    @staticmethod
    def _update_metrics(state: RequestState, out: EngineCoreOutput) -> None:
        m = state.metrics
        if out.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = out.first_scheduled_time
        m.num_cached_tokens = out.num_cached_tokens
        m.num_preemptions = out.num_preemptions
        n = len(out.new_token_ids)
        if n:
            if m.first_token_time is None:
                m.first_token_time = out.timestamp
            m.last_token_time = out.timestamp
            if n == 1:
                m.token_times.append(out.timestamp)
            else:
                m.token_times.extend([out.timestamp] * n)
