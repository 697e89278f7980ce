"""Who holds the two cores: CPU and run-queue wait of every thread of an experiment's runs.

Runs a ``dressage experiment`` as a child and samples ``/proc/PID/task/TID/schedstat`` (nanoseconds on
a CPU, nanoseconds runnable but waiting for one) of every thread of every process the runs start, every
``--interval`` seconds. After each run it cuts the counters to the trainer's loop (from the start of its
first step to the end of its last, read from the run's ``metrics.jsonl``; start-up and the deferred
evaluation are left out) and prints, per variant (mean over seeds), per service and per thread (``main``
is the process's first thread, ``other`` all the rest together), the CPU and run-queue wait per second of
that window and the thread's scheduling policy. The trainer's main thread waiting on a run queue while
the rest of the trainer loop is computing is time the two cores are held by something else; the table
says by what.

The sampler itself runs under SCHED_IDLE (it reads /proc a few hundred times a second at most), so it
takes no CPU the runs want; a counter is interpolated between the two samples around each edge of the
window, so the error per thread is at most one interval's worth at each edge.

    python bench/sched_probe.py            # the async-vs-sync quick preset, in runs/sched-probe/ (make bench)
    python bench/sched_probe.py [--interval 0.2] [--csv out.csv] -- SPEC.yaml [experiment options]
    python bench/sched_probe.py -- docs/results/async-vs-sync-10seeds-20261205/spec.yaml --variants sync,async-eta1-live-bc
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.monitor.probes import parent_pid, process_children  # noqa: E402
from tools.reports.metricslog import load_rows  # noqa: E402
from tools.reports.series import trainer_rows  # noqa: E402

POLICIES = {0: "normal", 1: "fifo", 2: "rr", 3: "batch", 5: "idle"}
DEFAULT_SPEC = "configs/experiments/async-vs-sync.yaml"
DEFAULT_OUT = "runs/sched-probe"
RUN_DIR = re.compile(r"--(?:run-dir|config)\s+(\S+?)(?:/config\.yaml)?(?:\s|$)")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _descendants(root: int) -> list[int]:
    """root and every process below it (one scan of /proc's parent links)."""
    kids = process_children()
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(kids.get(pid, []))
    return seen


class Sampler:
    """Cumulative schedstat series per thread, labelled by run folder, service and thread role."""

    def __init__(self) -> None:
        self.series: dict[tuple[int, int], list[tuple[float, int, int]]] = defaultdict(list)
        self.labels: dict[tuple[int, int], tuple[str, str, str, str]] = {}
        self.proc_label: dict[int, tuple[str, str]] = {}

    def _label_process(self, pid: int) -> tuple[str, str] | None:
        cmd = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
        if not cmd:
            return None
        m = RUN_DIR.search(cmd)
        run = m.group(1) if m else None
        if run is None:  # the private redis-server: its parent is the run's `dressage up`
            run = self.proc_label.get(parent_pid(pid) or 0, (None, ""))[0]
        if run is None:
            return None
        words = cmd.split()
        service = words[words.index("services") + 1] if "services" in words else Path(words[0]).name
        self.proc_label[pid] = (run, service)
        return run, service

    def sample(self, root: int) -> None:
        now = time.time()
        for pid in _descendants(root):
            label = self.proc_label.get(pid) or self._label_process(pid)
            if label is None:
                continue
            run, service = label
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            for tid in tids:
                stat = _read(f"/proc/{pid}/task/{tid}/schedstat")
                if not stat:
                    continue
                cpu_ns, wait_ns, _ = (int(x) for x in stat.split())
                key = (pid, tid)
                if key not in self.labels:
                    try:
                        policy = POLICIES.get(os.sched_getscheduler(tid), "?")
                    except OSError:
                        continue
                    self.labels[key] = (run, service, "main" if tid == pid else "other", policy)
                self.series[key].append((now, cpu_ns, wait_ns))


def _at(series: list[tuple[float, int, int]], t: float) -> tuple[float, float] | None:
    """The (cpu, wait) seconds a thread had accumulated at time t, interpolated; None before its first
    sample (it was born after t), its last sample's values after its end."""
    if not series or t < series[0][0] - 1.0:
        return None
    prev = series[0]
    for cur in series:
        if cur[0] >= t:
            span = cur[0] - prev[0]
            w = 0.0 if span <= 0 else (t - prev[0]) / span
            cpu = prev[1] + w * (cur[1] - prev[1])
            wait = prev[2] + w * (cur[2] - prev[2])
            return cpu / 1e9, wait / 1e9
        prev = cur
    return prev[1] / 1e9, prev[2] / 1e9  # the thread ended before t: it adds nothing after its end


def trainer_window(run_dir: Path) -> tuple[float, float] | None:
    """Start of the trainer's first step to the end of its last, from the run's metrics."""
    steps = trainer_rows(load_rows(run_dir / "metrics.jsonl"))  # a torn last line (crash) is skipped there
    if len(steps) < 2:
        return None
    first, last = steps[0], steps[-1]
    return float(first["ts"]) - float(first.get("time/wall_s", 0.0)), float(last["ts"])


def window_rows(sampler: Sampler) -> list[dict]:
    """One row per (run, service, role, policy): CPU and wait per second of the run's trainer window."""
    runs = {lab[0] for lab in sampler.labels.values()}
    rows = []
    for run in sorted(runs):
        win = trainer_window(ROOT / run)
        if win is None:
            continue
        t0, t1 = win
        acc: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        for key, (r, service, role, policy) in sampler.labels.items():
            if r != run:
                continue
            a, b = _at(sampler.series[key], t0), _at(sampler.series[key], t1)
            if b is None:
                continue
            a = a or (0.0, 0.0)
            acc[(service, role, policy)][0] += b[0] - a[0]
            acc[(service, role, policy)][1] += b[1] - a[1]
        parts = Path(run).parts
        for (service, role, policy), (cpu, wait) in sorted(acc.items()):
            rows.append(
                {
                    "variant": parts[-2],
                    "seed": parts[-1],
                    "window_s": round(t1 - t0, 3),
                    "service": service,
                    "thread": role,
                    "policy": policy,
                    "cpu_per_s": cpu / (t1 - t0),
                    "wait_per_s": wait / (t1 - t0),
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    by: dict[tuple[str, str, str, str], list[dict]] = defaultdict(list)
    for r in rows:
        by[(r["variant"], r["service"], r["thread"], r["policy"])].append(r)
    print(
        f"{'variant':<26} {'service':<16} {'thread':<6} {'policy':<7} {'runs':>4} {'cpu/s':>7} {'wait/s':>7}"
    )
    for variant in dict.fromkeys(r["variant"] for r in rows):
        total = defaultdict(float)
        for (v, service, role, policy), rs in by.items():
            if v != variant:
                continue
            cpu = sum(r["cpu_per_s"] for r in rs) / len(rs)
            wait = sum(r["wait_per_s"] for r in rs) / len(rs)
            total[policy] += cpu
            print(f"{variant:<26} {service:<16} {role:<6} {policy:<7} {len(rs):>4} {cpu:>7.3f} {wait:>7.3f}")
        print(
            f"{variant:<26} {'all':<16} {'':<6} {'':<7} {'':>4} "
            + ", ".join(f"{p} {c:.3f} cores" for p, c in sorted(total.items()))
        )


def headline(rows: list[dict]) -> str:
    """The last line: the trainer main thread's run-queue wait per variant, and who else ran at normal policy."""
    parts = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        seeds = {r["seed"] for r in mine}
        wait = sum(
            r["wait_per_s"] for r in mine if r["service"] == "trainer" and r["thread"] == "main"
        ) / len(seeds)
        others = sum(
            r["cpu_per_s"]
            for r in mine
            if r["policy"] == "normal" and not (r["service"] == "trainer" and r["thread"] == "main")
        ) / len(seeds)
        parts.append(f"{variant} {wait:.3f} s/s (normal-policy CPU besides it {others:.2f} cores)")
    return "trainer main thread waiting for a core: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--csv", help="also write the per-run rows here")
    p.add_argument("experiment", nargs=argparse.REMAINDER, help="-- SPEC.yaml [dressage experiment options]")
    args = p.parse_args(argv)
    exp = [a for a in args.experiment if a != "--"]
    if not exp:  # make bench: the async-vs-sync quick preset, measured anew in a folder of its own
        shutil.rmtree(ROOT / DEFAULT_OUT, ignore_errors=True)
        exp = [DEFAULT_SPEC, "--quick", "--quiet", "--out", DEFAULT_OUT]
    child = subprocess.Popen([sys.executable, "-m", "services", "experiment", *exp], cwd=ROOT)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # after the fork: the runs keep normal policy
    sampler = Sampler()
    while child.poll() is None:
        sampler.sample(child.pid)
        time.sleep(args.interval)
    rows = window_rows(sampler)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["variant"])
            w.writeheader()
            w.writerows(rows)
    print_table(rows)
    if rows:
        print(headline(rows))
    return child.returncode


if __name__ == "__main__":
    raise SystemExit(main())
