"""Procfile-style process supervision for ``dressage up``: start in tiers, watch, stop in reverse.

Contract:
* processes start tier by tier (lowest first); a tier whose processes have a ``ready`` probe is
  waited for (probe true, or the process dies / times out -> ``ServiceFailed``) before the next starts;
* every child runs in its own process group, so Ctrl-C reaches only the supervisor, which then stops
  the children itself: SIGTERM to every process of the highest tier, wait up to ``grace_s``, SIGKILL
  what is left, then the next tier down (workers stop before the proxy they use);
* every child stays in the supervisor's session: on Linux a session is a scheduler autogroup, and a
  service in a session of its own would share the CPU with the others as a peer group, whatever its
  ``nice`` or ``sched`` (they then only rank threads inside the service);
* a child that exits ends the run: exit 0 of an ``ends_run`` process is success; exit 0 of a
  ``may_finish`` process is noted and the others keep running; any other exit is a failure naming the
  process, its exit code and the last lines of its log -- unless ``restart`` is on, in which case it is
  started again after an exponential backoff (``RestartPolicy``, pure) until its budget is spent;
  the budget recovers after a healthy period (a run of at least ``stable_s`` resets the count);
* an ``optional`` process (the eval-worker) never ends the run: when it fails (without restart, or
  with its restart budget spent) it is *reported* -- ``degraded`` names it with the reason, one
  error line -- and, with restart on, it is still tried again every ``cap_s`` (it comes back by
  itself once the cause is gone, and then leaves ``degraded``);
* a ``prefork`` process (``python -m`` of a service that loads torch) is forked from one pre-imported
  launcher (tools/deploy/prefork.py) with the same setup, group, session and log as an exec'd one; when no
  launcher can start, it is exec'd.
The supervisor never leaves a child behind: ``stop()`` is idempotent and runs on every exit path.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, Protocol

from shared.errors import DressageError
from tools.deploy.childsetup import child_setup
from tools.deploy.prefork import ForkedProcess, Launcher, LauncherFailed, ensure_launcher

log = logging.getLogger(__name__)


class ServiceFailed(DressageError):
    """A supervised process died (or never became ready); carries its name, exit code and log tail."""

    def __init__(self, name: str, exit_code: int | None, tail: str, why: str = "exited") -> None:
        super().__init__(f"{name} {why} (exit code {exit_code})")
        self.name, self.exit_code, self.tail, self.why = name, exit_code, tail, why


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # unique, e.g. "rollout-worker-2"
    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)  # merged over os.environ
    log_path: Path | None = None  # stdout+stderr appended here; None = inherit the supervisor's
    tier: int = 0  # start order; stopped in reverse
    ready: Callable[[], bool] | None = None  # readiness probe polled after start
    ready_timeout_s: float = 120.0
    ends_run: bool = False  # exit 0 ends the run successfully (the trainer after max_steps)
    may_finish: bool = False  # exit 0 is a normal end of this process only (not restarted)
    optional: bool = False  # its failure is reported (``Supervisor.degraded``), never fatal to the run
    cwd: str | None = None
    nice: int = 0  # added to the child's niceness before exec (0..19): lower CPU priority under contention
    sched: str | None = None  # Linux scheduling policy set before exec: "batch" or "idle" (SCHED_*); None = normal
    # ``python -m MODULE ...`` forked from the pre-imported launcher (tools/deploy/prefork.py), which imports this
    # module (e.g. "services.trainer.main") and torch once for all; None = exec'd as a process of its own
    prefork: str | None = None


@dataclass(frozen=True)
class RestartPolicy:
    """Pure backoff arithmetic: delay before restart number ``n`` (0-based) of one process."""

    base_s: float = 1.0
    cap_s: float = 30.0
    max_restarts: int = 10  # per process, reset after a run of at least ``stable_s``
    stable_s: float = 60.0

    def delay(self, n: int) -> float:
        return float(min(self.cap_s, self.base_s * (2 ** max(0, n))))

    def count_after(self, previous: int, uptime_s: float) -> int:
        """Restart count to use after a process ran ``uptime_s``: a long healthy run resets it."""
        return 0 if uptime_s >= self.stable_s else previous

    def exhausted(self, n: int) -> bool:
        return n >= self.max_restarts


@dataclass
class RunResult:
    outcome: Literal["finished", "failed", "stopped"]
    name: str | None = None  # the process that ended (or broke) the run
    exit_code: int | None = None
    tail: str = ""
    why: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome != "failed"

    def describe(self) -> str:
        if self.outcome == "finished":
            return f"run finished: {self.name} exited 0"
        if self.outcome == "stopped":
            return f"run stopped ({self.why or 'signal'})"
        return f"run failed: {self.name} {self.why} with exit code {self.exit_code}"


def tail_lines(path: Path | None, n: int = 20, max_bytes: int = 64_000) -> str:
    """The last ``n`` lines of a log file (bounded read), or "" when there is none."""
    if path is None or not path.exists():
        return ""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - max_bytes))
        data = fh.read().decode("utf-8", errors="replace")
    return "\n".join(data.splitlines()[-n:])


def _tick_if_due(tick: Callable[[], None] | None, last_tick: float, every_s: float) -> float:
    """Call ``tick`` when ``every_s`` has passed since ``last_tick`` (monotonic); the new last tick time."""
    if tick is None or time.monotonic() - last_tick < every_s:
        return last_tick
    tick()
    return time.monotonic()


class Proc(Protocol):
    """A started child: ``subprocess.Popen`` or a ``prefork.ForkedProcess``."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass
class _Child:
    spec: ProcessSpec
    proc: Proc | None = None
    log_fh: IO[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None  # scheduled restart time (monotonic)
    finished: bool = False  # a may_finish process that exited 0


class Supervisor:
    def __init__(self, specs: Sequence[ProcessSpec], restart: bool = False, grace_s: float = 30.0,
                 policy: RestartPolicy | None = None, poll_s: float = 0.2) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate process names: {names}")
        self.children = [_Child(s) for s in specs]
        self.restart, self.grace_s, self.poll_s = restart, grace_s, poll_s
        self.policy = policy or RestartPolicy()
        self.degraded: dict[str, str] = {}  # optional process name -> why it is not (reliably) running
        self._stopped = False
        self._preloads = sorted({s.prefork for s in specs if s.prefork})
        self._launcher: Launcher | None = None
        self._prefork_failed = False  # the launcher could not start: every service is exec'd from then on

    # -- starting -------------------------------------------------------------------------
    def _spawn(self, child: _Child) -> None:
        spec = child.spec
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        out: IO[bytes] | None = None
        if spec.log_path is not None:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = spec.log_path.open("ab")
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {spec.name}: "
                      f"{' '.join(spec.argv)}\n".encode())
            out.flush()
        child.log_fh = out
        child.proc = self._forked(spec, env) if spec.prefork else None
        if child.proc is None:
            child.proc = subprocess.Popen(
                list(spec.argv), env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT if out else None, process_group=0,
                preexec_fn=child_setup(spec.nice, spec.sched))
        child.started_at = time.monotonic()
        child.restart_at = None
        forked = isinstance(child.proc, ForkedProcess)
        log.info("started %s pid=%d%s", spec.name, child.proc.pid, " (forked, pre-imported)" if forked else "")

    def _forked(self, spec: ProcessSpec, env: dict[str, str]) -> Proc | None:
        """``spec`` forked from the launcher (started on first use, again after it died); None when no launcher
        can run -- the caller execs the service then, as without prefork."""
        argv = list(spec.argv)
        if self._prefork_failed or len(argv) < 3 or argv[1] != "-m":
            return None
        try:
            self._launcher = ensure_launcher(self._launcher, argv[0], sorted({*self._preloads, spec.prefork or ""} - {""}))
            return self._launcher.spawn(argv[2], argv[3:], env, spec.cwd,
                                        str(spec.log_path) if spec.log_path else None, spec.nice, spec.sched)
        except LauncherFailed as exc:
            log.warning("%s; starting %s and every later service as a process of its own", exc, spec.name)
            self._prefork_failed = True
            return None

    def start(self, stop_requested: Callable[[], bool] = lambda: False) -> None:
        """Start every tier in order, waiting for readiness probes; raises ``ServiceFailed``."""
        for tier in sorted({c.spec.tier for c in self.children}):
            group = [c for c in self.children if c.spec.tier == tier]
            for child in group:
                self._spawn(child)
            for child in group:
                if child.spec.ready is not None:
                    self._wait_ready(child, stop_requested)
            if stop_requested():
                return

    def _wait_ready(self, child: _Child, stop_requested: Callable[[], bool]) -> None:
        deadline = time.monotonic() + child.spec.ready_timeout_s
        assert child.proc is not None and child.spec.ready is not None
        while not stop_requested():
            code = child.proc.poll()
            if code is not None:
                raise ServiceFailed(child.spec.name, code, tail_lines(child.spec.log_path),
                                    "exited before it was ready")
            if child.spec.ready():
                log.info("%s is ready", child.spec.name)
                return
            if time.monotonic() > deadline:
                raise ServiceFailed(child.spec.name, None, tail_lines(child.spec.log_path),
                                    f"was not ready within {child.spec.ready_timeout_s:.0f}s")
            time.sleep(self.poll_s)

    # -- watching -------------------------------------------------------------------------
    def poll(self) -> RunResult | None:
        """Reap exited children, schedule/perform restarts; a result when the run must end."""
        now = time.monotonic()
        for child in self.children:
            if child.finished:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    log.warning("restarting %s (restart %d)", child.spec.name, child.restarts)
                    self._spawn(child)
                continue
            if child.proc is None:
                continue
            code = child.proc.poll()
            if code is None:
                if child.spec.name in self.degraded and now - child.started_at >= self.policy.stable_s:
                    log.info("%s is healthy again (up %.0fs)", child.spec.name, now - child.started_at)
                    del self.degraded[child.spec.name]
                continue
            self._close_log(child)
            spec = child.spec
            if code == 0 and spec.ends_run:
                return RunResult("finished", spec.name, 0)
            if code == 0 and spec.may_finish:
                log.info("%s finished (exit 0)", spec.name)
                child.finished = True
                continue
            tail = tail_lines(spec.log_path)
            if self.restart:
                child.restarts = self.policy.count_after(child.restarts, now - child.started_at)
                if not self.policy.exhausted(child.restarts):
                    delay = self.policy.delay(child.restarts)
                    child.restarts += 1
                    child.restart_at = now + delay
                    log.warning("%s exited with code %s; restarting in %.1fs", spec.name, code, delay)
                    continue
                if spec.optional:
                    self._degrade(child, f"exited {child.restarts + 1} times (last code {code}); "
                                         f"retried every {self.policy.cap_s:.0f}s", tail)
                    child.restart_at = now + self.policy.cap_s
                    continue
                return RunResult("failed", spec.name, code, tail, f"exited {child.restarts} times")
            if spec.optional:
                self._degrade(child, f"exited with code {code} (not restarted: restart is off)", tail)
                child.finished = True
                continue
            return RunResult("failed", spec.name, code, tail, "exited")
        return None

    def _degrade(self, child: _Child, why: str, tail: str) -> None:
        """Report an optional process that is down; the run goes on."""
        if self.degraded.get(child.spec.name) != why:
            log.error("optional service %s is down: %s; the run continues without it. Last lines:\n%s",
                      child.spec.name, why, tail)
        self.degraded[child.spec.name] = why

    def run(self, stop_requested: Callable[[], bool], tick: Callable[[], None] | None = None,
            tick_every_s: float = 1.0, before_stop: Callable[[RunResult], None] | None = None) -> RunResult:
        """Start everything, watch until a result or a stop request, always stop the children.

        ``before_stop(result)`` runs while the children are still up (e.g. to stop some tiers
        early and wait for a last evaluation); the full stop follows it in every case."""
        try:
            result = self._watch(stop_requested, tick, tick_every_s)
            if before_stop is not None:
                before_stop(result)
            return result
        finally:
            self.stop()

    def _watch(self, stop_requested: Callable[[], bool], tick: Callable[[], None] | None,
               tick_every_s: float) -> RunResult:
        try:
            self.start(stop_requested)
        except ServiceFailed as exc:
            return RunResult("failed", exc.name, exc.exit_code, exc.tail, exc.why)
        last_tick = 0.0
        while not stop_requested():
            result = self.poll()
            if result is not None:
                return result
            last_tick = _tick_if_due(tick, last_tick, tick_every_s)
            time.sleep(self.poll_s)
        return RunResult("stopped", why="stop requested")

    def run_to_end(self, spec: ProcessSpec, timeout_s: float, stop_requested: Callable[[], bool],
                   tick: Callable[[], None] | None = None, tick_every_s: float = 1.0) -> int | None:
        """Start one more process (a burst job after the run, e.g. deferred evaluations) and wait for it to
        exit. Returns its exit code, or None when ``timeout_s`` passed or a stop was requested first; it is
        then stopped like any child (``stop(min_tier=spec.tier)``: give it a tier of its own). It joins
        the children, so ``pids()`` shows it and the final ``stop()`` reaps it in every case."""
        if any(c.spec.name == spec.name for c in self.children):
            raise ValueError(f"duplicate process name: {spec.name}")
        child = _Child(spec)
        self.children.append(child)
        self._spawn(child)
        assert child.proc is not None
        deadline, last_tick = time.monotonic() + timeout_s, 0.0
        while child.proc.poll() is None:
            if stop_requested() or time.monotonic() >= deadline:
                log.warning("%s still running after %.0fs or a stop was requested: stopping it",
                            spec.name, timeout_s)
                self.stop(min_tier=spec.tier)
                return None
            last_tick = _tick_if_due(tick, last_tick, tick_every_s)
            time.sleep(self.poll_s)
        self._signal(child, signal.SIGKILL, group_only=True)  # any grandchild it left (an rq work horse)
        self._close_log(child)
        log.info("%s exited with code %s", spec.name, child.proc.returncode)
        return child.proc.returncode

    # -- stopping -------------------------------------------------------------------------
    def stop(self, min_tier: int | None = None) -> dict[str, int | None]:
        """SIGTERM tier by tier from the highest, wait ``grace_s``, SIGKILL the rest. Exit codes by name.

        With ``min_tier`` only the tiers at or above it are stopped (the others keep running and a
        later full ``stop()`` still ends them); without it the supervisor is done for good."""
        codes: dict[str, int | None] = {}
        if self._stopped:
            return {c.spec.name: (c.proc.returncode if c.proc else None) for c in self.children}
        if min_tier is None:
            self._stopped = True
        for tier in sorted({c.spec.tier for c in self.children}, reverse=True):
            if min_tier is not None and tier < min_tier:
                continue
            group = [c for c in self.children if c.spec.tier == tier and c.proc is not None]
            alive = [c for c in group if c.proc is not None and c.proc.poll() is None]
            for child in alive:
                self._signal(child, signal.SIGTERM)
            t0 = time.monotonic()
            deadline = t0 + self.grace_s
            for child in alive:
                assert child.proc is not None
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs: SIGKILL", child.spec.name, self.grace_s)
                    self._signal(child, signal.SIGKILL)
                    child.proc.wait(10)
            for child in group:
                assert child.proc is not None
                # The process group may hold grandchildren (e.g. an rq work horse): reap them too.
                self._signal(child, signal.SIGKILL, group_only=True)
                codes[child.spec.name] = child.proc.returncode
                self._close_log(child)
            if alive:
                log.info("stopped %s in %.2fs", " ".join(c.spec.name for c in alive), time.monotonic() - t0)
        if min_tier is None and self._launcher is not None:
            self._launcher.close()
        return codes

    @staticmethod
    def _signal(child: _Child, sig: int, group_only: bool = False) -> None:
        assert child.proc is not None
        try:
            os.killpg(child.proc.pid, sig)  # own process group: pgid == pid
        except (ProcessLookupError, PermissionError):
            if not group_only and child.proc.poll() is None:
                child.proc.send_signal(sig)

    @staticmethod
    def _close_log(child: _Child) -> None:
        if child.log_fh is not None:
            child.log_fh.close()
            child.log_fh = None

    def pids(self) -> dict[str, int]:
        return {c.spec.name: c.proc.pid for c in self.children if c.proc is not None}
