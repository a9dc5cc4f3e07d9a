"""What the engine hands back to the user: vLLM's ``RequestOutput`` shape, plus timing metrics.

The course draws its plots from ``RequestOutput.metrics``: every output token carries the wall
time it reached the front end, so TTFT and time-per-output-token are read off, not estimated.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (``SamplingParams.output_kind``).

    CUMULATIVE: everything so far, every time (``LLMEngine.step``'s default);
    DELTA: only what is new since the previous output (what a streaming server sends);
    FINAL_ONLY: nothing until the request finishes, then everything (``LLM.generate``,
    a non-streaming server response).
    DELTA and FINAL_ONLY keep a long generation's cost per step proportional to what changed.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()`` seconds) of one request's life, and cache facts.

    arrival_time: the request reached the engine.
    first_scheduled_time: the scheduler first gave it tokens to compute.
    first_token_time / last_token_time: its first / latest output token arrived.
    token_times: the arrival time of every output token, in order.
    num_cached_tokens: prompt tokens served from the prefix cache (not recomputed).
    num_preemptions: how often it lost its KV blocks and was recomputed.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpots(self) -> list[float]:
        """Gaps between consecutive output tokens, seconds (inter-token latencies)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request as the front end sees it after a step (or at the end)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

    def add(self, later: "RequestOutput") -> None:
        """Merge a later DELTA output into this one (a consumer that fell behind gets both
        deltas as one)."""
        for mine, new in zip(self.outputs, later.outputs):
            mine.text += new.text
            mine.token_ids = mine.token_ids + new.token_ids
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        self.finished = later.finished
        self.metrics = later.metrics
        self.num_cached_tokens = later.num_cached_tokens

    def __repr__(self) -> str:
        out = self.outputs[0]
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"text={out.text!r}, finish_reason={out.finish_reason!r}, finished={self.finished})"
        )
