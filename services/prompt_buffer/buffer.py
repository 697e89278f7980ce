"""The prompt-buffer's Redis shell: emits paced prompt groups from the dataset into ``{p}:prompts``.

Invariant: a batch of new groups, ``HINCRBY {p}:stats groups_produced`` and the dataset cursor
``{p}:prompt_buffer:cursor`` are written in ONE MULTI/EXEC guarded by WATCH on the cursor. So a
crash at any point leaves either all of them or none, and a restart (or a second buffer racing
the first) continues exactly after the last committed prompt — nothing skipped, nothing doubled.

How many groups may be emitted comes from ``pacing.PacingPolicy`` over the persistent counters
and the published version, plus a backpressure cap on the length of ``{p}:prompts``, all read in one
pipelined round trip. The loop wakes immediately on a new weight version (``VersionWatcher``) and
polls otherwise; the first emission under a version reports ``prompt_buffer/admit_lag_s``, the
seconds since that version's publication (the admission latency whenever pacing held groups back).

The dead-letter brake (``brake.BrakePolicy``) reads the ``{p}:dead`` entries of its window on
every step; while it is engaged nothing is emitted, ``{p}:prompt_buffer:brake`` (read by
``dressage status``) says why, and ``prompt_buffer/brake_engaged`` is 1 in the metrics.

Malformed dataset rows were skipped when the dataset was read (``shared.tasks.scan_dataset``); their
count is written to ``{p}:prompt_buffer:dataset`` at start (``dressage status``: DATASET) and reported
as ``prompt_buffer/malformed_rows``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from services.prompt_buffer.brake import BrakePolicy, why
from services.prompt_buffer.pacing import PacingInputs, PacingPolicy
from services.prompt_buffer.schedule import Cursor, Schedule, prompt_group
from shared import stats
from shared.codec import encode_entry
from shared.config import PromptBufferConfig
from shared.consumer import ConsumerLoop
from shared.errors import DressageError
from shared.keys import GROUP_ROLLOUT, Keys
from shared.lifecycle import StopFlag
from shared.streams import ensure_group
from shared.tasks.dataset import ScannedDataset
from shared.telemetry import Heartbeat, MetricGauges, report_metrics
from shared.versionbus import VersionWatcher, parse_version
from shared.versions import version_index

log = logging.getLogger(__name__)
SERVICE = "prompt-buffer"
COUNTERS = (stats.GROUPS_PRODUCED, stats.GROUPS_TRAINED, stats.GROUPS_DEAD_LETTERED)


def _int(raw: Any, key: str) -> int:
    try:
        return int(raw) if raw is not None else 0
    except ValueError as exc:
        raise DressageError(f"{key}: expected an integer, got {raw!r}") from exc


def _field(fields: dict[bytes, bytes], name: str) -> str:
    raw = fields.get(name.encode())
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else "unknown"


class PromptBuffer:
    def __init__(self, r: redis.Redis, keys: Keys, rows: list[dict[str, Any]], schedule: Schedule,
                 policy: PacingPolicy, cfg: PromptBufferConfig, *, consumer: str, burst: bool = False,
                 chunk: int = 64, heartbeat_ttl_s: float = 15.0, redis_factory: Callable[[], redis.Redis] | None = None,
                 stop: StopFlag | None = None, gauges: MetricGauges | None = None,
                 clock: Callable[[], float] = time.time, brake: BrakePolicy | None = None,
                 backoff_max_s: float = 5.0, dataset: ScannedDataset | None = None) -> None:
        self.r, self.keys, self.rows, self.schedule, self.policy = r, keys, rows, schedule, policy
        self.dataset = dataset  # what reading the dataset found (malformed rows skipped), shown by `dressage status`
        self.cfg, self.consumer, self.burst, self.chunk = cfg, consumer, burst, chunk
        self.stop = stop or StopFlag()
        self.loop = ConsumerLoop(SERVICE, self.stop, backoff_max_s=backoff_max_s)
        self.gauges = gauges
        self.clock = clock
        self.stats_key = stats.key(keys)
        self.cursor_key = keys.prompt_buffer_cursor
        self.brake_key = keys.prompt_buffer_brake
        self.brake = brake or BrakePolicy(None, 60.0)
        self.braked = False
        self.brake_why = ""
        self._factory = redis_factory or (lambda: r)
        self._wake = threading.Event()
        self._heartbeat = Heartbeat(r, keys, SERVICE, consumer, heartbeat_ttl_s)
        self._waiting_logged = False
        self._last_report = 0.0
        self.last_capacity = 0
        self.published_at: float | None = None  # of the newest version, as read by the last ``room``
        self._cursor: Cursor | None = None  # as the last ``emit`` read or wrote it (this step only)
        self._emitted_at = 0.0
        self._lag_version: int | None = None  # the version whose admission lag was reported last

    # --- reading state -------------------------------------------------------------------

    def _parse_cursor(self, raw: dict[bytes, bytes]) -> Cursor:
        return Cursor(_int(raw.get(b"epoch"), f"{self.cursor_key}.epoch"),
                      _int(raw.get(b"position"), f"{self.cursor_key}.position"))

    def cursor(self) -> Cursor:
        return self._parse_cursor(self.r.hgetall(self.cursor_key))

    def room(self) -> tuple[int, PacingInputs]:
        """How many groups may be emitted now, and the counters it was computed from.

        Everything a pacing decision reads (the newest version, its log's length, the counters, the
        prompt stream's length) comes back in one pipelined round trip: each extra round trip delayed
        the admission that follows a publication (docs/benchmarks.md). Only keyed commands go in it:
        a cluster client refuses to pipeline keyless ones such as TIME."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.weights_latest)
            pipe.xlen(self.keys.weights_log)
            pipe.hmget(self.stats_key, list(COUNTERS))
            pipe.xlen(self.keys.prompts)
            raw_latest, log_len, values, prompts_len = pipe.execute()
        latest = parse_version(raw_latest)
        self.published_at = latest.published_at if latest is not None else None
        counts = [_int(v, f"{self.stats_key}.{name}") for v, name in zip(values, COUNTERS, strict=True)]
        state = PacingInputs(version_index(latest.version if latest else None, int(log_len) if latest else 0), *counts)
        capacity = self.policy.capacity(state)
        stream_room = self.cfg.max_stream_len - int(prompts_len)
        self.last_capacity = max(0, min(capacity, stream_room))
        return self.last_capacity, state

    def check_brake(self) -> bool:
        """Count the dead letters of the brake window (Redis clock); True while admissions are paused."""
        if not self.brake.enabled:
            return False
        sec, usec = self.r.time()
        start_ms = max(0, int(sec) * 1000 + int(usec) // 1000 - int(self.brake.window_s * 1000))
        with self.r.pipeline(transaction=False) as pipe:
            pipe.xrange(self.keys.dead, min=f"{start_ms}-0", max="+", count=self.brake.limit + 1)
            pipe.exists(self.brake_key)
            entries, brake_key_exists = pipe.execute()
        engaged = self.brake.engaged(self.braked, len(entries))
        if engaged:
            self.brake_why = why((_field(f, "reason") for _, f in entries), len(entries), self.brake)
        if engaged != self.braked:
            if engaged:
                log.warning("admissions paused by the dead-letter brake: %s", self.brake_why)
            else:
                log.info("admissions resumed: %d dead letters in the last %.0fs (released at <= %d)",
                         len(entries), self.brake.window_s, self.brake.limit // 2)
                self.brake_why = ""
            self.braked = engaged
            self._last_report = 0.0  # the change shows in the metrics at once
        if engaged or brake_key_exists:
            self.r.hset(self.brake_key, mapping={"engaged": int(engaged), "why": self.brake_why,
                                                 "recent": len(entries), "limit": self.brake.limit,
                                                 "window_s": self.brake.window_s, "updated_at": f"{self.clock():.3f}"})
        return engaged

    def record_dataset(self) -> None:
        """``{p}:prompt_buffer:dataset``: the rows read and the malformed rows skipped (``dressage status``)."""
        d = self.dataset
        if d is None:
            return
        self.r.delete(self.keys.prompt_buffer_dataset)
        self.r.hset(self.keys.prompt_buffer_dataset, mapping={
            "path": d.path, "rows": len(d.rows), "malformed": d.skipped,
            "first_error": str(d.errors[0])[:500] if d.errors else ""})

    # --- emitting --------------------------------------------------------------------------

    def emit(self, limit: int) -> int:
        """Emit up to ``limit`` new groups after the stored cursor, atomically with the cursor."""
        if limit <= 0:
            return 0
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.cursor_key)
                    cursor = self._parse_cursor(pipe.hgetall(self.cursor_key))
                    items, after = self.schedule.take(cursor, limit)
                    if not items:
                        pipe.reset()
                        self._cursor = cursor
                        return 0
                    now = self._emitted_at = self.clock()
                    groups = [prompt_group(self.rows[i], e, i, self.cfg.n_samples, now) for e, i in items]
                    pipe.multi()
                    for g in groups:
                        pipe.xadd(self.keys.prompts, encode_entry(g))
                    pipe.hincrby(self.stats_key, stats.GROUPS_PRODUCED, len(groups))
                    pipe.hset(self.cursor_key, mapping={"epoch": after.epoch, "position": after.position,
                                                        "rows": self.schedule.n_rows})
                    pipe.execute()
                except redis.WatchError:
                    continue  # another buffer moved the cursor: recompute from the new one
                self._cursor = after
                for g in groups:
                    log.debug("emitted group_id=%s attempt=0 prompt_id=%s", g.group_id, g.prompt_id)
                log.info("emitted %d group(s) group_id=%s..%s cursor=epoch %d position %d", len(groups),
                         groups[0].group_id, groups[-1].group_id, after.epoch, after.position)
                return len(groups)

    def step(self) -> int:
        """One pacing decision and emission; returns how many groups were emitted."""
        self._cursor = None
        room, state = self.room()
        if state.version_index is None:
            if not self._waiting_logged:
                log.info("waiting for the trainer to publish its first weight version before emitting")
                self._waiting_logged = True
            return 0
        self._waiting_logged = False
        if self.check_brake():
            self._report(state, 0)
            return 0
        emitted = self.emit(min(room, self.chunk))
        lag = None
        if emitted and self.published_at is not None and state.version_index != self._lag_version:
            lag = self._emitted_at - self.published_at  # first admission under this version
            self._lag_version = state.version_index
        self._report(state, emitted, lag)
        return emitted

    def _report(self, state: PacingInputs, emitted: int, admit_lag_s: float | None = None) -> None:
        now = time.monotonic()
        if emitted == 0 and now - self._last_report < 5.0:
            return
        self._last_report = now
        metrics: dict[str, float] = {}
        if admit_lag_s is not None:  # seconds from the newest version's publication to its first admission
            metrics["prompt_buffer/admit_lag_s"] = round(admit_lag_s, 5)
        metrics |= {"prompt_buffer/groups_produced": state.groups_produced + emitted,
                   "prompt_buffer/in_flight": state.in_flight + emitted,
                   "prompt_buffer/capacity": self.last_capacity - emitted,
                   "prompt_buffer/version_index": -1 if state.version_index is None else state.version_index,
                   "prompt_buffer/brake_engaged": int(self.braked),
                   "prompt_buffer/malformed_rows": self.dataset.skipped if self.dataset is not None else 0}
        report_metrics(self.r, self.keys, SERVICE, metrics)
        if self.gauges is not None:
            self.gauges.set(metrics)

    # --- loop --------------------------------------------------------------------------------

    def run(self) -> int:
        """Emit until stopped (burst: until nothing more may be emitted now); returns the exit code."""
        watcher = VersionWatcher(self._factory, self.keys, on_version=lambda wv: self._wake.set(), poll_s=1.0,
                                 backoff_max_s=self.loop.backoff.max_s)
        if not self.burst:
            watcher.start()
        ensure_group(self.r, self.keys.prompts, GROUP_ROLLOUT)  # deliver from the first entry on
        self.record_dataset()
        total = 0

        def step() -> bool:
            nonlocal total
            emitted = self.step()
            cursor = self._cursor if self._cursor is not None else self.cursor()  # emit's, under WATCH
            exhausted = self.schedule.exhausted(cursor)
            self._heartbeat.beat({"epoch": cursor.epoch, "position": cursor.position,
                                  "capacity": self.last_capacity, "exhausted": exhausted, "paused": self.brake_why})
            total += emitted
            return emitted > 0 and not (self.burst and exhausted)

        def idle() -> None:
            self._wake.wait(self.cfg.poll_s)  # a new version wakes us at once
            self._wake.clear()

        try:
            self.loop.run(step, burst=self.burst, idle=idle)
        finally:
            watcher.stop()
        log.info("prompt-buffer stopping after emitting %d group(s) this run", total)
        return 0
