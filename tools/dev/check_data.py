"""``dressage check-data PATH [--task NAME | --config FILE]``: load a task and read a dataset as the
prompt-buffer will, before a run.

Prints the task it loaded, the rows it kept and every malformed row (file, line, field, why), plays
each kept row's episode start, and exits 0 when at least one row is usable, 1 when none is, 2 when the
task does not load (the message names it and the cause). Nothing is written.
"""

from __future__ import annotations

import argparse
import sys

from shared.config import load_config
from shared.errors import ConfigError, UnknownTask
from shared.tasks import DatasetError, PluginTask, get_task, scan_dataset
from shared.tasks.dataset import MAX_REPORTED


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dressage check-data", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("path", help="dataset: .jsonl, .parquet or a Hugging Face datasets folder")
    p.add_argument("--task", help="task of rows without a 'task' field (default: model.task of --config)")
    p.add_argument("--config", help="deployment config (its model.task)")
    args = p.parse_args(argv)
    try:
        task = args.task or load_config(args.config).model.task
        loaded = get_task(task)
    except (UnknownTask, ConfigError) as exc:
        sys.stderr.write(f"dressage check-data: {exc}\n")
        return 2
    kind = "plugin" if isinstance(loaded, PluginTask) else "built-in protocol"
    sys.stdout.write(f"task {task}: loaded ({kind}, max_turns {loaded.max_turns}, "
                     f"max_new_tokens {loaded.max_new_tokens})\n")
    try:
        scanned = scan_dataset(args.path, task=task)
    except (DatasetError, OSError) as exc:
        sys.stderr.write(f"dressage check-data: {exc}\n")
        return 1
    for err in scanned.errors:
        sys.stdout.write(f"malformed: {err}\n")
    more = scanned.skipped - len(scanned.errors)
    if more > 0:
        sys.stdout.write(f"... and {more} more malformed rows (the first {MAX_REPORTED} are shown)\n")
    sys.stdout.write(f"{args.path}: {len(scanned.rows)} rows, {scanned.skipped} malformed rows skipped\n")
    return 0 if scanned.rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
