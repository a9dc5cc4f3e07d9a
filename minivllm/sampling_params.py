"""How to pick the next token, and when to stop: the per-request knobs.

Names and defaults follow vLLM's ``SamplingParams`` so code written against one runs on the
other. Validation happens here, once, so the engine never sees a request it cannot serve: a bad
value raises ``ValueError`` naming the field before any KV block is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from minivllm.outputs import RequestOutputKind

_EPS = 1e-5  # temperatures below this are treated as greedy
# every integer field must fit an int64: the engine core's tensors, numpy rows, torch generators
# and the msgpack messages between the processes all carry it as one (vLLM bounds seed the same)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(x, lo: int = INT64_MIN, hi: int = INT64_MAX) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _is_number(x) -> bool:
    """A finite int or float (NaN and infinity would poison every logit they touch)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_utf8(text: str) -> bool:
    """False for a str holding lone surrogates ("\\ud800", which JSON can carry): no tokenizer,
    msgpack message or HTTP response can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request.

    temperature: 0 means greedy (argmax); higher flattens the distribution.
    top_p: keep the smallest set of tokens whose probability adds up to ``top_p`` (1 = off).
    top_k: keep the ``top_k`` most likely tokens (0 or -1 = off).
    max_tokens: the most tokens to generate.
    min_tokens: generate at least this many before EOS / stop tokens may end the request.
    stop: strings that end generation; the text returned stops before them.
    stop_token_ids: token ids that end generation (besides EOS).
    ignore_eos: keep generating past the EOS token (benchmarks use it for fixed lengths).
    seed: a request with a seed samples the same tokens whatever else shares its batch.
    skip_special_tokens: drop special tokens from the returned text.
    output_kind: what each output carries: everything so far (CUMULATIVE), what is new
        (DELTA), or one output at the end (FINAL_ONLY); see ``RequestOutputKind``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k, lo=0):
            raise ValueError(f"top_k must be an int in [0, 2**63) (0 or -1 disables it; the engine "
                             f"clamps it to the vocabulary), got {self.top_k!r}")
        if self.max_tokens is not None and not _is_int(self.max_tokens, lo=1):
            raise ValueError(f"max_tokens must be an int in [1, 2**63), got {self.max_tokens!r}")
        if not _is_int(self.min_tokens, lo=0):
            raise ValueError(f"min_tokens must be an int in [0, 2**63), got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not isinstance(self.stop, list) or not all(
            isinstance(s, str) and s and is_utf8(s) for s in self.stop
        ):
            raise ValueError(
                f"stop must be a non-empty string or a list of them (valid unicode), got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t, lo=0) for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of ints in [0, 2**63), got {self.stop_token_ids!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int in [-2**63, 2**63), got {self.seed!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    def clone(self) -> "SamplingParams":
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        kwargs["stop"] = list(self.stop)
        kwargs["stop_token_ids"] = list(self.stop_token_ids)
        return SamplingParams(**kwargs)
