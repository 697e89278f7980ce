"""``dressage report RUN``: plots + summary of a finished or running run.

Input: a run directory holding ``metrics.jsonl`` (written by ``dressage up``), or a live run's
``{p}:metrics`` stream (``--redis-url`` / ``--prefix``, or ``--config``). Output, in
``<RUN>/report/`` (or ``--out``): one PNG per figure, ``summary.txt``, and ``report.html`` -- a
single self-contained page (PNGs embedded as base64, no external assets) with the summary table.
The summary table is also printed, with where the time went (``tools.reports.timing``: trainer
waiting / training / checkpointing / publishing, engine busy and idle, the workers' wait on the proxy),
a trained group's age in flight against queued (``tools.reports.agesplit``), and whom the staleness
controls dropped (``tools.reports.dropbias``, from the run's ``decisions.jsonl`` or the live
``{p}:collector:decisions``), and how off-policy the trained data was (``tools.reports.offpolicy``).
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.config import load_config
from shared.errors import ConfigError
from shared.keys import Keys
from shared.window_decisions import DecisionRecord
from tools.reports import agesplit, dropbias, offpolicy, series, timing
from tools.reports.decisionlog import FILE as DECISIONS_FILE
from tools.reports.decisionlog import load_records
from tools.reports.decisionlog import read_stream as read_decisions
from tools.reports.metricslog import load_rows, read_stream


@dataclass(frozen=True)
class ReportFiles:
    pngs: list[Path]
    html: Path
    summary: Path
    table: str


def render_html(title: str, table: Sequence[tuple[str, str]], pngs: Sequence[Path]) -> str:
    rows = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in table)
    figures = "\n".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{html.escape(p.name)}</figcaption></figure>'
        for p in pngs)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:3px 8px;text-align:left}}th{{font-weight:normal;color:#444}}
img{{max-width:100%}}figure{{margin:1.5em 0}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>Generated {html.escape(time.strftime('%Y-%m-%d %H:%M:%S'))} by <code>dressage report</code>.</p>
<h2>Summary</h2><table>
{rows}
</table>
<h2>Plots</h2>
{figures}
</body></html>
"""


def build_report(rows: Sequence[series.Row], out: Path, title: str, slots: int | None = None,
                 decisions: Sequence[DecisionRecord] = ()) -> ReportFiles:
    """``slots``: rollout workers × concurrency, for the workers' busy fraction (None: left out);
    ``decisions``: the collector's decision records, for whom the controls dropped."""
    from tools.reports.plots import plot_all  # matplotlib only when a report is drawn

    out.mkdir(parents=True, exist_ok=True)
    pngs = plot_all(rows, out)
    table = (series.summary(rows) + timing.summary_pairs(timing.decompose(rows, slots))
             + agesplit.summary_pairs(agesplit.split(rows)) + dropbias.summary_pairs(decisions)
             + offpolicy.summary_pairs(offpolicy.split(rows)))
    text = series.format_table(table)
    summary = out / "summary.txt"
    summary.write_text(text + "\n", encoding="utf-8")
    page = out / "report.html"
    page.write_text(render_html(title, table, pngs), encoding="utf-8")
    return ReportFiles(pngs, page, summary, text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dressage report", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("run", help="run directory (with metrics.jsonl), or where to write a live run's report")
    p.add_argument("--redis-url", help="read a running run's {p}:metrics from this Redis")
    p.add_argument("--prefix", help="Redis prefix of the run (with --redis-url)")
    p.add_argument("--config", help="take redis.url / redis.prefix from this config")
    p.add_argument("--out", help="output folder (default: RUN/report)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Path(args.run)
    live = args.redis_url or args.prefix or args.config
    if live:
        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            sys.stderr.write(f"dressage report: {exc}\n")
            return 2
        from shared.redisconn import connect, run_prefix

        url = args.redis_url or cfg.redis.url
        pw = cfg.redis.secret()
        r = connect(url, pw)  # redis://, redis+cluster://, redis+sentinel://
        keys = Keys(run_prefix(args.prefix or cfg.redis.prefix, url))
        rows = read_stream(r, keys)
        decisions = [rec for _, rec in read_decisions(r, keys)]
    else:
        metrics = run / "metrics.jsonl" if run.is_dir() else run
        if not metrics.exists():
            sys.stderr.write(f"dressage report: no metrics.jsonl in {run} (use --redis-url for a live run)\n")
            return 2
        rows = load_rows(metrics)
        run = metrics.parent
        decisions = load_records(run / DECISIONS_FILE)
    out = Path(args.out) if args.out else run / "report"
    files = build_report(rows, out, title=f"Dressage run {run.name or run}", decisions=decisions)
    sys.stdout.write(files.table + "\n\n")
    sys.stdout.write(f"report: {files.html}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
