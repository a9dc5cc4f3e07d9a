"""msgpack encoding of the messages between the front end and the engine core (msgspec).

Typed decoders rebuild the very dataclasses the in-process path uses (``EngineCoreRequest``,
``EngineCoreOutputs``) and reject a malformed message instead of guessing. msgspec is imported
here only, and this module only by the multi-process path: offline ``LLM`` never needs it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from minivllm.engine.messages import EngineCoreRequest
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreReady, EngineCoreRequestType

_encoder = msgspec.msgpack.Encoder()
# What crosses the wire. SHUTDOWN does not: only the in-process client puts it on the busy
# loop's queue; a core process is stopped by its front end with SIGTERM (core_client_mp.py).
_payload_decoders = {
    EngineCoreRequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    EngineCoreRequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
    EngineCoreRequestType.UTILITY: msgspec.msgpack.Decoder(tuple[int, str, list[Any]]),
}
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_ready_decoder = msgspec.msgpack.Decoder(EngineCoreReady)


def encode_request(kind: EngineCoreRequestType, payload: Any) -> list[bytes]:
    return [kind.value, _encoder.encode(payload)]


def decode_request(frames: list) -> tuple[EngineCoreRequestType, Any]:
    kind = EngineCoreRequestType(bytes(frames[0]))
    if kind not in _payload_decoders:
        raise ValueError(f"{kind.name} is not a message the engine core process receives")
    return kind, _payload_decoders[kind].decode(frames[1])


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode_outputs(data: bytes) -> EngineCoreOutputs:
    return _outputs_decoder.decode(data)


def decode_ready(data: bytes) -> EngineCoreReady:
    return _ready_decoder.decode(data)
