"""``dressage replay RUN [--keep-versions N ...]``: the collector's window decisions, recomputed offline.

RUN is a run folder (``runs/<run>``, ``runs/latest``, or a run name under ``ops.run_dir``) holding
``decisions.jsonl`` (written by ``dressage up``), or ``--redis URL --prefix P`` reads a live
``{p}:collector:decisions`` stream instead. The decisions are recomputed with the collector's own
rule (``shared.window_decisions.outside_window``):

* without ``--keep-versions``: each record under the window it was decided with -- a check that the
  log is faithful; exit 1 if any recorded decision is not reproduced;
* with ``--keep-versions N [M ...]`` (0 = off): what each window would have done at the same checks,
  listing the group attempts it would have dropped that the run trained, and the reverse.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.keys import Keys
from shared.window_decisions import DecisionRecord, ReplayReport, replay
from tools.reports.decisionlog import FILE, load_records, read_stream

SHOW = 20  # group attempts listed per direction


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dressage replay", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("run", nargs="?", help="run folder (or name under --runs) with decisions.jsonl")
    p.add_argument("--keep-versions", type=int, nargs="+", metavar="N",
                   help="window(s) to replay under (0 = off); default: each decision's own window")
    p.add_argument("--runs", default="runs", help="where run names are looked up (default runs)")
    p.add_argument("--redis", help="read the live stream of this Redis URL instead of a run folder")
    p.add_argument("--prefix", help="key prefix of the live run (with --redis)")
    p.add_argument("--all", action="store_true", help="list every changed group attempt, not the first 20")
    return p.parse_args(argv)


def load(args: argparse.Namespace) -> list[DecisionRecord]:
    """The records named by the arguments; raises ``FileNotFoundError``/``ValueError`` with a message."""
    if args.redis:
        if not args.prefix:
            raise ValueError("--redis needs --prefix (the run's key prefix)")
        import redis

        r = redis.Redis.from_url(args.redis, socket_connect_timeout=5)
        return [rec for _, rec in read_stream(r, Keys(args.prefix))]
    if not args.run:
        raise ValueError("give a run folder (e.g. runs/latest) or --redis URL --prefix P")
    folder = Path(args.run)
    if not folder.exists() and (Path(args.runs) / args.run).exists():
        folder = Path(args.runs) / args.run
    path = folder / FILE if folder.is_dir() else folder
    if not path.exists():
        raise FileNotFoundError(f"{path}: no decision log (runs started by `dressage up` write {FILE})")
    return load_records(path)


def describe(report: ReplayReport, show_all: bool) -> str:
    lines = [report.summary()]
    for title, recs in (("would drop (trained in the run)", report.would_drop),
                        ("would keep (dropped in the run)", report.would_keep)):
        if not recs:
            continue
        lines.append(f"  {title}:")
        for rec in recs if show_all else recs[:SHOW]:
            lines.append(f"    group_id={rec.group_id} attempt={rec.attempt} versions={','.join(rec.versions)} "
                         f"gaps={','.join(map(str, rec.gaps))} run_window={rec.keep_versions} "
                         f"recorded={rec.decision}/{rec.reason}")
        if not show_all and len(recs) > SHOW:
            lines.append(f"    ... {len(recs) - SHOW} more (--all)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        records = load(args)
    except (FileNotFoundError, ValueError) as exc:
        sys.stderr.write(f"dressage replay: {exc}\n")
        return 2
    if not args.keep_versions:
        report = replay(records)
        sys.stdout.write(describe(report, args.all) + "\n")
        if report.changed:
            sys.stdout.write(f"NOT REPRODUCED: {report.changed} recorded decision(s) differ from the rule\n")
            return 1
        sys.stdout.write("every recorded window decision is reproduced by the rule\n")
        return 0
    for n in args.keep_versions:
        if n < 0:
            sys.stderr.write(f"dressage replay: --keep-versions must be >= 0 (0 = off), got {n}\n")
            return 2
        sys.stdout.write(describe(replay(records, n), args.all) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
