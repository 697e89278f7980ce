"""The live progress line of ``dressage up``, and the run's metric log, fed from Redis once per tick.

Each ``tick``: append new ``{p}:metrics`` entries to ``<run>/metrics.jsonl``; every
``stats_every_s`` report a snapshot of ``{p}:stats`` as service ``ops`` (so drops, retries and dead
letters over time are in the metrics, for ``dressage report`` of a live or finished run), with the
engine's and proxy's clocks from ``probe`` (``tools.monitor.probes``) in the same row; then draw
one line: step, version, reward, eval accuracy, groups in flight, dropped, retried, dead. On a
terminal the line is redrawn in place; otherwise a line is written every ``plain_every_s``.
Redis errors never stop the run: the tick is skipped and the error shown once.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import redis

from shared.keys import Keys
from shared.stats import key as stats_key
from shared.telemetry import report_metrics
from shared.versionbus import read_latest
from tools.reports import series
from tools.reports.metricslog import MetricsLog

log = logging.getLogger(__name__)


def progress_line(rows: Sequence[Mapping[str, Any]], stats: Mapping[str, int], version: str | None,
                  max_steps: int | None, elapsed_s: float) -> str:
    """Pure: the one-line summary from the newest metric rows and the {p}:stats counters."""
    train = next((r for r in reversed(rows) if r.get("service") == "trainer"
                  and series.pick(r, series.STEP) is not None), None)
    ev = next((r for r in reversed(rows) if series.pick(r, series.EVAL_ACC) is not None), None)
    step_n = None if train is None else series.pick(train, series.STEP)
    step = "-" if step_n is None else f"{step_n:.0f}"
    if max_steps:
        step += f"/{max_steps}"
    reward = None if train is None else series.pick(train, series.REWARD)
    acc = None if ev is None else series.pick(ev, series.EVAL_ACC)
    acc_v = None if ev is None else series.version_of(ev)
    in_flight = stats.get("groups_produced", 0) - stats.get("groups_trained", 0) - stats.get("groups_dead_lettered", 0)
    parts = [
        f"step {step}",
        f"v{version if version is not None else '-'}",
        "reward " + ("-" if reward is None else f"{reward:.3f}"),
        "eval " + ("-" if acc is None else f"{acc:.2f}" + ("" if acc_v is None else f" (v{acc_v:.0f})")),
        f"in flight {in_flight}",
        f"dropped {stats.get('groups_dropped_stale', 0)}",
        f"retried {stats.get('groups_reenqueued', 0)}",
        f"dead {stats.get('groups_dead_lettered', 0) + stats.get('poison_dead_lettered', 0)}",
        f"{int(elapsed_s) // 60}m{int(elapsed_s) % 60:02d}s",
    ]
    return " | ".join(parts)


class Progress:
    def __init__(self, r: redis.Redis, keys: Keys, metrics: MetricsLog, max_steps: int | None = None,
                 out: IO[str] | None = None, stats_every_s: float = 5.0, plain_every_s: float = 15.0,
                 show: bool = True, probe: Callable[[], Mapping[str, float]] | None = None) -> None:
        self.r, self.keys, self.metrics, self.max_steps = r, keys, metrics, max_steps
        self.probe = probe
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self.stats_every_s, self.plain_every_s, self.show = stats_every_s, plain_every_s, show
        self.started = time.monotonic()
        self._last_stats = 0.0
        self._last_plain = 0.0
        self._warned = False
        self.line = ""

    def _stats(self) -> dict[str, int]:
        raw = self.r.hgetall(stats_key(self.keys))
        return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}

    def tick(self) -> None:
        try:
            stats = self._stats()
            now = time.monotonic()
            if now - self._last_stats >= self.stats_every_s:
                sampled = dict(self.probe()) if self.probe is not None else {}
                report_metrics(self.r, self.keys, "ops", {**{f"stats/{k}": v for k, v in stats.items()}, **sampled})
                self._last_stats = now
            self.metrics.pull(self.r, self.keys)  # after the snapshot, so the log holds it too
            latest = read_latest(self.r, self.keys)
        except redis.RedisError as exc:
            if not self._warned:
                log.warning("progress: cannot read Redis (%s); will retry", exc)
                self._warned = True
            return
        self._warned = False
        self.line = progress_line(self.metrics.rows, stats, latest.version if latest else None,
                                  self.max_steps, time.monotonic() - self.started)
        self._draw()

    def _draw(self) -> None:
        if not self.show:
            return
        if self.tty:
            self.out.write("\r\x1b[2K" + self.line)
            self.out.flush()
        elif time.monotonic() - self._last_plain >= self.plain_every_s:
            self.out.write(self.line + "\n")
            self.out.flush()
            self._last_plain = time.monotonic()

    def sample_now(self) -> None:
        """A stats snapshot with the probes now: after the last step, while the services still answer."""
        self._last_stats = 0.0
        self.tick()

    def finish(self) -> None:
        """Final pull and stats snapshot (forced), and end the in-place line."""
        self._last_stats = self._last_plain = 0.0
        self.tick()
        if self.show and self.tty:
            self.out.write("\n")
            self.out.flush()
