"""SGLang's HTTP bodies, the subset RL needs: request models (validated at the edge) and responses.

Request bodies forbid unknown fields, so a typo (``max_tokens`` for ``max_new_tokens``) is a 422
naming the field instead of a silently ignored knob. SGLang fields that are accepted but have one
meaning here (``stream``, ``n``, ``top_logprobs_num``, ``stop``) only take that value.

Response of ``/generate`` (SGLang's shape plus one extension)::

    {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "weight_version", "output_token_versions",
     "e2e_latency", ["output_token_logprobs", "input_token_logprobs"]}}

``output_token_versions`` (extension) is the weight version that produced each output token;
``weight_version`` is the version of the last token. Logprob entries are
``[logprob, token_id, text | null]`` (text only with ``return_text_in_logprobs``). Output
logprobs are ``log_softmax(logits / temperature)`` of the sampled token (top-k/top-p truncation
not renormalised in; greedy rows use temperature 1), so at temperature 1 they are the plain
log-softmax a trainer recomputes; prompt logprobs (``logprob_start_len >= 0``) always use
temperature 1. See `sampling.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.engine.requests import GenResult

HARD_MAX_NEW_TOKENS = 1 << 20  # the config's max_new_tokens_limit is checked by the service


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(Body):
    max_new_tokens: int = Field(default=128, ge=0, le=HARD_MAX_NEW_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)  # 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # -1 or 0 = off
    min_p: float = Field(default=0.0, ge=0.0, le=0.0)  # accepted for compatibility, must be 0
    stop_token_ids: list[int] | None = None
    stop: list[str] | str | None = None  # stop strings are not supported; only empty is accepted
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    n: int = Field(default=1, ge=1, le=1)

    @field_validator("stop")
    @classmethod
    def _no_stop_strings(cls, v: list[str] | str | None) -> list[str] | str | None:
        if v:
            raise ValueError("stop strings are not supported by this engine; use stop_token_ids")
        return v


class GenerateBody(Body):
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    text: str | None = None
    input_ids: list[int] | None = Field(default=None, min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1)  # >= 0: prompt logprobs from this index
    top_logprobs_num: int = Field(default=0, ge=0, le=0)
    return_text_in_logprobs: bool = False
    stream: Literal[False] = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        return self


class AbortBody(Body):
    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _target(self) -> AbortBody:
        if not self.rid and not self.abort_all:
            raise ValueError("give a 'rid' or 'abort_all': true")
        return self


class PauseBody(Body):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class UpdateWeightsBody(Body):
    model_path: str = Field(min_length=1)
    weight_version: str | None = Field(default=None, min_length=1, max_length=128)
    abort_all_requests: bool = False
    load_format: Literal["auto", "safetensors"] | None = None
    flush_cache: bool = True  # there is no prefix cache to flush; accepted for compatibility
    is_async: bool = False
    keep_pause: bool = False
    torch_empty_cache: bool = False
    token_step: int = 0

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


def generate_response(result: GenResult, body: GenerateBody, prompt_ids: list[int], text: str,
                      token_texts: list[str] | None, input_texts: list[str] | None,
                      latency_s: float) -> dict[str, Any]:
    """The SGLang ``/generate`` response for `result` (token texts only when asked for)."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "output_token_versions": result.output_versions,
        "e2e_latency": round(latency_s, 6),
    }
    if body.return_logprob:
        texts: list[str | None] = list(token_texts) if token_texts else [None] * len(result.output_ids)
        meta["output_token_logprobs"] = [
            [lp, tok, t] for lp, tok, t in zip(result.output_logprobs, result.output_ids, texts, strict=True)
        ]
        if result.input_logprobs is not None:
            ids = prompt_ids[body.logprob_start_len:]
            itexts: list[str | None] = list(input_texts) if input_texts else [None] * len(ids)
            meta["input_token_logprobs"] = [
                [lp, tok, t] for lp, tok, t in zip(result.input_logprobs, ids, itexts, strict=True)
            ]
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}
