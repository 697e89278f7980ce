"""The rollout worker loop: ``{p}:prompts`` (group ``rollout``) -> group runner -> ``{p}:rollouts``.

Every entry this worker reads leaves it exactly one way, in one MULTI/EXEC with its XACK
(``commit``): handed off to the collector as a rollout group — completed, or failed with its typed
``error_code`` and ``retryable`` flag (the collector's ``outcomes.retry_or_dead_letter`` is the one
retry policy) — or dead-lettered because it does not decode. Or it stays pending (crash, Redis down,
upstream down, stop past the grace period) for this consumer's next read of its own pending list or
for another worker's reclaim.

Loop: entries of dead workers idle for ``claim_idle_ms`` (XAUTOCLAIM, at most the free slots, a
scan every ``claim_idle_ms / 2``), own pending entries, then new ones; up to ``concurrency`` groups run at
once; the entries in hand are touched (XCLAIM JUSTID) every ``claim_idle_ms / 3`` so a long group
of a live worker is never reclaimed. ``burst``: process what is available (including re-enqueued
retries), then return 0.
SIGTERM (``StopFlag``): read nothing more, give groups in hand ``grace_period_s`` to finish and
hand off, cancel the rest (their entries stay pending), return 0.
Upstream down (``shared.codes.INFRASTRUCTURE``: proxy refused or timed out, 503s, an engine
restarting): the failed group's entry stays pending — no attempt is spent — and the worker takes no
group while ``upstream.UpstreamGate`` is open (capped backoff up to ``rollout.upstream_backoff_max_s``),
then probes with one of its held groups. Burst mode leaves such groups pending and ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from services.rollout_worker import metrics as prom
from services.rollout_worker.assembly import failed_group
from services.rollout_worker.commit import commit_handoff, commit_poison, still_pending
from services.rollout_worker.errors import TrajectoryFailed
from services.rollout_worker.runner import GroupFailed, GroupRunner
from services.rollout_worker.upstream import UpstreamGate
from shared.codec import decode_entry, entry_ids
from shared.codes import INTERNAL_ERROR, MALFORMED, STALENESS_EXCEEDED
from shared.config import RolloutConfig
from shared.errors import MalformedEntry
from shared.keys import GROUP_ROLLOUT, Keys
from shared.lifecycle import StopFlag
from shared.retry import Backoff
from shared.schemas import PromptGroup, RolloutGroup
from shared.streams import Entry, GroupReader, ensure_group, lost_group
from shared.telemetry import Heartbeat, report_metrics

log = logging.getLogger(__name__)
SERVICE = "rollout-worker"
POLL_S = 0.25  # how often the loop looks at the stop flag while groups run


def reward_metrics(meta: dict[str, Any]) -> dict[str, float]:
    """A completed group's reward parts as metrics: ``rollout/reward/<name>`` (mean over the trajectories
    that have it) and the agent-reported rewards the task accepted or refused."""
    out: dict[str, float] = {}
    for name, values in (meta.get("reward_components") or {}).items():
        got = [float(v) for v in values if isinstance(v, (int, float))]
        if got:
            out[f"rollout/reward/{name}"] = round(sum(got) / len(got), 6)
    agent = meta.get("agent_rewards") or {}
    if agent.get("accepted") or agent.get("refused"):
        out["rollout/agent_rewards_accepted"] = float(agent.get("accepted", 0))
        out["rollout/agent_rewards_refused"] = float(agent.get("refused", 0))
    return out


class RolloutWorker:
    def __init__(self, r: redis.Redis, keys: Keys, cfg: RolloutConfig, runner: GroupRunner, consumer: str,
                 stop: StopFlag | None = None, heartbeat_ttl_s: float = 15.0, backoff_max_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.r, self.keys, self.cfg, self.runner, self.consumer = r, keys, cfg, runner, consumer
        self.stop = stop or StopFlag()
        self.clock = clock
        self.backoff = Backoff(max_s=backoff_max_s)  # consecutive Redis errors
        self.reader = GroupReader(r, keys.prompts, GROUP_ROLLOUT, consumer)
        self.heartbeat = Heartbeat(r, keys, SERVICE, consumer, heartbeat_ttl_s)
        self.counts: Counter[str] = Counter()  # completed / failed / held / poison / skipped
        self._claim_cursor: bytes | str = b"0-0"  # XAUTOCLAIM scan position
        self._active: set[bytes] = set()  # entry ids being processed now
        self._next_reclaim = 0.0
        self._next_touch = 0.0
        self.upstream = UpstreamGate(max_s=cfg.upstream_backoff_max_s)

    def run(self, burst: bool = False) -> int:
        """Run the loop (until stopped, or until drained with ``burst``), then close the proxy client."""
        return asyncio.run(self._run_and_close(burst))

    async def _run_and_close(self, burst: bool) -> int:
        try:
            while not self.stop.is_set:  # Redis may still be starting: bounded backoff, not a crash
                try:
                    await asyncio.to_thread(ensure_group, self.r, self.keys.prompts, GROUP_ROLLOUT)
                    break
                except redis.ConnectionError as exc:
                    await self._backoff("start", exc)
            return await self.run_async(burst)
        finally:
            await self.runner.proxy.aclose()

    # -- reading ---------------------------------------------------------------------------------

    def _claim_idle(self, n: int) -> list[Entry]:
        """Claim at most ``n`` entries idle for ``claim_idle_ms`` (dead or frozen workers' groups).

        One XAUTOCLAIM step per call, its cursor kept across calls: a worker takes only what it
        can start now, so the rest stays claimable by its peers (``shared.streams.reclaim`` takes
        everything at once). Entries deleted while pending are acknowledged away.
        """
        resp = self.r.xautoclaim(self.keys.prompts, GROUP_ROLLOUT, self.consumer,
                                 min_idle_time=self.cfg.claim_idle_ms, start_id=self._claim_cursor, count=n)
        self._claim_cursor = resp[0]
        got = [Entry(i, f or {}) for i, f in resp[1]]
        gone = [e.id for e in got if not e.fields] + list(resp[2] if len(resp) > 2 else [])
        if gone:
            self.r.xack(self.keys.prompts, GROUP_ROLLOUT, *gone)
        live = [e for e in got if e.fields and e.id not in self._active]
        if live:
            log.info("reclaimed %d idle entries entry_ids=%s", len(live), [e.id.decode() for e in live])
        return live

    def _fetch(self, n: int, block_ms: int | None) -> list[Entry]:
        """Up to ``n`` entries: idle ones of other workers (when due), then own pending / new ones."""
        out: list[Entry] = []
        now = time.monotonic()
        scanning = self._claim_cursor not in (b"0-0", "0-0")
        if scanning or now >= self._next_reclaim:
            if not scanning:
                self._next_reclaim = now + self.cfg.claim_idle_ms / 2000
            out = self._claim_idle(n)
        if len(out) < n:
            got = self.reader.read(n - len(out), None if out else block_ms)
            out.extend(e for e in got if e.id not in self._active)
        return out

    def _touch(self) -> None:
        """Reset the idle time of the entries in hand (XCLAIM JUSTID to ourselves), so a group that
        runs longer than ``claim_idle_ms`` is not reclaimed by another worker while it is alive."""
        ids = list(self._active)
        if ids:
            self.r.xclaim(self.keys.prompts, GROUP_ROLLOUT, self.consumer, 0, ids, justid=True)

    async def _keep_alive(self, in_flight: int) -> None:
        """Heartbeat + touch of the entries in hand, off the event loop (Redis may be slow or down)."""
        now = time.monotonic()
        if now < self._next_touch:
            return
        self._next_touch = now + min(self.cfg.claim_idle_ms / 3000, self.heartbeat.ttl_s / 3)
        try:
            await asyncio.to_thread(self.heartbeat.beat, {"in_flight": in_flight, "upstream_down": self.upstream.is_down,
                                                          **self.counts}, True)
            await asyncio.to_thread(self._touch)
        except redis.RedisError as exc:
            log.warning("keep-alive failed (entries in hand may be reclaimed): %s", exc)

    async def _fetch_safe(self, n: int, block_ms: int | None) -> list[Entry] | None:
        """``_fetch`` with Redis outages contained: None (not "nothing there") after an error."""
        try:
            entries = await asyncio.to_thread(self._fetch, n, block_ms)
            self.backoff.reset()
            return entries
        except redis.RedisError as exc:
            await self._backoff("read", exc)
            return None

    async def _backoff(self, what: str, exc: Exception) -> None:
        delay = self.backoff.next()
        log.warning("redis error during %s (retry in %.1fs): %s", what, delay, exc)
        if lost_group(exc):
            try:
                ensure_group(self.r, self.keys.prompts, GROUP_ROLLOUT)
            except redis.RedisError:
                pass
        self.reader.reset()  # own pending entries (e.g. one whose commit failed) are read again
        await asyncio.sleep(delay)

    # -- one entry -------------------------------------------------------------------------------

    async def _process(self, entry: Entry) -> None:
        try:
            group = decode_entry(entry.fields, PromptGroup)
        except MalformedEntry as exc:
            await asyncio.to_thread(commit_poison, self.r, self.keys, entry.id, entry.fields, MALFORMED, exc.reason)
            self.counts["poison"] += 1
            prom.POISON.inc()
            log.warning("poison entry dead-lettered entry_id=%s ids=%s reason=%s",
                        entry.id.decode(), entry_ids(entry.fields), exc.reason)
            return
        log.info("rollout start group_id=%s attempt=%d entry_id=%s n_samples=%d task=%s",
                 group.group_id, group.attempt, entry.id.decode(), group.n_samples, group.task)
        started = self.clock()
        try:
            rollout = await self.runner.run(group)
        except GroupFailed as gf:
            if gf.failure.infrastructure:
                return self._hold(entry, group, gf.failure)
            rollout = failed_group(group, gf.failure, self.consumer, gf.started_at, self.clock())
        except Exception as exc:  # poison guard: a bug in a task plugin/runner fails the group, never the loop
            log.exception("rollout crashed group_id=%s attempt=%d entry_id=%s",
                          group.group_id, group.attempt, entry.id.decode())
            crash = TrajectoryFailed(INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
            rollout = failed_group(group, crash, self.consumer, started, self.clock())
        self.upstream.up()
        if not await asyncio.to_thread(still_pending, self.r, self.keys, entry.id):
            return self._skip(group, entry)
        await asyncio.to_thread(commit_handoff, self.r, self.keys, entry.id, rollout)
        if rollout.status == "failed":
            return self._failed(entry, group, rollout)
        self.counts["completed"] += 1
        prom.GROUPS.labels("completed").inc()
        prom.TRAJECTORIES.inc(group.n_samples)
        seconds = rollout.meta["rollout_finished_at"] - rollout.meta["rollout_started_at"]
        prom.GROUP_SECONDS.observe(seconds)
        log.info("rollout done group_id=%s attempt=%d entry_id=%s reward_mean=%.3f end_versions=%s seconds=%.2f",
                 group.group_id, group.attempt, entry.id.decode(), rollout.reward_mean,
                 ",".join(rollout.end_versions), seconds)
        await asyncio.to_thread(report_metrics, self.r, self.keys, SERVICE, {
            "rollout/group_seconds": round(seconds, 4), "rollout/reward_mean": rollout.reward_mean,
            "rollout/num_trajectories": group.n_samples, "rollout/num_segments": len(rollout.samples),
            **reward_metrics(rollout.meta),
            "group_id": group.group_id, "attempt": group.attempt, "consumer": self.consumer})

    def _hold(self, entry: Entry, group: PromptGroup, failure: TrajectoryFailed) -> None:
        """Upstream unavailable: leave the entry pending (no attempt spent) and open the gate."""
        delay = self.upstream.down()
        self.counts["held"] += 1
        prom.GROUPS.labels("held_upstream_down").inc()
        log.warning("upstream down: group kept pending, no attempt spent group_id=%s attempt=%d entry_id=%s "
                    "code=%s next_probe_in=%.1fs error=%s", group.group_id, group.attempt, entry.id.decode(),
                    failure.code, delay, failure.text[:200])
        self.reader.reset()  # the held entry is ours and pending: the next read returns it again

    def _skip(self, group: PromptGroup, entry: Entry) -> None:
        self.counts["skipped"] += 1
        prom.GROUPS.labels("skipped_already_acked").inc()
        log.warning("entry already acknowledged by another worker, result dropped group_id=%s attempt=%d entry_id=%s",
                    group.group_id, group.attempt, entry.id.decode())

    def _failed(self, entry: Entry, group: PromptGroup, rollout: RolloutGroup) -> None:
        self.counts["failed"] += 1
        prom.GROUPS.labels("failed").inc()
        if rollout.error_code == STALENESS_EXCEEDED:  # this event's own code: counted once, never sticky
            prom.REJECTED_GROUPS.inc()
            prom.REJECTED_SAMPLES.inc(group.n_samples)
        log.warning("rollout failed, handed to the collector group_id=%s attempt=%d entry_id=%s code=%s "
                    "retryable=%s error=%s", group.group_id, group.attempt, entry.id.decode(), rollout.error_code,
                    rollout.retryable, (rollout.error or "")[:300])

    async def _guarded(self, entry: Entry) -> None:
        """``_process`` with Redis outages contained: the entry then stays pending and is read again."""
        try:
            await self._process(entry)
        except redis.RedisError as exc:
            await self._backoff(f"commit of entry_id={entry.id.decode()}", exc)
        except Exception as exc:  # last-resort poison guard: an entry that breaks processing never loops
            log.exception("unprocessable entry entry_id=%s ids=%s", entry.id.decode(), entry_ids(entry.fields))
            await self._unprocessable(entry, f"unprocessable: {type(exc).__name__}: {exc}")
        finally:
            self._active.discard(entry.id)

    async def _unprocessable(self, entry: Entry, error: str) -> None:
        """Dead-letter (reason ``malformed``, original bytes) an entry whose processing raised, if still ours."""
        try:
            if await asyncio.to_thread(still_pending, self.r, self.keys, entry.id):
                await asyncio.to_thread(commit_poison, self.r, self.keys, entry.id, entry.fields, MALFORMED, error)
                self.counts["poison"] += 1
                prom.POISON.inc()
        except redis.RedisError as exc:
            await self._backoff(f"dead letter of entry_id={entry.id.decode()}", exc)

    # -- the loop --------------------------------------------------------------------------------

    async def run_async(self, burst: bool = False) -> int:
        in_flight: dict[asyncio.Task[None], Entry] = {}
        read: asyncio.Task[list[Entry] | None] | None = None
        starved = False  # burst: the last read found nothing; read again only after a group finishes
        while not self.stop.is_set:
            await self._keep_alive(len(in_flight))
            prom.IN_FLIGHT.set(len(in_flight))
            free = self.upstream.slots(self.cfg.concurrency - len(in_flight), len(in_flight))
            if burst and self.upstream.is_down and not in_flight and read is None:
                break  # burst: what the upstream could not take stays pending, no attempt spent
            if read is None and free > 0 and not starved:
                read = asyncio.create_task(self._fetch_safe(free, None if burst else self.cfg.block_ms))
            waiting: set[asyncio.Task[None] | asyncio.Task[list[Entry] | None]] = set(in_flight)
            if read is not None:
                waiting.add(read)
            if not waiting:
                if burst:
                    break  # burst and nothing left
                await asyncio.sleep(POLL_S)  # the upstream gate is open: nothing may start yet
                continue
            done, _ = await asyncio.wait(waiting, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if read is not None and read in done:
                entries, read = read.result(), None
                starved = burst and entries == [] and self._claim_cursor in (b"0-0", "0-0")
                for e in entries or []:
                    self._active.add(e.id)
                    in_flight[asyncio.create_task(self._guarded(e), name=e.id.decode())] = e
            for t in [t for t in in_flight if t in done]:
                del in_flight[t]
                starved = False
                t.result()
        if read is not None:
            await read  # a blocking read ends within block_ms; what it got stays pending for reclaim
        await self._drain(in_flight)
        await asyncio.to_thread(self.heartbeat.beat, {"in_flight": 0, "stopping": True, **self.counts}, True)
        prom.IN_FLIGHT.set(0)
        log.info("rollout-worker stopped consumer=%s counts=%s", self.consumer, dict(self.counts))
        return 0

    async def _drain(self, in_flight: dict[asyncio.Task[None], Entry]) -> None:
        """Stop: let groups in hand finish within the grace period; cancel the rest (left pending)."""
        if not in_flight:
            return
        log.info("stopping: %d group(s) in hand, grace %.1fs", len(in_flight), self.cfg.grace_period_s)
        pending: set[asyncio.Task[None]] = set(in_flight)
        if self.cfg.grace_period_s > 0:
            _, pending = await asyncio.wait(in_flight, timeout=self.cfg.grace_period_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in pending:
            log.warning("left pending for reclaim entry_id=%s", in_flight[t].id.decode())
