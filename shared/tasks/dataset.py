"""JSONL prompt datasets: one row per line ``{"prompt_id", "task", "prompt", "reference"[, "meta"]}``.

``load_dataset`` validates every line at the edge and raises :class:`DatasetError` naming the
file, the 1-based line number and the bad field; a file it returns is safe to enqueue.
Blank lines are skipped; ``prompt_id`` values are unique within a file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.errors import DressageError, UnknownTask
from shared.tasks.base import InvalidReference, prompt_messages
from shared.tasks.registry import get_task

ROW_FIELDS = ("prompt_id", "task", "prompt", "reference")
OPTIONAL_FIELDS = ("meta",)


class DatasetError(ValueError, DressageError):
    """A dataset line is invalid; ``line`` (1-based) and ``field`` say where."""

    def __init__(self, path: str, line: int, field: str, reason: str) -> None:
        super().__init__(f"{path}:{line}: {field}: {reason}")
        self.path, self.line, self.field, self.reason = path, line, field, reason


def validate_row(row: Any) -> dict[str, Any]:
    """Check one row; raises :class:`InvalidReference` whose ``field`` names the bad field."""
    if not isinstance(row, dict):
        raise InvalidReference("row", f"must be a JSON object, got {type(row).__name__}")
    for key in ROW_FIELDS:
        if key not in row:
            raise InvalidReference(key, "missing")
    unknown = sorted(set(row) - set(ROW_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise InvalidReference(
            unknown[0], f"unknown field (allowed: {', '.join(ROW_FIELDS + OPTIONAL_FIELDS)})"
        )
    if not isinstance(row["prompt_id"], str) or not row["prompt_id"]:
        raise InvalidReference("prompt_id", "must be a non-empty string")
    if "meta" in row and not isinstance(row["meta"], dict):
        raise InvalidReference("meta", "must be an object")
    try:
        task = get_task(row["task"])
    except UnknownTask as exc:
        raise InvalidReference("task", str(exc)) from None
    prompt_messages(row["prompt"])
    task.start(row["prompt"], row["reference"])  # validates the reference and its fit to the prompt
    return row


def load_dataset(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a JSONL dataset, validated; raises :class:`DatasetError` on the first bad line."""
    rows: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DatasetError(str(path), lineno, "line", f"invalid JSON ({exc.msg})") from None
            try:
                validate_row(row)
            except InvalidReference as exc:
                raise DatasetError(str(path), lineno, exc.field, exc.reason) from None
            if row["prompt_id"] in seen:
                raise DatasetError(
                    str(path), lineno, "prompt_id", f"duplicate of line {seen[row['prompt_id']]}"
                )
            seen[row["prompt_id"]] = lineno
            rows.append(row)
    return rows


def write_dataset(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSONL (sorted keys, one per line); returns the number written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(p, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, sort_keys=True, separators=(",", ":")) + "\n")
            n += 1
    return n
