"""msgpack codec for stream entries (docs/streams.md): plain fields for humans, ``body`` for machines.

Encoding: each entry carries plain, human-readable fields (``schema``, ``kind``, ``group_id``,
``attempt``, ...) so ``redis-cli XRANGE`` shows what is in flight, plus ``body``: the full record as
msgpack (``use_bin_type=True``). Per-token arrays of a ``Sample`` travel as raw little-endian bytes —
``token_ids`` int32, ``logprobs`` float32, ``loss_mask`` uint8 — because packing Python lists is
30–50× slower (``bench/streams_hop.py`` measures the hop); ``token_versions`` travels run-length
encoded as ``[[version, count], ...]``. Plain lists are accepted on decode too (hand-written entries).
Packed arrays are typed by construction, so decoding checks only their shape (lengths, 0/1 mask)
instead of validating every token, and a decoded sample keeps its packed bytes: re-encoding an
unchanged sample (the collector's pass-through hop) reuses them instead of packing again.

Decoding is the edge: anything wrong — bad bytes, truncated msgpack, wrong ``schema`` or ``kind``,
missing or mistyped fields, oversized containers — raises ``MalformedEntry`` with the reason and
nothing else. Nothing is ever unpickled. Entries of schema ``"1"`` are read as v2
(``shared.schema_v1``); the one v1 shape v2 cannot take over raises ``UnsupportedSchema``.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import groupby
from typing import Any, TypeVar, cast

import msgpack
from pydantic import BaseModel, ValidationError

from shared import packed, schema_v1
from shared.errors import MalformedEntry
from shared.schemas import (
    MAX_ERROR_CHARS,
    MAX_GROUPS_PER_BATCH,
    MAX_SAMPLES_PER_GROUP,
    MAX_TOKENS_PER_SAMPLE,
    SCHEMA_VERSION,
    Batch,
    DeadLetter,
    PromptGroup,
    RolloutGroup,
    Sample,
)

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 256 * 1024 * 1024  # refuse bodies larger than this before unpacking
# Explicit container limits: a hostile body cannot make the unpacker allocate more than this.
_LIMITS = {"max_bin_len": MAX_BODY_BYTES, "max_str_len": 16 * 1024 * 1024, "max_array_len": 1 << 21,
           "max_map_len": 1 << 16, "max_ext_len": 0}

KINDS: dict[type[BaseModel], str] = {
    PromptGroup: "prompt_group",
    RolloutGroup: "rollout_group",
    Batch: "batch",
    DeadLetter: "dead_letter",
}
_PACKED = packed.TYPECODES
_UPGRADES_V1: dict[type[BaseModel], Any] = {PromptGroup: schema_v1.prompt_group,
                                             RolloutGroup: schema_v1.rollout_group, Batch: schema_v1.batch}


def _rle(versions: list[str]) -> list[list[Any]]:
    return [[v, len(list(run))] for v, run in groupby(versions)]


def _unrle(runs: list[Any], where: str) -> list[str]:
    out: list[str] = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and isinstance(run[0], str) and isinstance(run[1], int)
                and 0 <= run[1] <= MAX_TOKENS_PER_SAMPLE):
            raise MalformedEntry(f"{where}: expected [version, count] runs, got {str(run)[:80]}")
        out.extend([run[0]] * run[1])
        if len(out) > MAX_TOKENS_PER_SAMPLE:
            raise MalformedEntry(f"{where}: more than {MAX_TOKENS_PER_SAMPLE} tokens")
    return out


def _sample_to_wire(sample: Sample) -> dict[str, Any]:
    out = sample.__dict__.copy()  # field values; arrays still lazy are absent and come from the cache
    out["version_spans"] = [span.model_dump() for span in sample.version_spans]
    for name, code in _PACKED.items():
        raw = sample.wire_form(name)
        out[name] = raw if raw is not None else packed.pack(getattr(sample, name), code)
    runs = sample.wire_form("token_versions")
    out["token_versions"] = runs if runs is not None else _rle(sample.token_versions)
    return out


def _sample_from_wire(raw: Any, where: str) -> Sample:
    """Validate one sample; packed arrays are typed by construction, so only their shape is checked
    and they stay bytes until someone reads them (``Sample.__getattr__``)."""
    if not isinstance(raw, dict):
        raise MalformedEntry(f"{where}: expected a map, got {type(raw).__name__}")
    head = dict(raw)
    lazy: dict[str, bytes] = {}
    for name in _PACKED:
        value = head.get(name)
        if isinstance(value, (bytes, bytearray)):
            if len(value) % packed.ITEMSIZE[name]:
                raise MalformedEntry(f"{where}.{name}: {len(value)} bytes is not a multiple of {packed.ITEMSIZE[name]}")
            lazy[name] = bytes(value)
            head[name] = []
    versions = head.get("token_versions")
    runs = None
    if isinstance(versions, list) and versions and isinstance(versions[0], list):
        runs = versions
        head["token_versions"] = _unrle(versions, f"{where}.token_versions")
    mask = lazy.get("loss_mask")
    try:
        sample = Sample.model_validate(head, context={"arrays_deferred": True})
        sample.defer_arrays(lazy, runs)
        if mask is not None and mask.translate(None, b"\x00\x01"):  # bytes-level 0/1 check, no per-token loop
            raise ValueError("loss_mask: every value must be 0 or 1")
        sample.check_aligned(check_mask=mask is None)
    except ValidationError as exc:
        raise _malformed(exc, where) from exc
    except ValueError as exc:
        raise MalformedEntry(f"{where}: {exc}") from exc
    return sample


def _group_to_wire(group: RolloutGroup) -> dict[str, Any]:
    out = group.model_dump(mode="python", exclude={"samples"})
    out["samples"] = [_sample_to_wire(s) for s in group.samples]
    return out


def _group_from_wire(raw: Any, where: str) -> Any:
    if isinstance(raw, dict) and isinstance(raw.get("samples"), list):
        if len(raw["samples"]) > MAX_SAMPLES_PER_GROUP:
            raise MalformedEntry(f"{where}.samples: more than {MAX_SAMPLES_PER_GROUP} samples")
        return {**raw, "samples": [_sample_from_wire(s, f"{where}.samples.{i}") for i, s in enumerate(raw["samples"])]}
    return raw  # the schema reports what is wrong


def _to_wire(model: BaseModel) -> dict[str, Any]:
    if isinstance(model, RolloutGroup):
        return _group_to_wire(model)
    if isinstance(model, Batch):
        data = model.model_dump(mode="python", exclude={"groups"})
        data["groups"] = [_group_to_wire(g) for g in model.groups]
        return data
    return model.model_dump(mode="python")


def _from_wire(data: dict[str, Any], kind: type[BaseModel]) -> dict[str, Any]:
    if kind is RolloutGroup:
        return cast(dict[str, Any], _group_from_wire(data, "RolloutGroup"))
    if kind is Batch and isinstance(data.get("groups"), list):
        if len(data["groups"]) > MAX_GROUPS_PER_BATCH:
            raise MalformedEntry(f"Batch.groups: more than {MAX_GROUPS_PER_BATCH} groups")
        return {**data, "groups": [_group_from_wire(g, f"Batch.groups.{i}") for i, g in enumerate(data["groups"])]}
    return data


def _malformed(exc: ValidationError, where: str) -> MalformedEntry:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return MalformedEntry(f"{where}{'.' + loc if loc else ''}: {first.get('msg')} ({exc.error_count()} error(s))")


def _plain(model: BaseModel) -> dict[str, str]:
    """Human-readable fields of an entry (docs/streams.md, stream entries)."""
    if isinstance(model, PromptGroup):
        return {"group_id": model.group_id, "attempt": str(model.attempt), "prompt_id": model.prompt_id,
                "task": model.task, "n_samples": str(model.n_samples)}
    if isinstance(model, RolloutGroup):
        plain = {"group_id": model.group_id, "attempt": str(model.attempt), "prompt_id": model.prompt_id,
                 "status": model.status, "end_versions": ",".join(model.end_versions),
                 "reward_mean": f"{model.reward_mean:.6g}"}
        if model.status == "failed":
            plain["error"] = (model.error or "")[:MAX_ERROR_CHARS]
            plain["error_code"] = model.error_code or ""
        return plain
    if isinstance(model, Batch):
        versions = sorted({v for g in model.groups for v in g.end_versions if v})
        return {"group_id": model.batch_id, "attempt": "0", "batch_id": model.batch_id,
                "n_groups": str(len(model.groups)), "versions": ",".join(versions),
                "trainer_version": model.trainer_version or ""}
    if isinstance(model, DeadLetter):
        return {"reason": model.reason, "source_stream": model.source_stream, "source_id": model.source_id,
                "error": model.error[:MAX_ERROR_CHARS]}
    raise TypeError(f"not a wire model: {type(model).__name__}")


def encode_body(model: BaseModel) -> bytes:
    return cast(bytes, msgpack.packb(_to_wire(model), use_bin_type=True))


def encode_entry(model: BaseModel) -> dict[str, bytes]:
    """Stream fields for ``model``: plain fields + ``body``."""
    fields = {"schema": SCHEMA_VERSION, "kind": KINDS[type(model)], **_plain(model)}
    out = {k: v.encode() for k, v in fields.items()}
    out["body"] = encode_body(model)
    return out


def _text(fields: Mapping[Any, Any], name: str) -> str | None:
    raw = fields.get(name.encode(), fields.get(name))
    if raw is None:
        return None
    if isinstance(raw, (bytes, bytearray)):
        try:
            return bytes(raw).decode()
        except UnicodeDecodeError as exc:
            raise MalformedEntry(f"field {name!r} is not UTF-8") from exc
    return str(raw)


def decode_body(raw: Any, kind: type[M], schema: str = SCHEMA_VERSION) -> M:
    """Validate a msgpack ``body`` of contract ``schema`` as ``kind``; raises MalformedEntry."""
    if isinstance(raw, str):
        raw = raw.encode("latin-1", errors="replace")
    if not isinstance(raw, (bytes, bytearray)):
        raise MalformedEntry("body: missing or not bytes")
    if len(raw) > MAX_BODY_BYTES:
        raise MalformedEntry(f"body: {len(raw)} bytes exceeds the limit {MAX_BODY_BYTES}")
    try:
        data = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True, **_LIMITS)
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as exc:
        raise MalformedEntry(f"body: not valid msgpack ({type(exc).__name__}: {exc})"[:500]) from exc
    except Exception as exc:  # msgpack raises a zoo of errors on garbage; all mean "malformed"
        raise MalformedEntry(f"body: not valid msgpack ({type(exc).__name__})") from exc
    if not isinstance(data, dict):
        raise MalformedEntry(f"body: expected a map, got {type(data).__name__}")
    if schema == schema_v1.V1 and kind in _UPGRADES_V1:
        data = _UPGRADES_V1[kind](data)
    try:
        # Samples were validated one by one above; the context stops their re-check inside the group.
        return kind.model_validate(_from_wire(data, kind), context={"arrays_deferred": True})
    except ValidationError as exc:
        raise _malformed(exc, kind.__name__) from exc
    except RecursionError as exc:
        raise MalformedEntry("body: nested too deeply") from exc


def decode_entry(fields: Mapping[Any, Any], kind: type[M]) -> M:
    """Decode and validate a stream entry as ``kind``; raises MalformedEntry naming the problem."""
    if not isinstance(fields, Mapping):
        raise MalformedEntry("entry: fields are not a map")
    schema = _text(fields, "schema")
    if schema not in (SCHEMA_VERSION, schema_v1.V1):
        raise MalformedEntry(f"field 'schema': expected {SCHEMA_VERSION!r} (or {schema_v1.V1!r}), got {schema!r}")
    want = KINDS[kind]
    got = _text(fields, "kind")
    if got != want:
        raise MalformedEntry(f"field 'kind': expected {want!r}, got {got!r}")
    model = decode_body(fields.get(b"body", fields.get("body")), kind, schema)
    group_id = _text(fields, "group_id")
    if group_id is not None and group_id != getattr(model, "group_id", group_id):
        raise MalformedEntry(f"field 'group_id': plain {group_id!r} does not match the body")
    return model


def entry_ids(fields: Mapping[Any, Any]) -> dict[str, str]:
    """Best-effort ``group_id``/``attempt`` of a (possibly malformed) entry, for log lines."""
    out: dict[str, str] = {}
    for name in ("group_id", "attempt", "kind"):
        try:
            value = _text(fields, name)
        except MalformedEntry:
            value = None
        if value is not None:
            out[name] = value[:128]
    return out
