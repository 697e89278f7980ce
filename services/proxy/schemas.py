"""Request bodies of the proxy's HTTP API, validated at the edge with the deployment's bounds.

Bounds that depend on the config (``proxy.max_tokens_limit``, ``proxy.max_messages``) are
checked by validators reading ``Limits`` from the validation context, so one model serves every
deployment. ``parse`` turns a pydantic failure into ``InvalidRequest`` naming the first bad field
(dotted path, e.g. ``messages.0.role``) and listing every error — never echoing the input.

OpenAI chat bodies ignore unknown fields (agents send many optional OpenAI knobs); fields that
would change the result and are not supported (``response_format``, ``n`` > 1, ...: the tables
``*_UNSUPPORTED``) are refused with 400 naming the field instead of silently ignored. Token-id bodies (``/v1/generate``) and operator bodies
forbid unknown fields: a typo there is a bug in our own workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.proxy.errors import InvalidRequest, UnsupportedParameter
from services.proxy.sessions import SESSION_ID_RE
from shared.sglang_fields import REFUSED, is_set

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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str  # only "text" (and "input_text"/"output_text") can be read by a text-only policy
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI) or an object


class ToolCallIn(BaseModel):
    """An earlier assistant tool call, sent back by the agent in the history."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn that only made tool calls
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=128)  # assistant turns
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool turns: which call this answers
    name: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments
    strict: bool | None = None  # true: 400 (schema-guaranteed arguments are not implemented, turns.refuse_strict)


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: dict[str, Any]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's body plus SGLang's extensions this proxy honours.

    Fields that would change the result and are not implemented are refused before this model
    is built (``refuse_unsupported``, 400 naming the field); fields that do not change the
    result (``CHAT_NO_EFFECT``: ``user``, ``metadata``, ``store``, ``service_tier``...) are accepted
    and ignored; any other field is a 400 naming it (``refuse_unknown``)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # None: proxy.max_tokens_limit
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer OpenAI name; wins if both given
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)  # None: proxy.temperature
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # SGLang extension
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # SGLang extension (passed to the engine)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # passed to the engine
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # passed to the engine
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # SGLang extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, passed to the engine
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    n: int = Field(default=1, ge=1)
    stream: bool = False  # real token streaming (SSE chunks as tokens are produced)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # up to 4 strings (OpenAI); the text and tokens end before it
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)  # SGLang extension
    ignore_eos: bool = False  # SGLang extension
    skip_special_tokens: bool = True  # SGLang extension
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    return_token_ids: bool = False  # SGLang/vLLM extension: prompt_token_ids + choices[].token_ids
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    # SGLang/vLLM extension: the chat template's own variables (e.g. {"enable_thinking": false}), over the
    # proxy's model.chat_template_kwargs; None: those alone
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=32)
    separate_reasoning: bool = True  # SGLang extension: with proxy.reasoning_parser, reasoning_content apart

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
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4 or any(not s or len(s) > 256 for s in items):
            raise ValueError("at most 4 stop strings of 1-256 characters")
        return v

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


# Fields OpenAI's or SGLang's chat API accepts that would change the result and are not implemented
# here: refused with 400 naming the field, never ignored. A value equal to the API's default passes.
CHAT_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "response_format": ({"type": "text"}, "structured output (JSON mode / json_schema) is not implemented"),
    "n": (1, "n > 1 needs X-Session-Ids naming one session per choice (each choice is a trajectory)"),
    "audio": (None, "audio output is not supported by a text-only policy"),
    "modalities": (["text"], "only text output is supported"),
    "prediction": (None, "predicted outputs are not implemented"),
    "web_search_options": (None, "web search is not available"),
    "functions": (None, "the deprecated 'functions' API is not implemented; use 'tools'"),
    "function_call": (None, "the deprecated 'function_call' API is not implemented; use 'tool_choice'"),
    "reasoning_effort": (None, "this policy has no reasoning-effort control"),
    "verbosity": (None, "this policy has no verbosity control"),
    "ebnf": (None, "grammar-constrained decoding is not implemented"),
    "regex": (None, "regex-constrained decoding is not implemented"),
    "json_schema": (None, "schema-constrained decoding is not implemented"),
    "continue_final_message": (False, "continuing the final assistant message is not implemented"),
    "lora_path": (None, "LoRA adapters are not supported"),
}


# Chat fields that cannot change what is generated or recorded: accepted and dropped.
CHAT_NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                            "prompt_cache_retention", "rid"})


def refuse_unknown(body: Any, model: type[BaseModel], table: dict[str, tuple[Any, str]],
                   no_effect: frozenset[str]) -> None:
    """400 ``unsupported_parameter`` naming a field the surface neither implements, refuses by name
    (``table``) nor knows to be without effect: OpenAI answers an unrecognised argument with a 400
    too, and a field silently dropped could be one that changes the result (``chat_template_kwargs``)."""
    if not isinstance(body, dict):
        return
    for name in body:
        if name not in model.model_fields and name not in table and name not in no_effect:
            raise UnsupportedParameter(name, "not a field this proxy implements; it would be ignored")


def refuse_unsupported(body: Any, table: dict[str, tuple[Any, str]]) -> None:
    """400 ``unsupported_parameter`` for the first field of ``table`` set to a non-default value."""
    if not isinstance(body, dict):
        return
    for name, (default, why) in table.items():
        if name in body and body[name] is not None and body[name] != default:
            raise UnsupportedParameter(name, why)


# SGLang fields /v1/generate accepts that cannot change what is generated or recorded (dropped).
GENERATE_NO_EFFECT = frozenset({"log_metrics", "routing_key", "conversation_id", "extra_key", "no_logs",
                                "custom_labels", "external_trace_header", "received_time", "cache_salt",
                                "kv_router_hint", "routed_dp_rank", "data_parallel_rank"})
SAMPLING_NO_EFFECT = frozenset({"stream_interval", "spaces_between_special_tokens"})  # the proxy's fast decode
# SGLang fields the proxy's /v1/generate does not implement (a 400 naming them when set), on top of
# what no part of this system implements (shared.sglang_fields.REFUSED).
GENERATE_REFUSED: dict[str, str] = {
    "stream": "streaming /v1/generate is not implemented; stream /v1/chat/completions, or call the engine",
    "logprob_start_len": "prompt logprobs are not returned by the proxy",
    "top_logprobs_num": "top logprobs on /v1/generate are not implemented; use chat's top_logprobs",
    "token_ids_logprob": "logprobs of chosen token ids are not returned by the proxy",
    "return_text_in_logprobs": "logprob entries carry ids only here ([logprob, id, null])",
    "continue_across_weight_updates": "the proxy decides how a request meets a weight update (proxy.weight_updates)",
    "sampling_params.n": "one trajectory per call: send n requests (each is recorded)",
    "sampling_params.stop_regex": "stop regexes are not implemented by the proxy; use stop strings",
    "sampling_params.min_new_tokens": "a minimum length is not kept across a partial-rollout resume",
}


_SGLANG_DEFAULTS: dict[str, Any] = {"sampling_params.n": 1, "sampling_params.min_new_tokens": 0,
                                    "logprob_start_len": -1, "top_logprobs_num": 0}


def refuse_generate_fields(body: Any) -> Any:
    """SGLang's ``/generate`` body as the proxy takes it: refused fields that are set -> 400 naming
    them; fields without effect here dropped; the rest is validated by ``GenerateRequest``."""
    if not isinstance(body, dict):
        return body
    sp = body.get("sampling_params")
    sp = dict(sp) if isinstance(sp, dict) else sp
    if isinstance(body.get("text"), list) or (isinstance(body.get("input_ids"), list) and body["input_ids"]
                                             and isinstance(body["input_ids"][0], list)):
        raise UnsupportedParameter("text" if isinstance(body.get("text"), list) else "input_ids",
                                   "batched inputs: one trajectory per call, send one request per prompt")
    for name, why in {**REFUSED, **GENERATE_REFUSED}.items():
        field_, _, sub = name.partition(".")
        value = (sp or {}).get(sub) if sub and isinstance(sp, dict) else (None if sub else body.get(field_))
        if is_set(value) and value != _SGLANG_DEFAULTS.get(name):
            raise UnsupportedParameter(name, why)
    for name in ("routed_dp_rank", "data_parallel_rank"):
        if body.get(name) not in (None, 0):
            raise UnsupportedParameter(name, "the proxy picks the engine; there is one data-parallel rank (0)")
    dropped = GENERATE_NO_EFFECT | GENERATE_REFUSED.keys() | REFUSED.keys()  # set ones were refused above
    out = {k: v for k, v in body.items() if k not in dropped}
    if isinstance(sp, dict):
        out["sampling_params"] = {k: v for k, v in sp.items() if k not in SAMPLING_NO_EFFECT and v is not None
                                  and f"sampling_params.{k}" not in dropped}
    return out


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = Field(default=None, ge=1)  # None: proxy.max_tokens_limit
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    sampling_seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    ignore_eos: bool = False  # SGLang's knob: do not stop at the engine's end tokens (fixed-length runs)
    stop: str | list[str] | None = Field(default=None, max_length=16)  # stop strings (cut here; see no_stop_trim)
    no_stop_trim: bool = False  # keep the matched stop string in text and output_ids (SGLang)
    skip_special_tokens: bool = True  # strip special tokens from "text" (SGLang's default)
    # Passed to the engine's sampling params with SGLang's semantics (as chat's extensions are).
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None  # read only by a custom logit processor (none is loaded)

    def engine_params(self) -> dict[str, Any]:
        """The pass-through sampling params that are set (SGLang names)."""
        names = ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "custom_params")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        return {**out, **({"ignore_eos": True} if self.ignore_eos else {})}

    def stop_strings(self) -> tuple[str, ...]:
        items = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in items):
            raise InvalidRequest("sampling_params.stop", "stop strings must be non-empty")
        return items

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(v, info)


class GenerateRequest(BaseModel):
    """``POST /v1/generate``: token ids in, token ids out (white-box workers)."""

    model_config = ConfigDict(extra="forbid")
    input_ids: list[int] | None = Field(default=None, min_length=1)  # exactly one of input_ids and text
    text: str | None = Field(default=None, min_length=1)  # tokenised as is (no chat template), SGLang's way
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    rid: str | None = Field(default=None, min_length=1, max_length=256)  # echoed as meta_info.id
    return_logprob: bool = True  # False: no output_token_logprobs in meta_info (they are recorded anyway)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        return self

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is None:
            return v
        lim = _limits(info)
        if lim is not None and len(v) > lim.max_prompt_tokens:
            raise ValueError(f"{len(v)} tokens exceed proxy.max_prompt_tokens={lim.max_prompt_tokens}")
        if min(v) < 0 or max(v) > MAX_TOKEN_ID:  # C-speed scan first; find the index only when bad
            bad = next(i for i, t in enumerate(v) if not 0 <= t <= MAX_TOKEN_ID)
            raise ValueError(f"token at index {bad} is not a valid token id")
        return v


NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"  # strings that reach log lines: one line each


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str | None = Field(default=None, min_length=1, max_length=256, pattern=NO_CONTROL)  # None: whole proxy
    reason: str = Field(default="", max_length=256, pattern=NO_CONTROL)  # logged: no control characters
    timeout_s: float | None = Field(default=None, ge=0.0, le=3600.0)  # None: proxy.pause_timeout_s


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str | None = Field(default=None, min_length=1, max_length=256, pattern=NO_CONTROL)
    version: str | None = Field(default=None, min_length=1, max_length=128, pattern=NO_CONTROL)  # engines' version


MAX_CLOSE_SESSIONS = 1024  # ids per ``POST /v1/sessions/close``: a few GRPO groups' worth


class CloseSessionsRequest(BaseModel):
    """``POST /v1/sessions/close``: finalize, read and drop many sessions in one call (a group's)."""

    model_config = ConfigDict(extra="forbid")
    session_ids: list[str] = Field(min_length=1, max_length=MAX_CLOSE_SESSIONS)
    records: bool = True  # False: drop only (cleanup after a failed attempt)

    @field_validator("session_ids")
    @classmethod
    def _ids(cls, v: list[str]) -> list[str]:
        for i, sid in enumerate(v):
            if not SESSION_ID_RE.fullmatch(sid):
                raise ValueError(f"session id at index {i} must be 1-256 characters of [A-Za-z0-9._:@+=-], "
                                 "starting with a letter or digit")
        if len(set(v)) != len(v):
            raise ValueError("session ids must be distinct")
        return v


class RewardReport(BaseModel):
    """``POST /s/{session}/v1/reward``: the agent's own reward for its trajectory (the task decides what it
    counts for, ``shared.tasks.plugin``). Finite numbers only; at most 32 named components."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    reward: float  # the trajectory's reward as the agent measured it (tests passed, an environment's return)
    components: dict[str, float] = Field(default_factory=dict, max_length=32)  # named parts, logged as metrics

    @field_validator("components")
    @classmethod
    def _names(cls, v: dict[str, float]) -> dict[str, float]:
        for name in v:
            if not 1 <= len(name) <= 64 or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"component name {name[:80]!r} must be 1-64 letters, digits, '_' or '-'")
        return v


def parse(model: type[M], data: Any, limits: Limits | None = None) -> M:
    """Validate ``data`` as ``model``; raises InvalidRequest naming the first bad field."""
    try:
        return model.model_validate(data, context={"limits": limits})
    except ValidationError as exc:
        errors = [{"field": ".".join(str(p) for p in e["loc"]) or "body", "message": e["msg"]}
                  for e in exc.errors(include_input=False, include_url=False)]
        first = errors[0]
        raise InvalidRequest(first["field"], first["message"], errors=errors[:20]) from None
