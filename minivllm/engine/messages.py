"""What the front end and the engine core say to each other, besides requests and tokens.

``EngineCoreRequest`` (token ids + SamplingParams) goes in, ``EngineCoreOutputs`` come out: one
per busy-loop iteration, carrying the new tokens of every request that advanced, the scheduler's
counters (KV blocks used, prefix-cache hits, queue lengths) for /metrics, and the answer to a
utility call when there was one. Plain dataclasses, so the in-process path needs no serializer;
``serial.py`` turns them into msgpack bytes for the trip between processes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from minivllm.core.sched_output import EngineCoreOutput


class EngineCoreRequestType(bytes, enum.Enum):
    """The first frame of every message to the core: what the second frame holds."""

    ADD = b"\x00"  # an EngineCoreRequest
    ABORT = b"\x01"  # a list of request ids
    UTILITY = b"\x02"  # (call_id, method name, args): get_stats, get_step_trace, ...
    SHUTDOWN = b"\x03"  # leave the busy loop


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
