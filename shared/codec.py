"""msgpack codec for stream entries (ARCHITECTURE §5): plain fields for humans, ``body`` for machines.

Encoding: each entry carries plain, human-readable fields (``schema``, ``kind``, ``group_id``,
``attempt``, ...) so ``redis-cli XRANGE`` shows what is in flight, plus ``body``: the full record as
msgpack (``use_bin_type=True``). Per-token arrays of a ``Sample`` travel as raw little-endian bytes —
``token_ids`` int32, ``logprobs`` float32, ``loss_mask`` uint8 — because packing Python lists is
30–50× slower (``bench/streams_hop.py`` measures the hop). ``token_versions`` stays a list of str.

Decoding is the edge: anything wrong — bad bytes, truncated msgpack, wrong ``schema`` or ``kind``,
missing or mistyped fields, oversized containers — raises ``MalformedEntry`` with the reason and
nothing else. Nothing is ever unpickled.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import msgpack
from pydantic import BaseModel, ValidationError

from shared.errors import MalformedEntry
from shared.schemas import SCHEMA_VERSION, Batch, DeadLetter, PromptGroup, RolloutGroup

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 256 * 1024 * 1024  # refuse bodies larger than this before unpacking
_LITTLE = sys.byteorder == "little"
# Explicit container limits: a hostile body cannot make the unpacker allocate more than this.
_LIMITS = {"max_bin_len": MAX_BODY_BYTES, "max_str_len": 16 * 1024 * 1024, "max_array_len": 1 << 21,
           "max_map_len": 1 << 16, "max_ext_len": 0}

KINDS: dict[type[BaseModel], str] = {
    PromptGroup: "prompt_group",
    RolloutGroup: "rollout_group",
    Batch: "batch",
    DeadLetter: "dead_letter",
}
_PACKED = {"token_ids": "i", "logprobs": "f", "loss_mask": "B"}  # array typecodes of packed Sample fields


def _pack_array(values: list[Any], code: str) -> bytes:
    arr = array(code, values)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def _unpack_array(raw: Any, code: str, name: str) -> list[Any]:
    if isinstance(raw, list):  # lists are accepted too (hand-written entries, other producers)
        return raw
    if not isinstance(raw, (bytes, bytearray)):
        raise MalformedEntry(f"{name}: expected bytes or list, got {type(raw).__name__}")
    arr = array(code)
    if len(raw) % arr.itemsize:
        raise MalformedEntry(f"{name}: {len(raw)} bytes is not a multiple of {arr.itemsize}")
    arr.frombytes(raw)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def _sample_to_wire(sample: dict[str, Any]) -> dict[str, Any]:
    out = dict(sample)
    for name, code in _PACKED.items():
        out[name] = _pack_array(sample[name], code)
    return out


def _sample_from_wire(sample: Any) -> Any:
    if not isinstance(sample, dict):
        return sample  # the schema reports the type error
    out = dict(sample)
    for name, code in _PACKED.items():
        if name in out:
            out[name] = _unpack_array(out[name], code, f"samples[].{name}")
    return out


def _group_to_wire(group: dict[str, Any]) -> dict[str, Any]:
    return {**group, "samples": [_sample_to_wire(s) for s in group["samples"]]}


def _group_from_wire(group: Any) -> Any:
    if isinstance(group, dict) and isinstance(group.get("samples"), list):
        return {**group, "samples": [_sample_from_wire(s) for s in group["samples"]]}
    return group


def _to_wire(model: BaseModel) -> dict[str, Any]:
    data = model.model_dump(mode="python")
    if isinstance(model, RolloutGroup):
        return _group_to_wire(data)
    if isinstance(model, Batch):
        data["groups"] = [_group_to_wire(g) for g in data["groups"]]
    return data


def _from_wire(data: dict[str, Any], kind: type[BaseModel]) -> dict[str, Any]:
    if kind is RolloutGroup:
        return cast(dict[str, Any], _group_from_wire(data))
    if kind is Batch and isinstance(data.get("groups"), list):
        return {**data, "groups": [_group_from_wire(g) for g in data["groups"]]}
    return data


def _plain(model: BaseModel) -> dict[str, str]:
    """Human-readable fields of an entry (ARCHITECTURE §5 table)."""
    if isinstance(model, PromptGroup):
        return {"group_id": model.group_id, "attempt": str(model.attempt), "prompt_id": model.prompt_id,
                "task": model.task, "n_samples": str(model.n_samples)}
    if isinstance(model, RolloutGroup):
        plain = {"group_id": model.group_id, "attempt": str(model.attempt), "prompt_id": model.prompt_id,
                 "status": model.status, "end_versions": ",".join(model.end_versions),
                 "reward_mean": f"{model.reward_mean:.6g}"}
        if model.status == "failed":
            plain["error"] = (model.error or "")[:1000]
        return plain
    if isinstance(model, Batch):
        versions = sorted({v for g in model.groups for v in g.end_versions if v})
        return {"group_id": model.batch_id, "attempt": "0", "batch_id": model.batch_id,
                "n_groups": str(len(model.groups)), "versions": ",".join(versions),
                "trainer_version": model.trainer_version or ""}
    if isinstance(model, DeadLetter):
        return {"reason": model.reason, "source_stream": model.source_stream, "source_id": model.source_id,
                "error": model.error[:1000]}
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


def decode_body(raw: Any, kind: type[M]) -> M:
    """Validate a msgpack ``body`` as ``kind``; raises MalformedEntry."""
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
    try:
        return kind.model_validate(_from_wire(data, kind))
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise MalformedEntry(f"{kind.__name__}.{loc}: {first.get('msg')} ({exc.error_count()} error(s))") from exc
    except RecursionError as exc:
        raise MalformedEntry("body: nested too deeply") from exc


def decode_entry(fields: Mapping[Any, Any], kind: type[M]) -> M:
    """Decode and validate a stream entry as ``kind``; raises MalformedEntry naming the problem."""
    if not isinstance(fields, Mapping):
        raise MalformedEntry("entry: fields are not a map")
    schema = _text(fields, "schema")
    if schema != SCHEMA_VERSION:
        raise MalformedEntry(f"field 'schema': expected {SCHEMA_VERSION!r}, got {schema!r}")
    want = KINDS[kind]
    got = _text(fields, "kind")
    if got != want:
        raise MalformedEntry(f"field 'kind': expected {want!r}, got {got!r}")
    model = decode_body(fields.get(b"body", fields.get("body")), kind)
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
