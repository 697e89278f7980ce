"""Generate the shipped datasets: ``dressage make-data --out data`` (``python -m tools.dev.make_data``).

For every task, one ``generate(train + test, seed)`` call yields distinct rows, split into
``<out>/<task>/train.jsonl`` and ``<out>/<task>/test.jsonl`` — so train and test never share a
(prompt, reference) pair — with stable ids ``<task>-train-00000`` / ``<task>-test-00000``.
The output is a pure function of the arguments.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from shared.tasks.dataset import write_dataset
from shared.tasks.registry import TASK_NAMES, get_task

log = logging.getLogger(__name__)


def split_rows(
    task_name: str, n_train: int, n_test: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train/test rows for a task, ids renumbered per split."""
    rows = get_task(task_name).generate(n_train + n_test, seed)
    train = [{**r, "prompt_id": f"{task_name}-train-{i:05d}"} for i, r in enumerate(rows[:n_train])]
    test = [{**r, "prompt_id": f"{task_name}-test-{i:05d}"} for i, r in enumerate(rows[n_train:])]
    return train, test


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dressage make-data", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="data", help="output folder (default: data)")
    parser.add_argument("--train", type=int, default=2000, help="train rows per task")
    parser.add_argument("--test", type=int, default=200, help="test rows per task")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tasks", nargs="*", default=list(TASK_NAMES), choices=TASK_NAMES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in args.tasks:
        train, test = split_rows(name, args.train, args.test, args.seed)
        write_dataset(Path(args.out) / name / "train.jsonl", train)
        write_dataset(Path(args.out) / name / "test.jsonl", test)
        log.info("task=%s train=%d test=%d out=%s", name, len(train), len(test), Path(args.out) / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
