"""The OpenAI request bodies the server takes, checked strictly: a wrong type or an out-of-range value is an HTTP 400
naming the field, as OpenAI's API answers it. Fields qinfer does not implement are refused when they ask for
something (``n`` > 1, ``logprobs``, ``echo``, penalties); fields that change nothing here (``user``,
``stream_options`` beyond ``include_usage``, ...) are ignored, as other OpenAI-compatible servers do."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qinfer.engine.sampling import SamplingParams

MAX_STOP = 16  # stop strings a request may give (OpenAI allows 4)


class APIError(Exception):
    """An error answered as OpenAI's API answers one: status, ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "server_overloaded", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's extension: -1 or 0 keep every token
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=0, le=0)] = 0.0  # only the neutral value is implemented
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] = 0.0

    @model_validator(mode="after")
    def _stops(self):
        if any(s == "" for s in self.stops()):
            raise ValueError("stop strings must not be empty")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def params(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling settings; OpenAI's defaults (temperature 1, top-p 1) where a field is absent."""
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=max(0, self.top_k or 0),
                              seed=self.seed, stop=self.stops())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] \
        | Annotated[list[int], Field(min_length=1)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    def limit(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions


def parse(model: type[_Strict], body: object):
    """``body`` (parsed JSON) as ``model``, or an :class:`APIError` (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"] if not _is_type_name(part))
        message = error["msg"]
        if error["type"] == "missing":
            message = "a required field is missing"
        elif error["type"] == "extra_forbidden":
            message = "not a field of this request"
        elif "input" in error and error["type"] not in ("value_error",):
            message += f" (got {_short(error['input'])})"
        param = str(error["loc"][0]) if error["loc"] else None
        raise APIError(400, f"{where}: {message}" if where else message, param=param) from None


def _is_type_name(part) -> bool:
    """pydantic names the union member it tried (``list[int]``, ``function-after[...]``): not part of the path."""
    return isinstance(part, str) and any(c in part for c in "[]-") or part in ("str", "int", "float", "bool")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
