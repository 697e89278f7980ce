"""Request bodies of the proxy's HTTP API, validated at the edge with the deployment's bounds.

Bounds that depend on the config (``proxy.max_tokens_limit``, ``proxy.max_messages``) are
checked by validators reading ``Limits`` from the validation context, so one model serves every
deployment. ``parse`` turns a pydantic failure into ``InvalidRequest`` naming the first bad field
(dotted path, e.g. ``messages.0.role``) and listing every error — never echoing the input.

OpenAI chat bodies ignore unknown fields (agents send many optional OpenAI knobs); fields that
would change the result and are not supported (``n`` > 1, ``stop`` strings, ``tools``) are
refused instead of silently ignored. Token-id bodies (``/v1/generate``) and operator bodies
forbid unknown fields: a typo there is a bug in our own workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from services.proxy.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
MAX_TOKEN_ID = (1 << 31) - 1


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # proxy.max_tokens_limit
    max_messages: int  # proxy.max_messages
    max_prompt_tokens: int  # proxy.max_prompt_tokens (checked after tokenisation)


def _limits(info: ValidationInfo) -> Limits | None:
    ctx = info.context
    return ctx.get("limits") if isinstance(ctx, dict) else None


def _check_max_tokens(v: int | None, info: ValidationInfo) -> int | None:
    lim = _limits(info)
    if v is not None and lim is not None and v > lim.max_tokens:
        raise ValueError(f"{v} exceeds proxy.max_tokens_limit={lim.max_tokens}")
    return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only made tool calls

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = True


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions`` (the OpenAI subset a text-only policy can honour)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # None: proxy.max_tokens_limit
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer OpenAI name; wins if both given
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)  # None: proxy.temperature
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False  # answered as a pseudo-stream (SSE of the finished response)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    tools: list[Any] | None = None
    session_id: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("messages")
    @classmethod
    def _count(cls, v: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
        lim = _limits(info)
        if lim is not None and len(v) > lim.max_messages:
            raise ValueError(f"{len(v)} messages exceed proxy.max_messages={lim.max_messages}")
        return v

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(v, info)

    @field_validator("stop")
    @classmethod
    def _no_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v:
            raise ValueError("stop strings are not supported; the turn ends at the chat template's end token")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tool calling is not supported by this proxy; describe tools in the prompt")
        return v

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = Field(default=None, ge=1)  # None: proxy.max_tokens_limit
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    sampling_seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    ignore_eos: bool = False  # SGLang's knob: do not stop at the engine's end tokens (fixed-length runs)

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(v, info)


class GenerateRequest(BaseModel):
    """``POST /v1/generate``: token ids in, token ids out (white-box workers)."""

    model_config = ConfigDict(extra="forbid")
    input_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    session_id: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, v: list[int], info: ValidationInfo) -> list[int]:
        lim = _limits(info)
        if lim is not None and len(v) > lim.max_prompt_tokens:
            raise ValueError(f"{len(v)} tokens exceed proxy.max_prompt_tokens={lim.max_prompt_tokens}")
        if min(v) < 0 or max(v) > MAX_TOKEN_ID:  # C-speed scan first; find the index only when bad
            bad = next(i for i, t in enumerate(v) if not 0 <= t <= MAX_TOKEN_ID)
            raise ValueError(f"token at index {bad} is not a valid token id")
        return v


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str | None = Field(default=None, min_length=1, max_length=256)  # None: the whole proxy
    reason: str = Field(default="", max_length=256)
    timeout_s: float | None = Field(default=None, ge=0.0, le=3600.0)  # None: proxy.pause_timeout_s


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    version: str | None = Field(default=None, min_length=1, max_length=128)  # what the engines now run


def parse(model: type[M], data: Any, limits: Limits | None = None) -> M:
    """Validate ``data`` as ``model``; raises InvalidRequest naming the first bad field."""
    try:
        return model.model_validate(data, context={"limits": limits})
    except ValidationError as exc:
        errors = [{"field": ".".join(str(p) for p in e["loc"]) or "body", "message": e["msg"]}
                  for e in exc.errors(include_input=False, include_url=False)]
        first = errors[0]
        raise InvalidRequest(first["field"], first["message"], errors=errors[:20]) from None
