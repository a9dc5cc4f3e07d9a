"""What crosses from the scheduler to the model runner and back, once per step.

The scheduler output is a *diff* (vLLM v1's ``SchedulerOutput``): the model runner keeps every
running request in a persistent batch (``minivllm/worker/input_batch.py``), so a step only
says what changed since the last one:

* ``scheduled_new_reqs`` — requests the runner has never seen: their prompt, sampling
  parameters and block table, sent once;
* ``scheduled_cached_reqs`` — requests it already holds: only the blocks added this step (a
  decode needs a new block once every ``block_size`` tokens) and ``num_computed_tokens``;
  a request resumed after preemption gets its whole new block table instead;
* ``num_scheduled_tokens`` — how many tokens each request computes this step;
* ``finished_req_ids`` / ``preempted_req_ids`` — rows the runner drops.

A running request's prompt, output or block list is never copied per step: what a step costs
to describe (and, with tensor parallelism, to broadcast) grows with what changed, not with the
batch's history. The token ids themselves need not travel either: the runner sampled them, and
appends them to its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request scheduled for the first time: everything the runner needs to hold it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the cache (a prefix-cache hit) before this step


@dataclass
class CachedRequestData:
    """Requests the runner already holds, as parallel lists (one entry per request)."""

    req_ids: list[str] = field(default_factory=list)
    # True: the request was preempted and is back; new_block_ids is then its whole block table
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # request id -> tokens it computes this step, in the order the scheduler picked them
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # requests that ended since the previous step: the runner forgets them
    finished_req_ids: set[str] = field(default_factory=set)
    # requests preempted this step: the runner drops their rows (they come back as resumed)
    preempted_req_ids: set[str] = field(default_factory=set)
    token_budget: int = 0  # the step's max_num_batched_tokens (for the step trace)

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass
class ModelRunnerOutput:
    """The runner's answer, one entry per request of the batch (vLLM's layout)."""

    req_ids: list[str] = field(default_factory=list)
    # sampled_token_ids[i] belongs to req_ids[i]; empty: a prefill chunk that sampled nothing
    sampled_token_ids: list[list[int]] = field(default_factory=list)


