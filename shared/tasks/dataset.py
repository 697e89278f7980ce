"""Prompt datasets: JSONL, Parquet or a Hugging Face ``datasets`` folder; one row per prompt.

Schema of a row (docs/guides/your-dataset.md):

* ``prompt`` -- required unless the task builds the first messages itself (``messages(row)``): a
  string (one user message) or a list of ``{"role", "content"}`` messages;
* ``reference`` -- optional, any JSON value the task's ``score`` reads (default null);
* ``prompt_id`` -- optional, a non-empty string unique in the file (default ``<file stem>-<line>``);
* ``task`` -- optional, the task's name (default: the ``task`` given to the loader, ``model.task``);
* ``meta`` -- optional object, carried along;
* any other field is passed to a plugin task in ``row``; the built-in tasks refuse unknown fields.

Formats by path: ``*.jsonl`` / ``*.json`` (one JSON object per line; blank lines skipped), ``*.parquet``
(needs ``pyarrow``), or a folder written by ``datasets.Dataset.save_to_disk`` (needs ``datasets``;
a ``DatasetDict`` folder is read through one of its split folders, e.g. ``my_data/train``). Lines are
1-based line numbers for JSONL and 1-based row numbers otherwise.

Invariants: ``scan_dataset`` never raises for a bad row: each is reported as a :class:`DatasetError`
naming the file, the line and the field, counted, and skipped (a later duplicate ``prompt_id`` too);
it raises only when the file itself cannot be read. ``load_dataset`` is the strict form (first bad
row raises). A row either returned is safe to enqueue: its task loads and took it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import DressageError, UnknownTask
from shared.tasks.base import InvalidReference, prompt_messages, start_episode
from shared.tasks.plugin import PluginTask, TaskFailed
from shared.tasks.registry import get_task

ROW_FIELDS = ("prompt_id", "task", "prompt", "reference")
OPTIONAL_FIELDS = ("meta",)
KNOWN_FIELDS = ROW_FIELDS + OPTIONAL_FIELDS
MAX_REPORTED = 20  # bad rows kept with their message (the rest only counted)


class DatasetError(ValueError, DressageError):
    """A dataset line is invalid; ``line`` (1-based) and ``field`` say where."""

    def __init__(self, path: str, line: int, field: str, reason: str) -> None:
        super().__init__(f"{path}:{line}: {field}: {reason}")
        self.path, self.line, self.field, self.reason = path, line, field, reason


@dataclass
class ScannedDataset:
    """The good rows of a dataset and what was skipped."""

    path: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0  # malformed rows, skipped
    errors: list[DatasetError] = field(default_factory=list)  # the first MAX_REPORTED of them


def validate_row(row: Any, task: str | None = None) -> dict[str, Any]:
    """Check one row (``task``: default for a row without one); raises :class:`InvalidReference` whose
    ``field`` names the bad field. Returns the row with ``task`` and ``prompt`` filled in."""
    if not isinstance(row, dict):
        raise InvalidReference("row", f"must be a JSON object, got {type(row).__name__}")
    name = row.get("task", task)
    if name is None:
        raise InvalidReference("task", "missing (and no default task: set model.task)")
    try:
        plugin = get_task(name)
    except UnknownTask as exc:
        raise InvalidReference("task", str(exc)) from None
    if "prompt_id" in row and (not isinstance(row["prompt_id"], str) or not row["prompt_id"]):
        raise InvalidReference("prompt_id", "must be a non-empty string")
    if "meta" in row and not isinstance(row["meta"], dict):
        raise InvalidReference("meta", "must be an object")
    if isinstance(plugin, PluginTask):
        messages = plugin.check_row(row)
        return {**row, "task": name, "prompt": row["prompt"] if "prompt" in row else messages}
    unknown = sorted(set(row) - set(KNOWN_FIELDS))
    if unknown:
        raise InvalidReference(unknown[0], f"unknown field (allowed: {', '.join(KNOWN_FIELDS)})")
    for key in ("prompt", "reference"):
        if key not in row:
            raise InvalidReference(key, "missing")
    prompt_messages(row["prompt"])
    out = {**row, "task": name}
    start_episode(plugin, out)  # validates the reference and its fit to the prompt
    return out


def _jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as exc:
                yield lineno, DatasetError(str(path), lineno, "line", f"invalid JSON ({exc.msg})")


def _parquet(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(str(path), 0, "file", "reading Parquet needs pyarrow (pip install "
                                                 "'dressage-streams[datasets]')") from exc
    table = pq.read_table(path)
    yield from enumerate(table.to_pylist(), start=1)


def _hf_folder(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(str(path), 0, "file", "reading a Hugging Face datasets folder needs the datasets "
                                                 "package (pip install datasets)") from exc
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        raise DatasetError(str(path), 0, "file", f"a DatasetDict: name one split folder "
                                                 f"({', '.join(str(path / s) for s in loaded)})")
    for i, row in enumerate(loaded, start=1):
        yield i, dict(row)


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line, row)`` pairs of a dataset file, a :class:`DatasetError` in place of an unreadable line.

    Raises :class:`DatasetError` (line 0) or ``OSError`` only when the file itself cannot be read."""
    p = Path(path)
    if p.is_dir():
        return _hf_folder(p)
    if p.suffix == ".parquet":
        return _parquet(p)
    if not p.exists():
        raise FileNotFoundError(f"dataset {p} not found")
    return _jsonl(p)


def scan_dataset(path: str | Path, task: str | None = None) -> ScannedDataset:
    """Every good row of a dataset; bad rows reported, counted and skipped (module invariants)."""
    out = ScannedDataset(str(path))
    seen: dict[str, int] = {}
    stem = Path(path).stem or Path(path).name

    def skip(err: DatasetError) -> None:
        out.skipped += 1
        if len(out.errors) < MAX_REPORTED:
            out.errors.append(err)

    for lineno, raw in read_rows(path):
        if isinstance(raw, DatasetError):
            skip(raw)
            continue
        if isinstance(raw, dict) and "prompt_id" not in raw:
            raw = {"prompt_id": f"{stem}-{lineno}", **raw}
        try:
            row = validate_row(raw, task)
        except InvalidReference as exc:
            skip(DatasetError(str(path), lineno, exc.field, exc.reason))
            continue
        except TaskFailed as exc:
            skip(DatasetError(str(path), lineno, exc.hook, exc.reason))
            continue
        if row["prompt_id"] in seen:
            skip(DatasetError(str(path), lineno, "prompt_id", f"duplicate of line {seen[row['prompt_id']]}"))
            continue
        seen[row["prompt_id"]] = lineno
        out.rows.append(row)
    return out


def load_dataset(path: str | Path, task: str | None = None) -> list[dict[str, Any]]:
    """All rows of a dataset, validated; raises :class:`DatasetError` on the first bad row."""
    scanned = scan_dataset(path, task)
    if scanned.errors:
        raise scanned.errors[0]
    return scanned.rows


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
