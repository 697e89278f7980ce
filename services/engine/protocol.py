"""SGLang 0.5.x's ``/generate`` request schema, validated at the edge, and its response shapes.

Every field of SGLang's ``GenerateReqInput`` and ``SamplingParams`` is declared here. Each one
is either implemented with SGLang's semantics or, when it cannot apply on this engine (images,
LoRA, input embeddings, constrained decoding, disaggregation...), refused by `refusals` with a
400 naming it -- never silently ignored. Unknown fields are a 422 naming them (a typo such as
``max_tokens`` is not a knob that silently does nothing). ``null`` means "default" for every
sampling parameter, as in SGLang. The table of what each field does here is docs/engine.md.

Batches follow ``GenerateReqInput.normalize_batch_and_arguments``: ``text`` / ``input_ids`` as a
list of prompts, or ``sampling_params.n > 1``, make a batch whose response is a JSON list, one
object per sample, grouped by prompt (prompt 0 sample 0..n-1, prompt 1 ...). Per-prompt fields
(``rid``, ``sampling_params``, ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
``token_ids_logprob``) may be one value for all or a list with one value per prompt; a single
``rid`` string becomes ``{rid}_{i}`` per sample.

Response of ``/generate`` (SGLang's shape plus one extension)::

    {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "weight_version", "output_token_versions",
     "e2e_latency", ["output_token_logprobs", "input_token_logprobs", "output_top_logprobs",
     "input_top_logprobs", "output_token_ids_logprobs", "input_token_ids_logprobs"]}}

``output_token_versions`` (extension) is the weight version that produced each output token.
Logprob entries are ``[logprob, token_id, text | null]`` (text only with
``return_text_in_logprobs``); top-logprob entries are one list of such triples per position,
``null`` for the first prompt position. Output logprobs are ``log_softmax(adjusted logits / T)``
of the sampled token (see `sampling.py`); prompt logprobs always use temperature 1.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.engine.requests import GenResult, UnsupportedField
from shared.sglang_fields import REFUSED, is_set

HARD_MAX_NEW_TOKENS = 1 << 20  # the config's max_new_tokens_limit is checked by the service


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(Body):
    """SGLang's ``SamplingParams`` (API fields). ``null`` = the default, as in SGLang."""

    max_new_tokens: int | None = Field(default=128, ge=0, le=HARD_MAX_NEW_TOKENS)  # None: up to the limit
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: list[str] | str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)  # 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # -1 = whole vocabulary; 0 is refused, as SGLang does
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_new_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=1024)
    json_schema: str | None = None  # refused: no constrained decoding
    regex: str | None = None  # refused
    ebnf: str | None = None  # refused
    structural_tag: str | None = None  # refused
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: dict[str, Any] | None = None  # only read by a custom logit processor (none here)
    stream_interval: int | None = Field(default=None, ge=1)  # tokens between streamed chunks
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(default=None, ge=0, lt=1 << 63)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keep_null = {"max_new_tokens"}
            return {k: v for k, v in data.items() if v is not None or k in keep_null}
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k_is_off_or_positive(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (disable), or at least 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias key {key!r} is not a token id")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or [] if s]

    def stop_regexes(self) -> list[str]:
        return [self.stop_regex] if isinstance(self.stop_regex, str) else [s for s in self.stop_regex or [] if s]


OneOrMany = Any  # a value, or a list with one value per prompt (checked by `expand`)


class GenerateBody(Body):
    """SGLang's ``GenerateReqInput`` plus one extension (``continue_across_weight_updates``)."""

    rid: str | list[str] | None = None
    session_id: str | None = Field(default=None, max_length=256)  # identity only, as in SGLang
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_sampling_mask: bool | list[bool] | None = None
    return_text_in_logprobs: bool = False
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(default=0, ge=0)
    return_indexer_topk: bool = False
    modalities: list[str] | None = None
    session_params: dict[str, Any] | None = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    kv_router_hint: dict[str, Any] | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    http_worker_ipc: str | None = None
    background: bool = False
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    return_bytes: bool = False
    return_entropy: bool = False
    return_prompt_token_ids: bool = False
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: Any = None
    encoder_urls: list[str] | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    images_config: dict[str, Any] | None = None
    multi_item_delimiter_indices: Any = None
    cache_salt: str | list[str] | None = None
    # Extension: this request may run across a weight update (tokens tagged per version).
    continue_across_weight_updates: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateBody:
        given = [n for n in ("text", "input_ids", "input_embeds") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'text', 'input_ids' and 'input_embeds'")
        if isinstance(self.input_ids, list) and not self.input_ids:
            raise ValueError("input_ids cannot be empty")
        if self.session_id is not None and self.session_params is not None:
            raise ValueError("session_id and session_params cannot both be set")
        return self


def refusals(body: GenerateBody, sampling: list[SamplingParams]) -> None:
    """Raise UnsupportedField for the first refused field that is set (see `REFUSED`)."""
    for name, why in REFUSED.items():
        if name.startswith("sampling_params."):
            sub = name.split(".", 1)[1]
            if any(is_set(getattr(sp, sub)) for sp in sampling):
                raise UnsupportedField(name, why)
        elif is_set(getattr(body, name)) and not (isinstance(getattr(body, name), list)
                                                    and not any(is_set(x) for x in getattr(body, name))):
            raise UnsupportedField(name, why)
    for name in ("routed_dp_rank", "data_parallel_rank"):
        if getattr(body, name) not in (None, 0):
            raise UnsupportedField(name, "this engine has one data-parallel rank (0)")


@dataclass(frozen=True)
class Item:
    """One sample of a (possibly batched) request, after SGLang's normalisation."""

    index: int  # position in the response list
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: tuple[int, ...]


def _per_prompt(value: Any, batch: int, name: str, default: Any, nested: bool = False) -> list[Any]:
    """`value` for each of `batch` prompts: one value for all, or a list of `batch` values."""
    if value is None:
        return [default] * batch
    is_list = isinstance(value, list) and (not nested or (bool(value) and isinstance(value[0], list)))
    if not is_list:
        return [value] * batch
    if len(value) != batch:
        raise ValueError(f"{name}: {len(value)} values for a batch of {batch} prompts")
    return [default if v is None else v for v in value]


def expand(body: GenerateBody) -> tuple[bool, list[Item]]:
    """(is_single, one Item per sample) following SGLang's batch normalisation; ValueError names the field."""
    if body.text is not None:
        prompts_text: list[str | None] = [body.text] if isinstance(body.text, str) else list(body.text)
        prompts_ids: list[list[int] | None] = [None] * len(prompts_text)
        single = isinstance(body.text, str)
    else:
        ids = body.input_ids or []
        single = bool(ids) and not isinstance(ids[0], list)
        prompts_ids = [cast(list[int], ids)] if single else [list(p) for p in cast(list[list[int]], ids)]
        prompts_text = [None] * len(prompts_ids)
        if any(not p for p in prompts_ids):
            raise ValueError("input_ids: a prompt is empty")
    batch = len(prompts_ids)
    if batch == 0:
        raise ValueError("text/input_ids: the batch is empty")
    raw_sp = body.sampling_params
    if isinstance(raw_sp, list) and len(raw_sp) != batch:
        raise ValueError(f"sampling_params: {len(raw_sp)} values for a batch of {batch} prompts")
    sps = [SamplingParams.model_validate(d or {}) for d in _per_prompt(raw_sp, batch, "sampling_params", {})]
    n = sps[0].n
    if any(sp.n != n for sp in sps):
        raise ValueError("sampling_params.n must be the same for every prompt")
    single = single and n == 1
    logprob = _per_prompt(body.return_logprob, batch, "return_logprob", False)
    start = _per_prompt(body.logprob_start_len, batch, "logprob_start_len", -1)
    top = _per_prompt(body.top_logprobs_num, batch, "top_logprobs_num", 0)
    tids = _per_prompt(body.token_ids_logprob, batch, "token_ids_logprob", [], nested=True)
    rids = _rids(body.rid, batch, n)
    items = []
    for i in range(batch):
        for j in range(n):
            k = i * n + j
            items.append(Item(k, rids[k], prompts_text[i], prompts_ids[i], sps[i], bool(logprob[i]),
                              int(start[i]), int(top[i]), tuple(int(t) for t in tids[i] or ())))
    return single, items


def _rids(rid: str | list[str] | None, batch: int, n: int) -> list[str]:
    total = batch * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str):
        return [rid] if total == 1 else [f"{rid}_{k}" for k in range(total)]
    if len(rid) != batch:
        raise ValueError(f"rid: {len(rid)} ids for a batch of {batch} prompts")
    if len(set(rid)) != len(rid):
        raise ValueError("rid: duplicate request ids within the request")
    return list(rid) if n == 1 else [f"{r}_{j}" for r in rid for j in range(n)]


class AbortBody(Body):
    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None  # SGLang: the message of the aborted requests' finish_reason

    @model_validator(mode="after")
    def _target(self) -> AbortBody:
        if not self.rid and not self.abort_all:
            raise ValueError("give a 'rid' or 'abort_all': true")
        return self


class PauseBody(Body):
    mode: Literal["abort", "in_place", "retract"] = "abort"


LOAD_FORMATS = ("auto", "safetensors")


class UpdateWeightsBody(Body):
    """SGLang's ``UpdateWeightFromDiskReqInput``."""

    model_path: str = Field(min_length=1)
    load_format: str | None = None  # None / "auto" / "safetensors"; others are refused (400)
    weight_version: str | None = Field(default=None, min_length=1, max_length=128)
    abort_all_requests: bool = False  # abort in-flight requests instead of letting them finish
    flush_cache: bool = True  # no prefix cache here: nothing to flush
    recapture_cuda_graph: bool = False  # no CUDA graphs on this engine: nothing to recapture
    is_async: bool = False  # refused when true: updates here always complete before the answer
    keep_pause: bool = False  # a paused engine stays paused either way (only continue_generation resumes)
    torch_empty_cache: bool = False  # no CUDA cache on CPU: nothing to empty
    token_step: int = 0  # accepted for compatibility (SGLang: a training-step label)

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    def refusals(self) -> None:
        if self.load_format not in (None, *LOAD_FORMATS):
            raise UnsupportedField("load_format", f"{self.load_format!r} is not supported; use one of {LOAD_FORMATS}")
        if self.is_async:
            raise UnsupportedField("is_async", "asynchronous updates are not supported; the update completes "
                                               "before the response")


def _entries(pairs: list[tuple[float | None, int]], texts: list[str | None] | None) -> list[list[Any]]:
    ts: list[str | None] = list(texts) if texts else [None] * len(pairs)
    return [[lp, tok, t] for (lp, tok), t in zip(pairs, ts, strict=True)]


def render(result: GenResult, item: Item, prompt_ids: list[int], text: str, latency_s: float,
           decode_one: Any | None, with_text: bool, final: bool = True) -> dict[str, Any]:
    """The SGLang ``/generate`` response object for `result` (`decode_one(id) -> str` for texts)."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason if final else None,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "output_token_versions": result.output_versions,
        "e2e_latency": round(latency_s, 6),
    }
    if item.return_logprob:
        def texts(ids: list[int]) -> list[str | None] | None:
            return [decode_one(t) for t in ids] if with_text and decode_one is not None else None

        def tops(rows: list[list[tuple[float, int]] | None]) -> list[list[list[Any]] | None]:
            return [None if r is None else _entries(list(r), texts([t for _, t in r])) for r in rows]

        pairs = list(zip(result.output_logprobs, result.output_ids, strict=True))
        meta["output_token_logprobs"] = _entries(pairs, texts(result.output_ids))  # type: ignore[arg-type]  # list invariance: float is float | None
        if result.input_logprobs is not None:
            ids = prompt_ids[item.logprob_start_len:]
            meta["input_token_logprobs"] = _entries(list(zip(result.input_logprobs, ids, strict=True)), texts(ids))
        if result.output_top_logprobs is not None:
            meta["output_top_logprobs"] = tops(list(result.output_top_logprobs))
        if result.input_top_logprobs is not None:
            meta["input_top_logprobs"] = tops(result.input_top_logprobs)
        if result.output_token_ids_logprobs is not None:
            meta["output_token_ids_logprobs"] = tops(list(result.output_token_ids_logprobs))
        if result.input_token_ids_logprobs is not None:
            meta["input_token_ids_logprobs"] = tops(result.input_token_ids_logprobs)
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}
