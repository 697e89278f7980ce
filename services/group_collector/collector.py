"""The group-collector's loop (Redis shell around ``core.CollectorCore``).

Each step: follow the published version log and ``{p}:control`` (``keep_versions``), reclaim
idle rollout entries of dead collectors, read new ones (own pending first after a restart),
decode them (poison → ``{p}:dead`` reason ``malformed``), let the core decide, commit each action
atomically (``ledger.Ledger``), then cut batches while fewer than ``max_ready_batches`` batches wait
undelivered for the trainer.

Crash safety: a group waiting for a batch stays *pending* (un-acked) in ``{p}:rollouts``; it is
acknowledged only in the MULTI that writes its batch. A restarted collector re-reads its own pending
entries and rebuilds the waiting list; while alive it re-claims them (XCLAIM JUSTID) well within
``claim_idle_ms`` so no other collector mistakes them for a dead consumer's entries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from services.group_collector.core import CollectorCore
from services.group_collector.decisions import DecisionLog
from services.group_collector.ledger import Ledger
from services.group_collector.outcomes import Action, Arrival, BatchOut
from shared.codec import decode_entry
from shared.codes import MALFORMED, UNSUPPORTED_SCHEMA
from shared.config import CollectorConfig, StalenessSection
from shared.consumer import ConsumerLoop
from shared.errors import ConfigError, UnsupportedSchema
from shared.keys import GROUP_COLLECTOR, GROUP_ROLLOUT, GROUP_TRAINER, Keys
from shared.lifecycle import StopFlag
from shared.schemas import RolloutGroup
from shared.streams import Entry, GroupReader, ensure_group, next_id, reclaim, trim_acked
from shared.telemetry import Heartbeat, MetricGauges, report_metrics
from shared.versionbus import VersionWatcher, read_latest, read_log

log = logging.getLogger(__name__)
SERVICE = "group-collector"
_STAT_METRICS = {"groups_dropped_stale": "staleness/dropped_groups",
                 "partial_rollout_rejected_groups": "staleness/partial_rollout_rejected_groups",
                 "partial_rollout_rejected_samples": "staleness/partial_rollout_rejected_samples"}


def _s(raw: Any) -> str:
    return raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)


class _Every:
    """A due-check for periodic chores (monotonic clock); ``due()`` is True at most once per period."""

    def __init__(self, period_s: float) -> None:
        self.period_s, self._next = period_s, 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if self.period_s <= 0 or now < self._next:
            return False
        self._next = now + self.period_s
        return True


class GroupCollector:
    def __init__(self, r: redis.Redis, keys: Keys, core: CollectorCore, cfg: CollectorConfig,
                 staleness: StalenessSection, *, consumer: str, burst: bool = False, heartbeat_ttl_s: float = 15.0,
                 backoff_max_s: float = 5.0, redis_factory: Callable[[], redis.Redis] | None = None,
                 stop: StopFlag | None = None, gauges: MetricGauges | None = None) -> None:
        self.r, self.keys, self.core, self.consumer = r, keys, core, consumer
        self.cfg, self.staleness, self.burst = cfg, staleness, burst
        self.stop, self.gauges = stop or StopFlag(), gauges
        self.loop = ConsumerLoop(SERVICE, self.stop, backoff_max_s=backoff_max_s)
        self.ledger = Ledger(r, keys)
        self.decisions = DecisionLog(r, keys)
        self.reader = GroupReader(r, keys.rollouts, GROUP_COLLECTOR, consumer)
        self.window_key = keys.collector_window
        self._factory = redis_factory or (lambda: r)
        self._heartbeat = Heartbeat(r, keys, SERVICE, consumer, heartbeat_ttl_s)
        self._versions_dirty = threading.Event()
        self._versions_dirty.set()
        self._log_cursor = "0-0"  # last {p}:weights:log entry read
        self._published: list[str] = []
        self._keep_raw: object = object()  # last keep_versions value applied (sentinel: none yet)
        self._control = _Every(cfg.control_poll_s)
        self._reclaim = _Every(cfg.claim_idle_ms / 2000)
        self._touch = _Every(cfg.claim_idle_ms / 3000)
        self._trim = _Every(cfg.trim_interval_s)
        self._metrics = _Every(cfg.metrics_interval_s)
        self._window_written: dict[str, str] = {}

    # --- inputs: versions, control, entries -------------------------------------------------

    def sync_versions(self) -> list[Action]:
        """Read new ``{p}:weights:log`` entries and order the window by the whole log."""
        self._versions_dirty.clear()
        self._log_cursor, new = read_log(self.r, self.keys, self._log_cursor)
        if not new:
            return []
        self._published.extend(new)
        return self.core.on_published(self._published) if self.staleness.order_by_published else []

    def sync_control(self) -> list[Action]:
        """Apply ``{p}:control`` field ``keep_versions`` (absent → the config value) when it changes."""
        raw = self.r.hget(self.keys.control, "keep_versions")
        value: object = _s(raw) if raw is not None else self.staleness.keep_versions
        if value == self._keep_raw:
            return []
        self._keep_raw = value
        try:
            actions = self.core.on_keep_versions(value)
        except (ConfigError, ValueError, TypeError) as exc:  # every bad live value: logged once, ignored
            log.error("ignoring %s keep_versions=%r: %s", self.keys.control, value, exc)
            return []
        log.info("keep_versions=%s (from %s)", value, "control" if raw is not None else "config")
        return actions

    def ingest(self, entries: list[Entry]) -> list[Action]:
        """Decode entries (poison dead-lettered at once) and hand the valid ones to the core."""
        arrivals: list[Arrival] = []
        for entry in {e.id: e for e in entries}.values():  # reclaimed and re-read in one step: once
            try:
                arrivals.append(Arrival(entry.id, decode_entry(entry.fields, RolloutGroup), entry.fields))
            except UnsupportedSchema as exc:  # a v1 group its v1 worker already handled (docs/streams.md)
                self.ledger.poison(entry.id, entry.fields, UNSUPPORTED_SCHEMA, exc.reason)
            except Exception as exc:  # the poison guard: whatever fails to decode is dead-lettered
                self.ledger.poison(entry.id, entry.fields, MALFORMED, f"{type(exc).__name__}: {exc}")
        done, closed = self.ledger.lookup(arrivals)
        return self.core.on_arrivals(arrivals, done, closed)

    # --- outputs -----------------------------------------------------------------------------

    def execute(self, actions: list[Action]) -> None:
        """Commit actions in order; keys found done elsewhere become discards, failures roll back."""
        queue = list(actions)
        while queue:
            action = queue.pop(0)
            try:
                already = self.ledger.commit(action)
            except BaseException:
                for undone in reversed([action, *queue]):
                    self.core.forget(undone)
                raise
            if already:
                queue[:0] = self.core.rejected(action, already)
            elif isinstance(action, BatchOut):  # with its id: the trainer's row of it completes the time split
                self.report({**action.metrics, "collector/batch_id": action.batch.batch_id})
            if not already:
                self.decisions.record(action, self.core.tracker)  # {p}:collector:decisions, replayable

    def ready_batches(self) -> int:
        """Batches in ``{p}:batches`` not yet delivered to the trainer group (all, if it has none)."""
        try:
            groups = self.r.xinfo_groups(self.keys.batches)
        except redis.ResponseError:
            return 0  # no batches stream yet
        last = next((g["last-delivered-id"] for g in groups if _s(g["name"]) == GROUP_TRAINER), None)
        if last is None:
            return int(self.r.xlen(self.keys.batches))
        return len(self.r.xrange(self.keys.batches, min=next_id(last), max="+", count=self.cfg.max_ready_batches))

    def assemble(self) -> list[Action]:
        if len(self.core.waiting) < self.core.groups_per_batch:
            return []
        slots = self.cfg.max_ready_batches - self.ready_batches()
        if slots <= 0:
            return []
        latest = read_latest(self.r, self.keys)
        return self.core.assemble(slots, latest.version if latest else None)

    # --- chores ------------------------------------------------------------------------------

    def touch_waiting(self) -> None:
        """Reset the idle time of the entries we hold, so no live collector looks dead."""
        ids = [a.entry_id for a in self.core.waiting]
        for i in range(0, len(ids), 500):
            self.r.xclaim(self.keys.rollouts, GROUP_COLLECTOR, self.consumer, 0, ids[i:i + 500], justid=True)

    def trim(self) -> None:
        trimmed = trim_acked(self.r, self.keys.prompts, [GROUP_ROLLOUT])
        trimmed += trim_acked(self.r, self.keys.rollouts, [GROUP_COLLECTOR])
        trimmed += trim_acked(self.r, self.keys.batches, [GROUP_TRAINER])  # acked = in a checkpoint
        if trimmed:
            log.debug("trimmed %d acknowledged entries from prompts/rollouts/batches", trimmed)

    def write_window(self) -> None:
        state = {k: "" if v is None else str(v) for k, v in self.core.window_state().items()}
        if state != self._window_written:
            self.r.hset(self.window_key, mapping={**state, "updated_at": f"{time.time():.3f}"})
            self._window_written = state

    def report(self, extra: dict[str, float | str] | None = None) -> None:
        stats = {_s(k): int(v) for k, v in self.r.hgetall(self.ledger.stats_key).items()}
        metrics: dict[str, Any] = {f"pipeline/{k.replace(':', '_')}": v for k, v in stats.items()}
        metrics.update(extra or {})
        # The persistent {p}:stats counts win over a batch's in-process ones: cumulative across restarts.
        metrics.update({name: stats.get(field, 0) for field, name in _STAT_METRICS.items()})
        state = self.core.window_state()
        metrics["collector/waiting_groups"] = state["waiting_groups"]
        for name in ("current_version_index", "cutoff_version_index"):
            if state[name] is not None:
                metrics[f"staleness/{name}"] = state[name]
        metrics["staleness/keep_versions"] = state["keep_versions"]
        report_metrics(self.r, self.keys, SERVICE, metrics)
        if self.gauges is not None:
            self.gauges.set(metrics)

    # --- loop --------------------------------------------------------------------------------

    def setup(self) -> None:
        ensure_group(self.r, self.keys.rollouts, GROUP_COLLECTOR)
        ensure_group(self.r, self.keys.prompts, GROUP_ROLLOUT)

    def regroup(self) -> None:
        """After NOGROUP (Redis lost its data): the groups again, then our pending entries from the start."""
        self.setup()
        self.reader.reset()

    def step(self, block_ms: int | None) -> int:
        """One iteration; returns how many rollout entries it read (0 = nothing new)."""
        if self._versions_dirty.is_set() or self._control.due():
            self.execute(self.sync_versions())
            self.execute(self.sync_control())
        entries = reclaim(self.r, self.keys.rollouts, GROUP_COLLECTOR, self.consumer,
                          self.cfg.claim_idle_ms) if self._reclaim.due() else []
        entries += self.reader.read(self.cfg.read_count, block_ms)
        self.execute(self.ingest(entries))
        self.execute(self.assemble())
        if self._touch.due():
            self.touch_waiting()
        if self._trim.due():
            self.trim()
        self.write_window()
        if self._metrics.due():
            self.report()
        self._heartbeat.beat({"waiting_groups": len(self.core.waiting)})
        return len(entries)

    def run(self) -> int:
        """Collect until stopped (burst: until no entry is left to read); returns the exit code."""
        self.setup()
        watcher = VersionWatcher(self._factory, self.keys, on_version=lambda wv: self._versions_dirty.set(),
                                 backoff_max_s=self.loop.backoff.max_s)
        if not self.burst:
            watcher.start()
        try:
            self.loop.run(lambda: self.step(None if self.burst else self.cfg.block_ms) > 0, burst=self.burst,
                          recover=self.reader.reset,  # re-read our pending entries after reconnecting
                          regroup=self.regroup)
        finally:
            watcher.stop()
        log.info("group-collector stopping; %d group(s) left pending for the next run", len(self.core.waiting))
        return 0
