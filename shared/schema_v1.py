"""Reading contract v1 bodies as v2, so a rolling upgrade loses nothing (docs/streams.md, "Schema v1").

v1 carried in ``meta`` what v2 types:

* ``PromptGroup.meta.retry_history`` (``{attempt, error}`` from v1 workers, ``{attempt, reason, error, at}``
  from v1 collectors) becomes ``retry_history`` (missing ``reason`` → ``failed``, missing ``at`` → 0);
* ``RolloutGroup.meta.prompt_group`` becomes ``prompt_group``; a failed group's ``error_code`` is the
  text before the first ``:`` of its ``error``; ``retryable`` is False only where a v1 worker had
  dead-lettered it as ``invalid_prompt_group``;
* a ``Batch``'s groups are upgraded one by one.

One v1 entry cannot be taken over: a failed rollout group that a v1 worker already re-enqueued or
dead-lettered (``meta.handled``). Applying the v2 policy to it would retry the group a second time,
so it raises ``UnsupportedSchema`` and the consumer dead-letters it (reason ``unsupported_schema``,
original bytes kept) — the v1 worker's own re-enqueue or dead letter is the group's real outcome.
Pure functions over decoded msgpack maps; validation happens afterwards, as for v2.
"""

from __future__ import annotations

from typing import Any

from shared.codes import INVALID_PROMPT_GROUP
from shared.errors import UnsupportedSchema
from shared.schemas import MAX_ERROR_CHARS

V1 = "1"


def _history(raw: Any) -> list[Any]:
    if not isinstance(raw, list):
        return []
    out: list[Any] = []
    for rec in raw:
        if isinstance(rec, dict):
            out.append({"attempt": rec.get("attempt", 0), "reason": rec.get("reason", "failed"),
                        "error": str(rec.get("error", ""))[:MAX_ERROR_CHARS], "at": rec.get("at", 0.0)})
        else:
            out.append(rec)  # the schema names what is wrong
    return out


def prompt_group(data: Any) -> Any:
    """A v1 ``PromptGroup`` map as v2 (anything not a map is left for the schema to refuse)."""
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) or "retry_history" not in data["meta"]:
        return data
    meta = dict(data["meta"])
    return {**data, "meta": meta, "retry_history": _history(meta.pop("retry_history"))}


def rollout_group(data: Any) -> Any:
    """A v1 ``RolloutGroup`` map as v2; raises ``UnsupportedSchema`` for a group its worker already handled."""
    if not isinstance(data, dict):
        return data
    meta = dict(data["meta"]) if isinstance(data.get("meta"), dict) else {}
    if meta.get("handled") is not None:
        raise UnsupportedSchema(f"RolloutGroup v1: failed group already {meta['handled']} by a v1 worker "
                                f"(group_id={str(data.get('group_id'))[:128]} attempt={data.get('attempt')})")
    out = {**data, "meta": meta}
    if "prompt_group" in meta:
        out["prompt_group"] = prompt_group(meta.pop("prompt_group"))
    if data.get("status") == "failed":
        error = data.get("error")
        out["error_code"] = error.split(":", 1)[0].strip() if isinstance(error, str) and error else None
        out["retryable"] = meta.pop("dead_letter_reason", None) != INVALID_PROMPT_GROUP
    return out


def batch(data: Any) -> Any:
    """A v1 ``Batch`` map as v2 (each group upgraded; v2 batches carry no prompt groups)."""
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        return data
    groups = [rollout_group(g) for g in data["groups"]]
    return {**data, "groups": [{**g, "prompt_group": None} if isinstance(g, dict) else g for g in groups]}
