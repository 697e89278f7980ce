"""Copy of a run's decision streams into its folder, incrementally.

``{p}:collector:decisions`` goes to ``<run>/decisions.jsonl``, one ``DecisionRecord`` per line (its
JSON, plus ``id``: the stream entry id); the adaptive window's ``{p}:window_controller:decisions``
(each tick's inputs, proposal, reason and window) to ``<run>/window_decisions.jsonl``, its fields as
they are. ``pull`` reads only entries after the last id written, and a re-opened file continues
after its last line, so an entry is never written twice and ``dressage up`` can call it every tick.
The private Redis of a run is gone when the run ends; these files are what ``dressage replay RUN``
and a reader of the controller's choices have afterwards.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from shared.errors import MalformedEntry
from shared.keys import Keys
from shared.window_decisions import DecisionRecord

log = logging.getLogger(__name__)
FILE = "decisions.jsonl"
CONTROLLER_FILE = "window_decisions.jsonl"
Reader = Callable[[redis.Redis, Keys, str], list[tuple[str, dict[str, Any]]]]


def read_stream(r: redis.Redis, keys: Keys, after: str = "0-0",
                count: int = 2000) -> list[tuple[str, DecisionRecord]]:
    """Every record newer than ``after``, oldest first (paged); a malformed entry is skipped."""
    out: list[tuple[str, DecisionRecord]] = []
    cursor = after
    while True:
        page = r.xrange(keys.collector_decisions, min=f"({cursor}", max="+", count=count)
        for raw_id, fields in page:
            cursor = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            try:
                out.append((cursor, DecisionRecord.from_fields(fields)))
            except MalformedEntry:
                continue
        if len(page) < count:
            return out


def collector_records(r: redis.Redis, keys: Keys, after: str) -> list[tuple[str, dict[str, Any]]]:
    return [(i, rec.model_dump()) for i, rec in read_stream(r, keys, after)]


def controller_records(r: redis.Redis, keys: Keys, after: str, count: int = 2000) -> list[tuple[str, dict[str, Any]]]:
    """The window controller's decision entries newer than ``after``, fields decoded, oldest first."""
    out: list[tuple[str, dict[str, Any]]] = []
    cursor = after
    while True:
        page = r.xrange(keys.window_controller_decisions, min=f"({cursor}", max="+", count=count)
        for raw_id, fields in page:
            cursor = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            out.append((cursor, {(k.decode() if isinstance(k, bytes) else str(k)):
                                 (v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v))
                                 for k, v in fields.items()}))
        if len(page) < count:
            return out


def load_records(path: Path) -> list[DecisionRecord]:
    """The records of a decisions.jsonl file; a torn last line (crash mid-write) is skipped."""
    records: list[DecisionRecord] = []
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            row.pop("id", None)
            records.append(DecisionRecord.model_validate(row))
        except ValueError:  # json and pydantic errors alike
            continue
    return records


class DecisionFile:
    """Appends a run's new decision records to ``<run>/decisions.jsonl``."""

    def __init__(self, path: Path, read: Reader = collector_records) -> None:
        self.path, self.read = path, read
        self.last_id = "0-0"
        if path.exists():
            for line in reversed(path.read_text(encoding="utf-8").splitlines()):
                try:
                    self.last_id = str(json.loads(line)["id"])
                    break
                except (ValueError, KeyError, TypeError):
                    continue

    def pull(self, r: redis.Redis, keys: Keys) -> int:
        """Append the records newer than the last one written; returns how many."""
        new = self.read(r, keys, self.last_id)
        if not new:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            for entry_id, rec in new:
                fh.write(json.dumps({"id": entry_id, **rec}) + "\n")
        self.last_id = new[-1][0]
        return len(new)

    def sync(self, r: redis.Redis, keys: Keys) -> int:
        """``pull``, but a Redis error (restarting, gone) is logged and retried at the next call."""
        try:
            return self.pull(r, keys)
        except redis.RedisError as exc:
            log.debug("decision log: cannot read Redis (%s); will retry", exc)
            return 0
