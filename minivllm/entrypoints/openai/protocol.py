"""The OpenAI API's request bodies and error shape, validated with pydantic (strict types).

Strict: ``"max_tokens": "5"`` or ``"temperature": "hot"`` is a 400 naming the field, not a
silent coercion. Unknown fields are ignored (clients send extras), but the OpenAI features
minivllm does not implement (logprobs, echo, penalties, tools, n > 1) are refused with a clear
400 instead of being silently dropped. Everything else a request may get wrong is checked when
its ``SamplingParams`` are built (``to_sampling_params``), and by the engine's ``Processor``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minivllm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

Int64 = Field(None, ge=INT64_MIN, le=INT64_MAX)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class RequestError(Exception):
    """A client error: becomes ``{"error": {message, type, param, code}}`` with ``status``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_from_validation(e: ValidationError) -> RequestError:
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if not str(x).startswith(("function-", "union"))]
    # drop pydantic's union-branch labels ("str", "list[int]"): keep the field path
    path = [x for x in loc if not any(ch in x for ch in "[]") and x not in ("str", "int", "float",
                                                                            "bool", "list")]
    param = ".".join(path) or None
    msg = first.get("msg", "invalid value")
    return RequestError(f"{param}: {msg}" if param else msg, param=param)


def error_from_value_error(e: ValueError) -> RequestError:
    """The engine's ValueErrors start with the field they are about ("temperature must ...")."""
    msg = str(e)
    head = msg.split(":")[0].split(" ")[0]
    param = head if head.isidentifier() else None
    if param == "prompt_token_ids":  # the API's field is "prompt", whatever form it took
        param = "prompt"
    return RequestError(msg, param=param)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# fields of the OpenAI API minivllm does not implement: refused unless left at their default
_UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None,),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "response_format": (None,),
}


class SamplingRequest(OpenAIBaseModel):
    """Fields completions and chat share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # vLLM's extension
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Int64  # vLLM's bounds: a torch generator takes an int64
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # accepted and ignored

    def check_supported(self, extra: dict[str, Any]) -> None:
        if self.n != 1:
            raise RequestError(f"n: only n=1 is supported, got {self.n}", param="n")
        for name, defaults in _UNSUPPORTED.items():
            if name in extra and extra[name] not in defaults:
                raise RequestError(f"{name}: not supported by minivllm", param=name)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true",
                               param="stream_options")

    def to_sampling_params(self, max_tokens: int | None,
                           max_tokens_param: str = "max_tokens") -> SamplingParams:
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise RequestError(f"temperature: must be in [0, 2], got {self.temperature}",
                               param="temperature")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise RequestError(f"top_p: must be in (0, 1], got {self.top_p}", param="top_p")
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"{max_tokens_param}: must be at least 1, got {max_tokens}",
                               param=max_tokens_param)
        kwargs = dict(
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed,
        )
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.top_k is not None:
            kwargs["top_k"] = self.top_k
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise error_from_value_error(e) from None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions


class ChatMessageContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ChatMessageContentPart]
    name: str | None = None

    def to_template_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content
        )
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins if both

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def openapi_request_body(model_cls: type[BaseModel]) -> dict:
    """The OpenAPI ``requestBody`` of an endpoint whose JSON body is ``model_cls``."""
    ref = {"$ref": f"#/components/schemas/{model_cls.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def parse_request(model_cls: type[SamplingRequest], data: Any) -> tuple[SamplingRequest, dict]:
    """Validate a decoded JSON body; returns the request and the raw dict (for extra fields)."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        request = model_cls.model_validate(data)
    except ValidationError as e:
        raise error_from_validation(e) from None
    request.check_supported(data)
    return request, data
