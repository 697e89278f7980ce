"""The trainer's Redis shell: consume batches → train → checkpoint → acknowledge → publish.

Invariants (docs/architecture.md#weight-versions and #delivery, docs/trainer.md):
* a batch is acknowledged only after the checkpoint that contains its step is renamed into place:
  XACK and the ``{p}:stats`` counters ``batches_trained``/``groups_trained`` go in one MULTI/EXEC;
* a version is published only after its checkpoint is complete, and version numbers only grow;
* every checkpoint records the stream ids (and batch ids) of the batches it consumed, plus a
  bounded history of earlier ones: a batch re-delivered after a crash between the rename and the
  XACK is acknowledged without training it again — a batch is never trained twice;
* with ``train.update_weights_interval`` = k > 1 a checkpoint (and a version) comes every k steps;
  batches of the steps in between stay pending, so a crash retrains them from the last checkpoint;
* with ``train.checkpoint_every_versions`` = n > 1 only every n-th version is a durable checkpoint; the
  versions between are published from weights-only *snapshots* (not fsynced, no trainer state) and
  their batches stay pending until the durable checkpoint that contains them: a crash resumes from the
  last durable checkpoint, retrains those batches, and numbers on above the published version (the
  snapshot versions are abandoned, never reused). When the trainer has found no batch for
  ``train.durable_when_idle_ms``, the newest snapshot is promoted to a durable checkpoint (its files
  hard-linked beside the state) and its batches are acknowledged: durability is caught up while there
  is nothing to train, and a pipeline whose pacing waits for acknowledged groups cannot stall on it
  (a short wait between two batches does not trigger it); a graceful stop does the same;
* the same MULTI/EXEC appends ``{p}:trainer:trained`` (``batch_ids``, ``group_ids``, ``step``,
  ``version``): the record the history checker (tests/chaos/history.py) counts trained groups from;
* a poison entry (undecodable, or a batch this model cannot train on) goes to ``{p}:dead`` with its
  original bytes in the same MULTI as its XACK, and the loop goes on;
* on a Redis error the loop backs off (bounded), then re-syncs exactly as a restart would:
  re-read its own pending entries and publish the newest checkpoint if it is not announced yet;
* every step's metrics carry where the loop's wall-clock went since its first read
  (``time/{wait,train,checkpoint,publish,other,wall}_s``, ``shared.phases``): waiting for a batch,
  the optimizer step, the checkpoint write, and acknowledging + publishing the version;
* with ``train.background_commit`` the write → acknowledge → publish sequence of a version runs on
  one commit thread, from a frozen copy of the weights and trainer state taken when the version is
  cut, while the loop trains the next batch. The sequence itself and its order are unchanged (so
  are the invariants above); at most one commit is in flight, and the loop waits for it before it
  cuts the next version, re-syncs after a Redis error, or stops. A failed write re-raises on the
  loop at that wait and ends the process (its batches are still pending: a restart retrains them).
  ``time/checkpoint_s`` is then what the loop spent cutting the version and waiting for the previous
  commit, ``time/publish_s`` stays 0: the time training really lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
import torch

from services.trainer.batching import InvalidBatch, version_gap, version_gap_hist, version_span_hist
from services.trainer.checkpoint import CheckpointInfo, CheckpointStore, rng_state
from services.trainer.faults import fault_point
from services.trainer.learner import Learner
from services.trainer.modeldir import ModelDirWriter
from services.trainer.resume import ResumePlan, trusted_published
from services.trainer.sinks import MetricSinks
from shared import stats
from shared.codec import decode_entry, entry_ids
from shared.codes import INVALID_BATCH, MALFORMED, UNEXPECTED_ERROR
from shared.config import DressageConfig
from shared.consumer import ConsumerLoop
from shared.errors import MalformedEntry
from shared.evaluation import enqueue_eval, pinned_checkpoints
from shared.keys import GROUP_TRAINER
from shared.lifecycle import StopFlag
from shared.phases import PhaseClock
from shared.schemas import Batch, WeightVersion
from shared.streams import Entry, GroupReader, ensure_group, reclaim
from shared.telemetry import Heartbeat, report_metrics
from shared.versionbus import publish_version, read_latest
from shared.versions import trainer_number

log = logging.getLogger(__name__)

SERVICE = "trainer"
PHASES = ("wait", "train", "checkpoint", "publish")  # the trainer's time decomposition (time/<phase>_s)
TRAINED_MAXLEN = 100_000  # {p}:trainer:trained is capped like {p}:dead
Held = tuple[str, Batch]  # (stream entry id, decoded batch) trained or about to be


class RecentIds:
    """An insertion-ordered set of the newest ``limit`` ids."""

    def __init__(self, items: list[str], limit: int) -> None:
        self._items: dict[str, None] = dict.fromkeys(items[-limit:])

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def as_list(self) -> list[str]:
        return list(self._items)


@dataclass(frozen=True)
class _CommitJob:
    version: int
    step: int
    held: list[Held]  # the batches this commit acknowledges (none for a snapshot)
    weights: dict[str, Any] | None  # None: the model's own (only when written on the loop's thread)
    state: dict[str, Any]  # the trainer state a durable checkpoint stores ({} for a snapshot)
    durable: bool = True  # False: a weights-only snapshot, published without acknowledging anything


def _frozen(obj: Any) -> Any:
    """A deep copy of every tensor in ``obj`` (dicts, lists, tuples); other values as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _frozen(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_frozen(v) for v in obj)
    return obj


class TrainerLoop:
    def __init__(self, r: redis.Redis, cfg: DressageConfig, learner: Learner, tokenizer: Any,
                 store: CheckpointStore, plan: ResumePlan, restored: dict[str, Any] | None,
                 stop: StopFlag, sinks: MetricSinks | None = None) -> None:
        self.r, self.cfg, self.keys = r, cfg, cfg.keys()
        self.learner, self.tokenizer, self.store, self.plan = learner, tokenizer, store, plan
        self.model_dirs = ModelDirWriter(learner.model, tokenizer)  # a version costs its weights file
        self.stop, self.sinks = stop, sinks
        st = restored or {}
        limit = cfg.train.remember_batch_ids
        self.version = plan.version  # version of the newest checkpoint (or publication) so far
        self.batches_trained = int(st.get("batches_trained", 0))
        self.groups_trained = int(st.get("groups_trained", 0))
        self.recent_entries = RecentIds(list(st.get("recent_entry_ids", [])), limit)
        self.recent_batches = RecentIds(list(st.get("recent_batch_ids", [])), limit)
        self.unsaved: list[Held] = []  # trained, not yet in a durable checkpoint
        # The newest version when it was published from a snapshot (its batches still pending); None
        # when the newest version is a durable checkpoint. Set by the loop when it cuts a version.
        self.snapshot: CheckpointInfo | None = None
        self._cuts_since_durable = 0
        self._durable_owed = False  # found idle while steps since the snapshot kept it from promotion
        self.consumer = cfg.train.consumer
        self.reader = GroupReader(r, self.keys.batches, GROUP_TRAINER, self.consumer)
        self.heartbeat = Heartbeat(r, self.keys, SERVICE, self.consumer, cfg.ops.heartbeat_ttl_s)
        self.stats = stats.key(self.keys)
        self.trained_key = self.keys.trainer_trained  # one entry per acknowledged batch set
        self.clock = PhaseClock(PHASES)  # restarted once start() is done: the loop's own wall-clock
        self._committer = (ThreadPoolExecutor(1, thread_name_prefix="trainer-commit")
                           if cfg.train.background_commit else None)
        self._in_flight: Future[None] | None = None  # the commit running on the commit thread

    # --- startup and re-sync ------------------------------------------------------------------

    def start(self) -> None:
        """Idempotent: safe to call again after a Redis error half-way through."""
        ensure_group(self.r, self.keys.batches, GROUP_TRAINER)
        if self.plan.write_initial and self.store.newest() is None:
            self._write_checkpoint(self._cut(0, [], frozen=False))  # the initial weights become version "0"
        self._announce_newest()
        claimed = reclaim(self.r, self.keys.batches, GROUP_TRAINER, self.consumer, self.cfg.train.claim_idle_ms)
        if claimed:
            log.info("claimed %d pending batch entries of other consumers", len(claimed))

    def resync(self) -> None:
        """After a Redis error: announce the newest checkpoint if needed, re-read own pending."""
        self._join()  # its batches are acknowledged only once its checkpoint is in place
        ensure_group(self.r, self.keys.batches, GROUP_TRAINER)
        self._announce_newest()
        self.reader.reset()

    def _forged(self, latest: WeightVersion) -> bool:
        """Is the published ``latest`` not one of this trainer's versions? Counted and logged (the alarm)."""
        if trusted_published(latest, self.cfg.train.checkpoint_dir) is not None:
            return False
        self.r.hincrby(self.stats, stats.FORGED_WEIGHTS_LATEST, 1)
        return True

    def _own_latest(self) -> WeightVersion | None:
        latest = read_latest(self.r, self.keys)
        return None if latest is None or self._forged(latest) else latest

    def _announce_newest(self) -> None:
        """Publish the newest complete checkpoint if the version bus is behind it."""
        newest = self.store.newest()
        latest = self._own_latest()
        if newest is not None and (latest is None or trainer_number(latest.version) < newest.version):
            log.info("announcing complete checkpoint version=%d (the version bus is behind it)", newest.version)
            self._publish(newest)

    # --- the loop -----------------------------------------------------------------------------

    def _done(self) -> bool:
        return self.cfg.train.max_steps is not None and self.learner.step >= self.cfg.train.max_steps

    def run(self, burst: bool = False) -> int:
        """Train until stopped (or, in burst mode, until no batch is waiting); returns 0."""
        started = False

        def step() -> bool:
            nonlocal started
            if not started:
                self.start()
                started = True
                self.clock = PhaseClock(PHASES)
            return self._iterate(burst)

        loop = ConsumerLoop(SERVICE, self.stop, backoff_max_s=self.cfg.redis.reconnect_backoff_max_s)
        loop.run(step, burst=burst, recover=lambda: self.resync() if started else None, done=self._done,
                 regroup=self.resync)
        try:
            self._join()  # the last version is written, acknowledged and published before we stop
            self._make_durable()  # and durable, when it was published from a snapshot
        except redis.RedisError as exc:  # its checkpoint is in place: a restart acknowledges and announces it
            log.warning("stopping: the last commit version=%d could not reach redis: %s", self.version, exc)
        if self._committer is not None:
            self._committer.shutdown(wait=True)
        if self.unsaved:
            log.info("stopping with %d trained-but-unsaved batches pending; they are retrained from version=%d "
                     "after a restart", len(self.unsaved), self.version)
        if self.sinks is not None:
            self.sinks.close()
        self.learner.close()  # under torchrun: the other ranks stop too
        log.info("trainer stopped step=%d version=%d batches_trained=%d", self.learner.step, self.version,
                 self.batches_trained)
        return 0

    def _iterate(self, burst: bool) -> bool:
        self.heartbeat.beat({"step": self.learner.step, "version": self.version})
        entries: list[Entry] = []
        if self.snapshot is not None and not burst:  # durability owed: catch it up once idle for a while
            with self.clock.phase("wait"):
                entries = self.reader.read(count=1, block_ms=self.cfg.train.durable_when_idle_ms)
            if not entries:
                self._make_durable()
        if not entries:
            with self.clock.phase("wait"):
                entries = self.reader.read(count=1, block_ms=None if burst else self.cfg.train.block_ms)
        if not entries:
            self.learner.idle()  # under torchrun: the other ranks hear from rank 0 every block_ms
            return False  # nothing waiting: burst mode ends here, otherwise the next read blocks again
        for entry in entries:
            batch = self._accept(entry)
            if batch is not None:
                self._train_step((entry.id.decode(), batch))
        return True

    def _accept(self, entry: Entry) -> Batch | None:
        """The batch to train, or None when the entry was dead-lettered, duplicate or already trained."""
        eid = entry.id.decode()
        if any(eid == held for held, _ in self.unsaved):
            return None  # re-read after a reconnect while still in hand
        batch: Batch | None = None
        try:
            batch = decode_entry(entry.fields, Batch)
            self.learner.validate(batch)
        except MalformedEntry as exc:
            self._dead_letter(entry, MALFORMED, exc.reason, None)
            return None
        except InvalidBatch as exc:
            self._dead_letter(entry, INVALID_BATCH, str(exc), batch)
            return None
        except Exception as exc:  # poison guard: nothing about one entry may stop the trainer
            self._dead_letter(entry, UNEXPECTED_ERROR, f"{type(exc).__name__}: {exc}", batch)
            return None
        if eid in self.recent_entries:
            log.info("batch_id=%s entry_id=%s is already in a checkpoint: acknowledging without training",
                     batch.batch_id, eid)
            self._ack([(eid, batch)])
            return None
        if batch.batch_id in self.recent_batches or any(batch.batch_id == b.batch_id for _, b in self.unsaved):
            log.warning("duplicate batch_id=%s entry_id=%s discarded", batch.batch_id, eid)
            pipe = self.r.pipeline(transaction=True)
            pipe.xack(self.keys.batches, GROUP_TRAINER, eid)
            pipe.hincrby(self.stats, stats.BATCHES_DUPLICATE_DISCARDED, 1)
            pipe.execute()
            return None
        return batch

    def _dead_letter(self, entry: Entry, reason: str, error: str, batch: Batch | None) -> None:
        ids = entry_ids(entry.fields)
        pipe = self.r.pipeline(transaction=True)
        stats.add_dead_letter(pipe, self.keys, reason, error, self.keys.batches, entry.id, entry.fields,
                              stats.POISON_DEAD_LETTERED if batch is None else None)
        pipe.xack(self.keys.batches, GROUP_TRAINER, entry.id)
        if batch is not None:  # decodable: its groups leave the pipeline here, so pacing must count them
            pipe.hincrby(self.stats, stats.GROUPS_DEAD_LETTERED, len(batch.groups))
            pipe.hincrby(self.stats, stats.BATCHES_DEAD_LETTERED, 1)
        pipe.execute()
        log.warning("dead-lettered batch entry_id=%s group_id=%s reason=%s error=%s", entry.id.decode(),
                    ids.get("group_id"), reason, error[:300])

    # --- one step -----------------------------------------------------------------------------

    def _train_step(self, held: Held) -> None:
        """One batch = one trainer step (so pacing's groups per version stay groups_per_batch × interval),
        whatever the optimizer steps inside it (``train.minibatches_per_batch`` × ``epochs_per_batch``): nothing
        is written, acknowledged or published before the last of them is done."""
        eid, batch = held
        base = max(self.version, 0)  # the version trained from; the gaps are measured before _commit moves it
        with self.clock.phase("train"):
            metrics: dict[str, Any] = self.learner.train_step([batch], base)
        fault_point("after_step")
        gap, gap_hist = version_gap([batch], base), version_gap_hist([batch], base)
        self.unsaved.append(held)
        published = None
        if self.learner.step % self.cfg.train.update_weights_interval == 0:
            published = self._commit()
        metrics.update({"train/step": self.learner.step, "train/version": self.version,
                        "train/batch_groups": len(batch.groups), "train/published": int(published is not None),
                        "train/durable": int(published is not None and self.snapshot is None),
                        "train/batch_id": batch.batch_id})
        if gap is not None:
            metrics["train/version_gap_mean"], metrics["train/version_gap_max"] = gap
            # exact per-trajectory counts, so `dressage report` draws a true histogram
            metrics["train/version_gap_hist"] = gap_hist
        if spans := version_span_hist([batch]):
            metrics["train/version_span_hist"] = spans  # the span cap's subject, per trajectory
        if published is not None:
            metrics["train/published_version"] = str(published)  # the per-version marker
        metrics.update(self.clock.snapshot())
        report_metrics(self.r, self.keys, SERVICE, metrics, maxlen=self.cfg.ops.metrics_maxlen)
        if self.sinks is not None:
            self.sinks.emit(self.learner.step, metrics)
        log.info("step=%d version=%d batch_id=%s entry_id=%s loss=%.4f reward_mean=%.3f grad_norm=%.3f "
                 "logprob_diff=%.4f", self.learner.step, self.version, batch.batch_id, eid, metrics["train/loss"],
                 metrics["train/reward_mean"], metrics["train/grad_norm"],
                 metrics["train/train_rollout_logprob_abs_diff"])

    def _commit(self) -> int:
        """Checkpoint the unsaved steps as the next version, acknowledge their batches, publish —
        here, or on the commit thread while the next step trains (``train.background_commit``).
        Between durable checkpoints (``train.checkpoint_every_versions``) the version is a snapshot:
        written and published, its batches kept pending."""
        durable = self._durable_owed or self._cuts_since_durable + 1 >= self.cfg.train.checkpoint_every_versions
        frozen = self._committer is not None
        with self.clock.phase("checkpoint"):
            self._join()  # one commit at a time: versions are written, acknowledged, published in order
            if durable:
                job = self._cut(self.version + 1, self.unsaved, frozen=frozen)
            else:
                job = self._cut_snapshot(self.version + 1, frozen=frozen)
        if durable:
            self.unsaved = []  # the commit's now: a failed write ends the process, and a restart retrains them
            self.snapshot, self._cuts_since_durable, self._durable_owed = None, 0, False
        else:
            self.snapshot = CheckpointInfo(job.version, job.step, self.store.snapshot_path(job.version))
            self._cuts_since_durable += 1
        if self._committer is None:
            self._run_commit(job, timed=True)
        else:
            self._in_flight = self._committer.submit(self._run_commit, job, False)
        return job.version

    def _join(self) -> None:
        """Wait for the commit in flight; its error (if any) is raised here, on the loop's thread."""
        job, self._in_flight = self._in_flight, None
        if job is not None:
            job.result()

    def _cut(self, version: int, held: list[Held], frozen: bool) -> _CommitJob:
        """The next version's checkpoint contents, and this loop's bookkeeping advanced to it."""
        entry_ids_ = [eid for eid, _ in held]
        batch_ids = [b.batch_id for _, b in held]
        limit = self.cfg.train.remember_batch_ids
        recent_entries = RecentIds(self.recent_entries.as_list() + entry_ids_, limit)
        recent_batches = RecentIds(self.recent_batches.as_list() + batch_ids, limit)
        batches_trained = self.batches_trained + len(held)
        groups_trained = self.groups_trained + sum(len(b.groups) for _, b in held)
        weights, learner_state = self.learner.export()  # under torchrun: every rank joins this
        if frozen:  # training goes on while the commit thread writes: copy what the next step changes
            weights = _frozen(weights if weights is not None else self.learner.model.state_dict())
            learner_state = _frozen(learner_state)
        state = {"learner": learner_state, "rng": rng_state(), "version": version,
                 "step": self.learner.step, "batches_trained": batches_trained, "groups_trained": groups_trained,
                 "consumed_entry_ids": entry_ids_, "consumed_batch_ids": batch_ids,
                 "recent_entry_ids": recent_entries.as_list(), "recent_batch_ids": recent_batches.as_list()}
        self.version, self.batches_trained, self.groups_trained = version, batches_trained, groups_trained
        self.recent_entries, self.recent_batches = recent_entries, recent_batches
        return _CommitJob(version, self.learner.step, held, weights, state)

    def _cut_snapshot(self, version: int, frozen: bool) -> _CommitJob:
        """The next version as a weights-only snapshot; the held batches stay with the loop."""
        weights, _ = self.learner.export()  # under torchrun: every rank joins this
        if frozen:
            weights = _frozen(weights if weights is not None else self.learner.model.state_dict())
        self.version = version
        return _CommitJob(version, self.learner.step, [], weights, {}, durable=False)

    def _make_durable(self) -> None:
        """Promote the newest version's snapshot to a durable checkpoint and acknowledge its batches
        (when idle, and before stopping). Steps trained since it was cut make that impossible: the
        next version is then written durable instead."""
        if self.snapshot is None:
            return
        self._join()
        if self.learner.step != self.snapshot.step:
            self._durable_owed = True
            return
        snapshot = self.snapshot
        with self.clock.phase("checkpoint"):
            job = self._cut(snapshot.version, self.unsaved, frozen=False)
            self.store.promote(snapshot, job.state)
        fault_point("after_checkpoint")
        self.unsaved = []
        self.snapshot, self._cuts_since_durable, self._durable_owed = None, 0, False
        with self.clock.phase("publish"):
            self._ack(job.held, job.step, job.version)
        log.info("promoted snapshot version=%d to a durable checkpoint (%d batches acknowledged)",
                 snapshot.version, len(job.held))

    def _run_commit(self, job: _CommitJob, timed: bool) -> None:
        """Write → acknowledge → publish one version (``timed``: on the loop, inside its phases)."""
        with self.clock.phase("checkpoint") if timed else contextlib.nullcontext():
            info = self._write_checkpoint(job) if job.durable else self._write_snapshot(job)
        fault_point("after_checkpoint" if job.durable else "after_snapshot")
        with self.clock.phase("publish") if timed else contextlib.nullcontext():
            if job.durable:
                self._ack(job.held, job.step, job.version)
                fault_point("after_ack")
            self._publish(info)

    def _write_checkpoint(self, job: _CommitJob) -> CheckpointInfo:
        info = self.store.write(job.version, job.step, lambda d: self.model_dirs.write(d, job.weights), job.state)
        self.model_dirs.finished(info.path)
        return info

    def _write_snapshot(self, job: _CommitJob) -> CheckpointInfo:
        info = self.store.write_snapshot(job.version, job.step, lambda d: self.model_dirs.write(d, job.weights))
        self.model_dirs.finished(info.path)
        return info

    def _ack(self, held: list[Held], step: int | None = None, version: int | None = None) -> None:
        """XACK + counters + the trained record in one MULTI (``step``/``version``: of the commit)."""
        if not held:
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.keys.batches, GROUP_TRAINER, *[eid for eid, _ in held])
        pipe.hincrby(self.stats, stats.BATCHES_TRAINED, len(held))
        pipe.hincrby(self.stats, stats.GROUPS_TRAINED, sum(len(b.groups) for _, b in held))
        # The record of what was trained, in the same MULTI as the XACK (read by tests/chaos/history.py).
        pipe.xadd(self.trained_key, {"batch_ids": ",".join(b.batch_id for _, b in held),
                                     "group_ids": json.dumps([g.group_id for _, b in held for g in b.groups]),
                                     "step": str(self.learner.step if step is None else step),
                                     "version": str(self.version if version is None else version)},
                  maxlen=TRAINED_MAXLEN, approximate=True)
        pipe.execute()
        log.info("acknowledged batches entry_ids=%s batch_ids=%s", ",".join(e for e, _ in held),
                 ",".join(b.batch_id for _, b in held))

    def _publish(self, info: CheckpointInfo) -> None:
        wv = WeightVersion(version=str(info.version), path=str(info.path.resolve()), step=info.step,
                           published_at=time.time())
        publish_version(self.r, self.keys, wv, replace=self._forged)
        try:
            pinned = pinned_checkpoints(self.r, self.keys.prefix)  # evaluations still to run on them
        except redis.RedisError:
            pinned = [str(p.path) for p in self.store.complete()]  # unknown: prune nothing this time
        self.store.prune(self.cfg.train.keep_checkpoints, referenced=[info.path, *pinned])
        self.store.prune_snapshots(self.cfg.train.keep_snapshots, referenced=[info.path, *pinned])
        every = self.cfg.eval.every_versions
        if every and info.version % every == 0:
            self._enqueue_eval(wv)

    def _enqueue_eval(self, wv: WeightVersion) -> None:
        ev = self.cfg.eval
        try:
            enqueue_eval(self.r, ev.queue, wv.path, wv.version, wv.step, ev.dataset, ev.n_examples,
                         self.keys.prefix, batch_size=ev.batch_size, device=ev.device, timeout_s=ev.job_timeout_s)
        except redis.RedisError as exc:  # evaluation is off the hot path: never fail training for it
            log.warning("could not queue evaluation version=%s: %s", wv.version, exc)
