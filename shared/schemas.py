"""Wire schemas of contract v2 (docs/streams.md): the only shapes that cross a stream.

Every model forbids unknown fields, so a producer that drifts from the contract is caught at
the consumer's edge (``shared.codec.decode_entry``) and dead-lettered, never half-read.
Versions are opaque strings; ``None`` means "no real version" (see ``shared.staleness.real_version``).
v2 types what v1 carried in ``meta``: a rollout group's prompt, error code and ``retryable`` flag,
and a prompt group's retry history. ``shared.schema_v1`` turns a v1 body into v2.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, model_validator

from shared import packed

SCHEMA_VERSION = "2"
MAX_ERROR_CHARS = 1000  # error text kept on the wire (failed groups, retry records, dead letters)

# Bounds that keep a single entry from exhausting a consumer's memory.
MAX_SAMPLES_PER_GROUP = 4096
MAX_TOKENS_PER_SAMPLE = 1 << 20
MAX_GROUPS_PER_BATCH = 4096
MAX_ATTEMPT = 1000  # rollout.max_retries <= 100: a larger attempt number is forged or corrupt
_MASK_VALUES = frozenset((0, 1))


class _Wire(BaseModel):
    # allow_inf_nan=False: a NaN reward or an infinite logprob is malformed at the edge (dead-lettered), never trained
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=False, allow_inf_nan=False)


class Message(_Wire):
    """One chat message."""

    role: str = Field(min_length=1, max_length=64)  # "system" | "user" | "assistant" | "tool" | ...
    content: str  # message text


class RetryRecord(_Wire):
    """One earlier attempt of a prompt group and why it did not train (written by the collector)."""

    attempt: int = Field(ge=0, le=MAX_ATTEMPT)  # the attempt that failed or was dropped
    reason: Literal["stale", "failed"]  # dropped by the version window, or the attempt failed
    error: str = Field(max_length=MAX_ERROR_CHARS)  # the failure's text (or the staleness note)
    at: float = 0.0  # unix seconds of the decision


class PromptGroup(_Wire):
    """A prompt to roll out ``n_samples`` times as one GRPO group (kind ``prompt_group``)."""

    group_id: str = Field(min_length=1, max_length=256)  # stable across attempts of the same prompt group
    prompt_id: str = Field(min_length=1, max_length=256)  # dataset row id
    task: str = Field(min_length=1, max_length=256)  # task name: built-in, entry point or import path (shared.tasks)
    prompt: str | list[Message]  # raw prompt text, or chat messages
    reference: Any = None  # whatever the task's verifier needs (answer, hidden number, ...)
    row: dict[str, Any] | None = None  # a plugin task's dataset row as read (its hooks get it); None: built-in task
    n_samples: int = Field(ge=1, le=MAX_SAMPLES_PER_GROUP)  # trajectories per group
    attempt: int = Field(default=0, ge=0, le=MAX_ATTEMPT)  # 0 for the first try; +1 per re-enqueue
    enqueued_at: float = 0.0  # unix seconds when this attempt entered {p}:prompts
    retry_history: list[RetryRecord] = Field(default_factory=list)  # one record per earlier attempt, oldest first
    meta: dict[str, Any] = Field(default_factory=dict)  # free-form (epoch, dataset index)


class VersionSpan(_Wire):
    """Run of tokens ``[start, end)`` produced by one weight version (``"-1"`` for context)."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    version: str


class Sample(_Wire):
    """One trainable segment of one trajectory; all per-token lists have the same length."""

    traj_id: str = Field(min_length=1, max_length=256)  # the proxy session id of the whole trajectory
    segment_index: int = Field(default=0, ge=0)  # order of this segment inside the trajectory
    token_ids: list[int]  # prompt + response token ids
    loss_mask: list[int]  # 1 = model-generated token that may carry loss, else 0
    logprobs: list[float]  # behaviour-policy logprob per token; 0.0 where loss_mask is 0
    token_versions: list[str]  # weight version that produced each token; "-1" for context tokens
    version_spans: list[VersionSpan] = Field(default_factory=list)  # run-length form of token_versions
    start_version: str | None = None  # first real version among loss tokens; None if there is none
    end_version: str | None = None  # last real version among loss tokens; None if there is none
    reward: float = 0.0  # trajectory reward on the last segment, 0.0 on earlier ones
    finish_reason: str = "stop"  # "stop" | "length" | "abort" | ...
    partial_rollout: bool = False  # loss tokens carry two or more real versions
    meta: dict[str, Any] = Field(default_factory=dict)  # free-form

    # Wire cache (shared.codec). ``_lazy``: packed arrays not yet turned into lists (name -> raw bytes);
    # they become lists on first access, so a consumer that never reads tokens (the collector) never
    # pays for them. ``_packed``: (list as decoded, its raw bytes); encoding reuses the bytes while the
    # list still equals the decoded one, so a pass-through hop never repacks tokens.
    _lazy: dict[str, bytes] = PrivateAttr(default_factory=dict)
    _packed: dict[str, tuple[list[Any], bytes]] = PrivateAttr(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        private = self.__dict__.get("__pydantic_private__") or object.__getattribute__(self, "__pydantic_private__")
        lazy = private.get("_lazy") if private else None
        if lazy and name in lazy:
            raw = lazy.pop(name)
            values = packed.unpack(raw, packed.TYPECODES[name])
            self.__dict__[name] = values
            private["_packed"][name] = (values.copy(), raw)
            return values
        return super().__getattr__(name)  # type: ignore[misc]  # pydantic defines __getattr__ only when not TYPE_CHECKING

    def materialize(self) -> Sample:
        """Turn every lazily held array into its list (before copying or dumping the model)."""
        lazy = self.__pydantic_private__["_lazy"]  # type: ignore[index]  # set: the model declares private attrs
        for name in list(lazy):
            getattr(self, name)
        return self

    def defer_arrays(self, arrays: dict[str, bytes], version_runs: list[Any] | None) -> None:
        """For the codec: hold the packed ``arrays`` (field name -> raw bytes) unread until first access,
        and remember the ``token_versions`` runs they arrived as (both re-sent as they are while unchanged)."""
        private: dict[str, Any] = self.__pydantic_private__  # type: ignore[assignment]  # declared above
        for name in arrays:
            del self.__dict__[name]
        private["_lazy"].update(arrays)
        if version_runs is not None:
            private["_packed"]["token_versions"] = (self.token_versions.copy(), version_runs)

    def wire_form(self, name: str) -> Any:
        """What field ``name`` arrived as on the wire (packed bytes, or ``token_versions`` runs) while it is
        unchanged since; None when it was never decoded from the wire or has changed."""
        private: dict[str, Any] = self.__pydantic_private__  # type: ignore[assignment]  # declared above
        raw = private["_lazy"].get(name)
        if raw is not None:  # never materialized: the bytes are still exactly what arrived
            return raw
        hit = private["_packed"].get(name)
        return hit[1] if hit is not None and hit[0] == getattr(self, name) else None

    def field_len(self, name: str) -> int:
        """Length of a per-token field without materializing a lazy array."""
        raw = self.__pydantic_private__["_lazy"].get(name)  # type: ignore[index]  # set: the model declares private attrs
        return len(raw) // packed.ITEMSIZE[name] if raw is not None else len(getattr(self, name))

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        return super().model_dump(**self.materialize() and kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        return super().model_dump_json(**self.materialize() and kwargs)

    def model_copy(self, *args: Any, **kwargs: Any) -> Sample:
        return super().model_copy(*args, **self.materialize() and kwargs)

    def __repr_args__(self) -> Any:
        return super(Sample, self.materialize()).__repr_args__()

    @model_validator(mode="after")
    def _aligned(self, info: ValidationInfo) -> Sample:
        if not (info.context or {}).get("arrays_deferred"):  # the codec attaches packed arrays, then checks
            self.check_aligned()
        return self

    def __eq__(self, other: object) -> bool:  # the wire cache is not part of a sample's value
        if not isinstance(other, Sample):
            return False
        self.materialize(), other.materialize()
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable model with a value __eq__: unhashable, as pydantic's

    def check_aligned(self, check_mask: bool = True) -> None:
        """All per-token lists have one length, within bounds, and the mask is 0/1 (ValueError otherwise)."""
        n = self.field_len("token_ids")
        if n > MAX_TOKENS_PER_SAMPLE:
            raise ValueError(f"token_ids: {n} tokens exceeds the limit {MAX_TOKENS_PER_SAMPLE}")
        for name in ("loss_mask", "logprobs"):
            if self.field_len(name) != n:
                raise ValueError(f"{name}: length {self.field_len(name)} != len(token_ids) {n}")
        if len(self.token_versions) != n:
            raise ValueError(f"token_versions: length {len(self.token_versions)} != len(token_ids) {n}")
        if check_mask and not _MASK_VALUES.issuperset(self.loss_mask):
            raise ValueError("loss_mask: every value must be 0 or 1")
        raw = self.__pydantic_private__["_lazy"].get("logprobs")  # type: ignore[index]  # set: the model declares private attrs
        if raw is not None and not packed.finite_f32(raw):  # the list form is checked by pydantic (allow_inf_nan)
            raise ValueError("logprobs: NaN or infinite values are not allowed")


class RolloutGroup(_Wire):
    """The outcome of one attempt of a prompt group (kind ``rollout_group``)."""

    group_id: str = Field(min_length=1, max_length=256)
    prompt_id: str = Field(min_length=1, max_length=256)
    attempt: int = Field(ge=0, le=MAX_ATTEMPT)
    status: Literal["completed", "failed"]
    error: str | None = None  # failure text (failed only): "<error_code>: <message> (session <id>)"
    error_code: str | None = None  # failed only: a code of shared.codes (the policy reads this, not the text)
    retryable: bool = True  # failed only: False when no other attempt can succeed (dead-lettered at once)
    prompt_group: PromptGroup | None = None  # this attempt's prompt, to re-enqueue; None inside a Batch
    samples: list[Sample] = Field(default_factory=list, max_length=MAX_SAMPLES_PER_GROUP)
    meta: dict[str, Any] = Field(default_factory=dict)  # task, n_samples, rollout_started_at/finished_at, worker, ...

    def last_segments(self) -> list[Sample]:
        """The highest-``segment_index`` sample of each trajectory (later sample wins ties)."""
        last: dict[str, Sample] = {}
        for s in self.samples:
            cur = last.get(s.traj_id)
            if cur is None or cur.segment_index <= s.segment_index:
                last[s.traj_id] = s
        return list(last.values())

    @property
    def end_versions(self) -> list[str]:
        """One end version per trajectory (last segment), "" where the trajectory has none."""
        return [s.end_version or "" for s in self.last_segments()]

    @property
    def reward_mean(self) -> float:
        """Mean trajectory reward (read from each trajectory's last segment)."""
        last = self.last_segments()
        return sum(s.reward for s in last) / len(last) if last else 0.0


class Window(_Wire):
    """The staleness window in force when a batch was assembled."""

    keep_versions: int = Field(ge=0)  # 0 = filter off
    current_version: str | None = None  # newest version in the window
    cutoff_version: str | None = None  # oldest version still admitted


class Batch(_Wire):
    """A trainer batch of complete GRPO groups (kind ``batch``)."""

    batch_id: str = Field(min_length=1, max_length=256)
    groups: list[RolloutGroup] = Field(max_length=MAX_GROUPS_PER_BATCH)  # without their prompt_group
    trainer_version: str | None = None  # latest published version when the batch was assembled
    window: Window
    meta: dict[str, Any] = Field(default_factory=dict)

    @property
    def group_id(self) -> str:
        return self.batch_id

    @property
    def attempt(self) -> int:
        return 0


class DeadLetter(_Wire):
    """A message that will never be processed, kept with its original bytes (kind ``dead_letter``)."""

    reason: str  # "retries_exhausted" | "stale_retries_exhausted" | "malformed" | ...
    error: str  # human-readable cause
    source_stream: str
    source_id: str
    fields: dict[str, bytes] = Field(default_factory=dict)  # the original entry, bytes intact


class WeightVersion(_Wire):
    """A published weight version (``{p}:weights:latest`` JSON and ``{p}:weights:log`` entry)."""

    version: str = Field(min_length=1, max_length=128)
    path: str  # complete HF checkpoint directory on the checkpoint volume
    step: int = Field(ge=0)  # trainer optimizer step that produced it
    published_at: float  # unix seconds


WireModel = PromptGroup | RolloutGroup | Batch | DeadLetter
