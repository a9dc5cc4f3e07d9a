"""A request as the engine core tracks it: token ids in, token ids out, and how far it got.

The one number that drives everything is ``num_computed_tokens``: how many of the request's
tokens (prompt + output so far) already have K/V in the cache. A prefill is "compute tokens up
to ``num_prompt_tokens``", a decode is "compute the one token just sampled" — the v1 scheduler
does not need to know which is which (chapter 05).
"""

from __future__ import annotations

import enum

from minivllm.engine.messages import EngineCoreRequest
from minivllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # everything after this line is finished
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(self, core_request: EngineCoreRequest) -> None:
        self.request_id = core_request.request_id
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.sampling_params = core_request.sampling_params
        self.arrival_time = core_request.arrival_time
        self.cache_salt = core_request.cache_salt
        self.priority = core_request.priority  # lower: served earlier (vLLM's convention)
        params = self.sampling_params
        self.eos_token_ids = set() if params.ignore_eos else set(core_request.eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids or [])
        self.max_tokens = params.max_tokens
        self.min_tokens = params.min_tokens

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []  # hashes of its full blocks, filled in as they fill up
        self.stop_reason: int | str | None = None
        # metrics
        self.first_scheduled_time: float | None = None
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache; -1: not yet known
        self.num_preemptions = 0

    @classmethod
    def from_prompt(
        cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
        **kwargs,
    ) -> "Request":
        """Convenience for tests and notebooks: a request without going through a front end."""
        return cls(EngineCoreRequest(request_id, prompt_token_ids, params or SamplingParams(), **kwargs))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


def check_stop(request: Request, max_model_len: int) -> bool:
    """After a token was appended: should the request finish? Sets its status if so.

    A stop token wins over the length limit when both hold ("stop" is the truer reason).
    """
    num_output = len(request.output_token_ids)
    if num_output >= request.min_tokens:
        last = request.output_token_ids[-1]
        if last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if len(request.all_token_ids) >= max_model_len or (
        request.max_tokens is not None and num_output >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
