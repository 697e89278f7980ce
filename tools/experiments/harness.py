"""``dressage experiment SPEC.yaml``: every variant × seed of a spec as a bounded ``dressage up``, then a report.

Each run gets its own folder ``<out>/<spec>/<variant>/seed<k>/`` (config.yaml, up.log, the run's
own logs, metrics.jsonl and checkpoints), its own Redis prefix and a private Redis, and runs one at
a time unless ``--jobs N``, seed by seed (``spec.interleaved``: every variant of seed 0, then
of seed 1, ...), so a drift of the machine's speed falls on every variant alike. One progress line
covers the whole experiment.

Resumability, the invariant: a run folder holding ``result.json`` is finished and never run again;
any other run folder is partial (crashed, interrupted, killed) and is deleted and run again from
scratch. ``result.json`` is written (atomically) only after the run ended by its stop rule, so
``summary.csv`` -- rebuilt from the result files every time, in spec order -- has exactly one row per
finished run. A ``dressage up`` left running by a killed runner (``child.json`` names its process
group) is stopped before its folder is reused. Ctrl-C / SIGTERM stops the running runs cleanly; they
count as interrupted. Exit code: 0 every run finished, 1 a run failed, 2 bad spec or a model build other
than the finished runs' (``tools.experiments.build``: one folder, one build), 130 interrupted.

Each row records the build of the model its run started from (``model_build``), read when the run ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from shared.lifecycle import StopFlag
from shared.logs import setup_logging
from shared.redisproc import free_port
from tools.experiments import summary as summ
from tools.experiments.build import BuildMismatch, check_builds, model_build, weights_stamp
from tools.experiments.spec import Run, Spec, SpecError, interleaved, load_spec
from tools.reports.decisionlog import FILE as DECISIONS_FILE
from tools.reports.decisionlog import load_records
from tools.reports.metricslog import load_rows
from tools.reports.series import EVAL_ACC, STEP, number, pick

log = logging.getLogger(__name__)
RESULT, CHILD = "result.json", "child.json"
POLL_S = 0.2  # a run's exit is noticed within this
WATCH_S = 1.0  # a running run's metrics are read, its stop rules applied and the progress line redrawn this often
STOP_WAIT_S = 90.0  # SIGTERM -> SIGKILL of a run's process group


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dressage experiment", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("spec", help="experiment spec (YAML), e.g. configs/experiments/async-vs-sync.yaml")
    p.add_argument("--quick", action="store_true", help="run the spec's quick preset (folder <spec>-quick)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1: runs must not share cores)")
    p.add_argument("--out", default="runs/experiments", help="experiments folder (default runs/experiments)")
    p.add_argument("--check", action="store_true", help="validate the spec, list the runs, run nothing")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild summary and report from the finished runs' metrics (no run starts)")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of the variants to run and report (must include the baseline)")
    return p.parse_args(argv)


def prefix_for(spec: Spec, run: Run) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", f"exp-{spec.name}-{run.variant}-s{run.seed}")[:64]


def child_env() -> dict[str, str]:
    """The shell's environment without DRESSAGE_* and REDIS_URL: config.yaml alone defines a run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRESSAGE_") and k != "REDIS_URL"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, proc: subprocess.Popen[bytes] | None = None, wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM a run's process group, then SIGKILL what is left after ``wait_s``.

    ``proc``: our own child leading the group (polled, so its exit is seen before it is reaped)."""
    def running() -> bool:
        return proc.poll() is None if proc is not None else alive(pgid)

    for sig, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not running():
                return
            time.sleep(0.2)


def reset_partial(folder: Path) -> None:
    """A folder without result.json: stop its leftover ``dressage up`` (if any), delete it."""
    child = folder / CHILD
    if child.exists():
        try:
            pid = int(json.loads(child.read_text())["pid"])
        except (ValueError, KeyError, TypeError):
            pid = 0
        if pid > 0 and alive(pid):
            log.warning("stopping leftover run pid=%d of %s", pid, folder)
            stop_group(pid)
    shutil.rmtree(folder, ignore_errors=True)


def with_own_ports(config: dict[str, Any], taken: set[int]) -> dict[str, Any]:
    """``config`` with an engine and a proxy port of its own (free now, and none in ``taken``, the ports
    of the runs still going). With ``--jobs`` > 1 two runs starting together would both find the
    configured port free and race for it (``dressage up`` points the proxy and workers at them)."""
    ports: list[int] = []
    while len(ports) < 2:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    engine_port, proxy_port = ports
    return {**config, "engine": {**config.get("engine", {}), "port": engine_port},
            "proxy": {**config.get("proxy", {}), "port": proxy_port}}


@dataclass
class Active:
    run: Run
    folder: Path
    proc: subprocess.Popen[bytes]
    started: float
    log_fh: Any
    stopped_by_rule: str | None = None
    step: int | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    ports: set[int] = field(default_factory=set)  # engine and proxy ports it was given (--jobs > 1)


class Experiment:
    def __init__(self, spec: Spec, out: Path, jobs: int, stop: StopFlag, show: bool = True,
                 stream: TextIO | None = None) -> None:
        self.spec, self.root, self.jobs, self.stop, self.show = spec, out / spec.name, max(1, jobs), stop, show
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.finished = self.failed = self.skipped = 0
        self.refused = False
        self.durations: list[float] = []
        self._last_plain = 0.0
        self._builds: dict[str, tuple[tuple[tuple[str, int, int], ...], str | None]] = {}

    def folder(self, run: Run) -> Path:
        return self.root / run.variant / f"seed{run.seed}"

    @staticmethod
    def model_path(run: Run) -> str:
        return str((run.config.get("model") or {}).get("path") or "")

    def build(self, run: Run) -> str | None:
        """The build of the run's model directory now (hashed again only when its weight files changed)."""
        path = self.model_path(run)
        stamp = weights_stamp(path)
        cached = self._builds.get(path)
        if cached is None or cached[0] != stamp:
            cached = self._builds[path] = (stamp, model_build(path))
        return cached[1]

    def check_build(self, run: Run) -> None:
        """``BuildMismatch`` when ``run`` would start from another build than the finished runs of its model."""
        path = self.model_path(run)
        finished = {}
        for other in self.spec.runs:
            done = self.folder(other) / RESULT
            if self.model_path(other) == path and done.exists():
                finished[other.key] = json.loads(done.read_text())["row"].get("model_build")
        check_builds(finished, self.build(run), path, str(self.root))

    # --- running ---------------------------------------------------------------------------------

    def run_all(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        pending: list[Run] = []
        for run in interleaved(self.spec.runs):
            done = self.folder(run) / RESULT
            if done.exists():
                self.skipped += 1
                self.durations.append(float(json.loads(done.read_text()).get("duration_s", 0.0)))
            else:
                pending.append(run)
        self._say(f"experiment {self.spec.name}: {len(self.spec.runs)} runs ({self.skipped} already finished), "
                  f"stop: {self.spec.stop.describe()}, folder {self.root}", force=True)
        active: list[Active] = []
        watched = 0.0
        while (pending or active) and not self.stop.is_set:
            while pending and len(active) < self.jobs and not self.stop.is_set:
                try:
                    self.check_build(pending[0])
                except BuildMismatch as exc:
                    self._say(f"refused: {exc}", force=True)
                    log.error("not starting run=%s: %s", pending[0].key, exc)
                    self.refused = True
                    pending.clear()
                    break
                active.append(self._launch(pending.pop(0), taken={p for a in active for p in a.ports}))
            self.stop.wait(POLL_S)
            watch = time.monotonic() - watched >= WATCH_S
            for a in list(active):
                if watch:
                    self._watch(a)
                if a.proc.poll() is not None:
                    active.remove(a)
                    self._settle(a)  # reads its metrics a last time
            if watch:
                watched = time.monotonic()
                self._progress(active, len(pending))
        for a in active:  # interrupted: stop cleanly, leave no result.json
            a.stopped_by_rule = None
            stop_group(a.proc.pid, a.proc)
            a.proc.wait()
            a.log_fh.close()
            self._say(f"interrupted {a.run.key} (it will run again from scratch)", force=True)
        if self.show and self.tty:
            self.stream.write("\n")
        if self.stop.is_set:
            return 130
        if self.refused:
            return 2
        return 1 if self.failed else 0

    def _launch(self, run: Run, taken: set[int]) -> Active:
        folder = self.folder(run)
        if folder.exists():
            reset_partial(folder)
        folder.mkdir(parents=True)
        config = with_own_ports(run.config, taken) if self.jobs > 1 else run.config
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [sys.executable, "-m", "services", "up", "--config", str(folder / "config.yaml"),
                "--run-dir", str(folder), "--prefix", prefix_for(self.spec, run), "--quiet", "--no-report"]
        if run.max_steps is not None:
            argv += ["--max-steps", str(run.max_steps)]
        fh = (folder / "up.log").open("ab")
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
        write_json(folder / CHILD, {"pid": proc.pid, "argv": argv, "started_at": time.time()})
        log.info("started run=%s pid=%d folder=%s", run.key, proc.pid, folder)
        ports = {config["engine"]["port"], config["proxy"]["port"]} if self.jobs > 1 else set()
        return Active(run, folder, proc, time.monotonic(), fh, ports=ports)

    def _watch(self, a: Active) -> None:
        """Follow the run's metrics; apply the wall-clock and accuracy stop rules."""
        a.rows = load_rows(a.folder / "metrics.jsonl")
        steps = [pick(r, STEP) for r in a.rows if r.get("service") == "trainer"]
        a.step = int(max(s for s in steps if s is not None)) if any(s is not None for s in steps) else None
        if a.stopped_by_rule or a.proc.poll() is not None:
            return
        rule = self.spec.stop
        if rule.wall_s is not None and time.monotonic() - a.started >= rule.wall_s:
            a.stopped_by_rule = f"wall-clock {rule.wall_s:g} s"
        elif rule.accuracy is not None and any((pick(r, EVAL_ACC) or 0.0) >= rule.accuracy
                                               and (number(r.get("eval/version")) or 0) >= 1 for r in a.rows):
            # a trained version (>= 1) must reach it, as for time_to_acc: the starting model says nothing
            a.stopped_by_rule = f"eval accuracy >= {rule.accuracy:g}"
        if a.stopped_by_rule:
            log.info("run=%s reached its stop rule (%s): stopping it", a.run.key, a.stopped_by_rule)
            os.killpg(a.proc.pid, signal.SIGTERM)

    def _settle(self, a: Active) -> None:
        a.log_fh.close()
        code = a.proc.returncode
        self._watch(a)
        reached_steps = a.run.max_steps is not None and a.step is not None and a.step >= a.run.max_steps
        ok = code == 0 and (reached_steps or a.stopped_by_rule is not None)
        duration = time.monotonic() - a.started
        if not ok:
            self.failed += 1
            self._say(f"FAILED {a.run.key}: exit {code}, step {a.step}; see {a.folder / 'up.log'} "
                      "(it runs again from scratch next time)", force=True)
            return
        row = self.row(a.run, a.rows, self.build(a.run))
        write_json(a.folder / RESULT, {"row": row, "exit": code, "duration_s": round(duration, 2),
                                       "ended_by": a.stopped_by_rule or "max_steps", "finished_at": time.time()})
        (a.folder / CHILD).unlink(missing_ok=True)
        self.finished += 1
        self.durations.append(duration)
        self._say(f"finished {a.run.key}: {a.step} steps, wall to K {row.get('wall_to_k_s') or 0:.0f} s, "
                  f"final eval {row.get('final_eval_acc')}", force=True)

    def row(self, run: Run, rows: list[dict[str, Any]], build: str | None) -> dict[str, Any]:
        """The run's summary.csv row from its metric rows (pure given the files of the run folder)."""
        folder = self.folder(run)
        info = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else {}
        return summ.run_row(rows, run.variant, run.seed, self.spec.targets, self.spec.stop.train_steps,
                            slots=self._slots(run), started_at=number(info.get("started_at")), run_dir=str(folder),
                            decisions=load_records(folder / DECISIONS_FILE), model_build=build)

    @staticmethod
    def _slots(run: Run) -> int:
        ops, rollout = run.config.get("ops") or {}, run.config.get("rollout") or {}
        return int(ops.get("workers", 2)) * int(rollout.get("concurrency", 1))

    # --- the one progress line -------------------------------------------------------------------

    def _progress(self, active: list[Active], n_pending: int) -> None:
        n = len(self.spec.runs)
        done = self.finished + self.skipped + self.failed
        parts = []
        for i, a in enumerate(active):
            k = a.run.max_steps
            parts.append(f"run {done + i + 1}/{n} {a.run.key} step {a.step if a.step is not None else '-'}"
                         + (f"/{k}" if k else ""))
        elapsed = time.monotonic() - self.started
        eta = "?"
        if self.durations:
            per = sum(self.durations) / len(self.durations)
            left = (n_pending + len(active)) * per / self.jobs - sum(time.monotonic() - a.started for a in active) / self.jobs
            eta = _clock(max(0.0, left))
        line = (" | ".join(parts) or "waiting") + f" | finished {self.finished + self.skipped}, failed {self.failed}" \
            f" | {_clock(elapsed)} elapsed, ETA {eta}"
        self._say(line)

    def _say(self, line: str, force: bool = False) -> None:
        if not self.show:
            return
        if self.tty and not force:
            self.stream.write("\r\x1b[2K" + line)
        elif force or time.monotonic() - self._last_plain >= 15.0:
            self.stream.write(("\r\x1b[2K" if self.tty else "") + line + "\n")
            self._last_plain = time.monotonic()
        self.stream.flush()

    # --- results -----------------------------------------------------------------------------------

    def rows(self, recompute: bool = False) -> list[dict[str, Any]]:
        """One row per finished run, in spec order; ``recompute``: derived again from metrics.jsonl."""
        out = []
        for run in self.spec.runs:
            done = self.folder(run) / RESULT
            if done.exists():
                stored = json.loads(done.read_text())["row"]
                metrics = self.folder(run) / "metrics.jsonl"
                out.append(self.row(run, load_rows(metrics), stored.get("model_build")) if recompute else stored)
        return out


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("experiment")
    try:
        only = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants is not None else None
        spec = load_spec(args.spec, quick=args.quick, only=only)
    except SpecError as exc:
        sys.stderr.write(f"dressage experiment: {exc}\n")
        return 2
    if args.jobs < 1:
        sys.stderr.write("dressage experiment: --jobs must be >= 1\n")
        return 2
    if args.check:
        sys.stdout.write(f"spec {spec.name}: {len(spec.runs)} runs, stop: {spec.stop.describe()}\n")
        for run in interleaved(spec.runs):
            sys.stdout.write(f"  {run.key}\n")
        return 0
    stop = StopFlag().install()
    exp = Experiment(spec, Path(args.out), args.jobs, stop, show=not args.quiet)
    code = 0 if args.report_only else exp.run_all()
    rows = exp.rows(recompute=args.report_only)
    from tools.experiments.report import write_outputs

    command = "dressage experiment " + " ".join(argv if argv is not None else sys.argv[1:])
    files = write_outputs(spec, rows, exp.root, command)
    sys.stdout.write(f"{len(rows)}/{len(spec.runs)} runs finished | summary: {files.csv}\n"
                     f"report: {files.html}\nresults: {files.markdown}\n")
    if files.table:
        sys.stdout.write(files.table + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
