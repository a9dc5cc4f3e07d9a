"""What crosses from the scheduler to the model runner and back, once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` starting at ``num_computed_tokens``."""

    request_id: str
    token_ids: list[int]  # the tokens whose K/V this step computes
    num_computed_tokens: int  # tokens already in the cache = position of token_ids[0]
    block_ids: list[int]  # the request's whole block table after allocation
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    sampling_params: SamplingParams

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.sample


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # requests that ended since the previous step: the runner drops their per-request state
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    token_budget: int = 0

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]  # empty list: a prefill chunk that sampled nothing


@dataclass
class EngineCoreOutput:
    """New tokens (and maybe the end) of one request, as the core reports them."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    timestamp: float = 0.0  # wall time the step that produced these tokens ended

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
