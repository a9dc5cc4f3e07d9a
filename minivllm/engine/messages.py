"""What the front end and the engine core say to each other: every message type in one place.

``EngineCoreRequest`` (token ids + SamplingParams) goes in, ``EngineCoreOutputs`` come out: one
per busy-loop iteration, carrying the new tokens of every request that advanced, the scheduler's
counters (KV blocks used, prefix-cache hits, queue lengths) for /metrics, and the answer to a
utility call when there was one. Plain dataclasses, so the in-process path needs no serializer;
``serial.py`` turns them into msgpack bytes for the trip between processes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from minivllm.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """What the front end sends the engine core: token ids, never text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.time)
    cache_salt: str | None = None
    # vLLM's request priority: a lower value is served earlier (ties: earlier arrival). The
    # package's schedulers are first-come-first-served and ignore it; a priority policy reads it
    priority: int = 0


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


class EngineCoreRequestType(bytes, enum.Enum):
    """The first frame of every message to the core: what the second frame holds."""

    ADD = b"\x00"  # an EngineCoreRequest
    ABORT = b"\x01"  # a list of request ids
    UTILITY = b"\x02"  # (call_id, method name, args): get_stats, get_step_trace, ...
    SHUTDOWN = b"\x03"  # leave the busy loop (in-process only: a core process gets SIGTERM)


@dataclass
class UtilityOutput:
    call_id: int
    result: Any = None
    error: str | None = None  # the exception the call raised, as text


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: dict[str, int | float] | None = None
    utility_output: UtilityOutput | None = None
    engine_error: str | None = None  # the core hit a fatal error and is going away
    timestamp: float = 0.0


@dataclass
class EngineCoreReady:
    """The core's first message: it loaded the model and allocated its KV cache (or failed)."""

    ok: bool
    num_kv_blocks: int = 0
    error: str | None = None
    error_is_value_error: bool = False  # a bad engine argument, not a crash: re-raised as such
