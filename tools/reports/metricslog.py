"""Copy of a run's ``{p}:metrics`` stream into ``<run>/metrics.jsonl``, incrementally and resumably.

One JSON object per line: ``{"id": <entry id>, "service": ..., "ts": <unix s>, <metric>: <value>}``,
values parsed back from their JSON text where possible (``report_metrics`` stores them as text).
``pull`` reads only entries after the last id written, so calling it every second is cheap, and a
re-opened log continues after its last line: an entry is never written twice.
``load_rows`` reads such a file back; ``parse_entry`` is the one decoder for both paths.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import redis

from shared.keys import Keys


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def parse_entry(entry_id: Any, fields: Mapping[Any, Any]) -> dict[str, Any]:
    """One ``{p}:metrics`` entry as a flat row (``service`` stays text; other values JSON-decoded)."""
    row: dict[str, Any] = {"id": _text(entry_id)}
    for raw_key, raw_value in fields.items():
        key, text = _text(raw_key), _text(raw_value)
        if key == "service":
            row[key] = text
            continue
        try:
            row[key] = json.loads(text)
        except ValueError:
            row[key] = text
    return row


def read_stream(r: redis.Redis, keys: Keys, after: str = "0-0", count: int = 2000) -> list[dict[str, Any]]:
    """Every entry of ``{p}:metrics`` newer than ``after``, oldest first (paged)."""
    rows: list[dict[str, Any]] = []
    cursor = after
    while True:
        page = r.xrange(keys.metrics, min=f"({cursor}", max="+", count=count)
        if not page:
            return rows
        rows.extend(parse_entry(i, f) for i, f in page)
        cursor = rows[-1]["id"]
        if len(page) < count:
            return rows


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file; a torn last line (crash mid-write) is skipped."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def write_rows(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    n = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, default=str) + "\n")
            n += 1
    return n


class MetricsLog:
    """Appends new metric entries of one run to its metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path
        existing = load_rows(path)
        self.last_id = str(existing[-1].get("id", "0-0")) if existing else "0-0"
        self.rows: list[dict[str, Any]] = existing  # everything written so far, for progress/report

    def pull(self, r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
        new = read_stream(r, keys, after=self.last_id)
        if new:
            write_rows(self.path, new)
            self.last_id = new[-1]["id"]
            self.rows.extend(new)
        return new
