"""The rq worker that runs evaluation jobs, with the project's heartbeat.

Jobs travel JSON-serialised (``shared.evaluation.SERIALIZER``): a job whose payload is not JSON
fails to deserialise and lands in rq's failed registry; nothing is ever unpickled. rq's ``Worker``
forks one work horse per job, so a job that crashes or times out never takes the worker down.

Every process registers under a fresh rq name (``<prefix>-<consumer>-<pid>-<random>``): a worker
killed by SIGKILL leaves its registration behind until rq's TTL expires it, and a restart under
the same name would be refused ("There exists an active worker named ..."). The heartbeat key
keeps the stable consumer name, so ``dressage status`` shows one eval-worker across restarts.

Only the evaluation function runs: jobs are ``AdmittedJob``s, whose ``func`` and callbacks are
resolved only after ``admission.JobPolicy.check`` passed (function name, argument names and
types, checkpoint and dataset confined to their roots). A refused job (e.g. an enqueued
``os.system``) fails with ``JobRefused`` in rq's failed registry; nothing of it is imported or called.

Liveness: rq's loop retries a Redis fault only inside its blocking dequeue; one met anywhere else (a job
ending while Redis restarts or loads its AOF, the heartbeat after a dequeue) makes it log "unhandled
exception, quitting" and return. ``run_worker`` does not take that return as the end: unless a stop was
asked (SIGTERM/SIGINT or rq's shutdown command) or a burst run drained the queue, it waits for Redis
with the services' backoff (``shared.retry``) and starts the loop again under a fresh rq name.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from functools import partial
from types import FrameType
from typing import Any

import redis
from rq import Worker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.queue import Queue

from services.eval_worker.admission import JobPolicy
from shared.evaluation import SERIALIZER
from shared.keys import Keys
from shared.retry import TRANSIENT, Backoff, check_redis
from shared.telemetry import Heartbeat

log = logging.getLogger(__name__)

SERVICE = "eval-worker"
HEALTHY_RUN_S = 60.0  # a loop that ran this long before quitting met a new fault, not a repeat: backoff resets


class AdmittedJob(Job):  # type: ignore[misc]  # rq is followed as untyped (pyproject)
    """An rq ``Job`` that resolves its function and callbacks only once the policy admitted it."""

    policy: JobPolicy | None = None  # set on the per-worker subclass (``job_class``)

    def _admit(self) -> None:
        if self.policy is None:
            raise RuntimeError("AdmittedJob used without a JobPolicy (use job_class_for)")
        callbacks = (self._success_callback_name, self._failure_callback_name, self._stopped_callback_name)
        self.policy.check(self.func_name, self.instance is not None, self.args, self.kwargs, callbacks)

    @property
    def func(self) -> Any:
        self._admit()
        return super().func

    @property
    def success_callback(self) -> Any:
        self._admit()
        return super().success_callback

    @property
    def failure_callback(self) -> Any:
        return None  # never resolved: an admitted job has none, a refused one must not get one called

    @property
    def stopped_callback(self) -> Any:
        return None


def job_class_for(policy: JobPolicy) -> type[AdmittedJob]:
    return type("EvalJob", (AdmittedJob,), {"policy": policy})


class EvalWorker(Worker):  # type: ignore[misc]  # rq is followed as untyped (pyproject)
    """``rq.Worker`` that refreshes ``{p}:health:eval-worker:<name>`` on rq's heartbeat and records why its
    loop returned: ``stop_wanted`` (a signal or rq's shutdown command) or ``drained`` (burst: queue empty)."""

    def __init__(self, *args: Any, beat: Heartbeat | None = None, fresh_name: Callable[[], str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._beat = beat
        self._fresh_name = fresh_name
        self.stop_wanted = False
        self.drained = False
        self.in_loop = False  # rq's loop runs (its signal handlers may then talk to Redis)

    def heartbeat(self, *args: Any, **kwargs: Any) -> Any:
        out = super().heartbeat(*args, **kwargs)
        if self._beat is not None:
            self._beat.beat({"queue": ",".join(self.queue_names())})
        return out

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_wanted = True
        if not self.in_loop:  # waiting for Redis between loops: no job runs, and rq's stop would ask Redis
            raise StopRequested()
        super().request_stop(signum, frame)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        self.drained = result is None  # only a burst run (or an idle limit, never set here) gets None
        return result

    def teardown(self) -> None:
        """rq's teardown, riding out Redis being down: the registration then expires on its TTL, and the
        pubsub thread is stopped without its unsubscribe (a restarted loop subscribes afresh)."""
        try:
            super().teardown()
        except TRANSIENT as exc:
            log.warning("eval worker %s: teardown with Redis unreachable (%s); registration left to expire",
                        self.name, exc)
            self._end_pubsub(polite=False)

    def unsubscribe(self) -> None:
        """rq's unsubscribe without its wait of up to a minute: see ``_end_pubsub``."""
        if self.pubsub_thread is not None:
            log.info("eval worker %s: unsubscribing from %s", self.name, self.pubsub_channel_name)
            self._end_pubsub(polite=True)

    def _end_pubsub(self, *, polite: bool) -> None:
        """Stop rq's pubsub thread, then (``polite``) UNSUBSCRIBE, then close; never waits more than 1 s.

        rq sends UNSUBSCRIBE first and stops the thread after. A thread that handled the reply before the stop
        finds itself unsubscribed and waits out its 60-s poll, and redis-py >= 8.2's ``stop()`` joins it: SIGTERM
        took a minute to end the worker. Asked to stop first, the thread ends on the reply that wakes it."""
        thread = self.pubsub_thread
        _halt(thread)
        try:
            if polite:
                self.pubsub.unsubscribe()
        finally:
            thread.join(timeout=1)
            self.pubsub.close()

    def renew_name(self) -> None:
        """A restarted loop registers afresh: the old name may survive in Redis's AOF without its death."""
        if self._fresh_name is not None:
            self.name = self._fresh_name()


def _halt(thread: Any) -> None:
    """Clear a redis-py pubsub thread's running flag without waiting for it to end."""
    try:
        thread.stop(timeout=0)  # redis-py >= 8.2: stop() joins, for ``timeout`` at most
    except TypeError:  # older redis-py: stop() takes no timeout and only clears the flag
        thread.stop()


def rq_worker_name(keys: Keys, consumer: str) -> str:
    """Unique per process: a dead predecessor's registration never blocks a restart."""
    return f"{keys.prefix}-{consumer}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def build_worker(r: redis.Redis, keys: Keys, queue: str, consumer: str, heartbeat_ttl_s: float, *,
                 policy: JobPolicy) -> EvalWorker:
    beat = Heartbeat(r, keys, SERVICE, consumer, heartbeat_ttl_s)
    job_class = job_class_for(policy)
    rq_queue = Queue(queue, connection=r, serializer=SERIALIZER, job_class=job_class)
    fresh_name = partial(rq_worker_name, keys, consumer)
    return EvalWorker([rq_queue], connection=r, serializer=SERIALIZER, beat=beat, job_class=job_class,
                      name=fresh_name(), fresh_name=fresh_name)


def run_worker(worker: EvalWorker, burst: bool, *, backoff_max_s: float = 5.0) -> int:
    """Work the queue (until it is empty in burst mode); 0 on a clean exit.

    Each time rq's loop returns with no stop asked and (burst) the queue not drained, it quit on a fault:
    wait ``Backoff`` (so a fault that repeats never spins), wait for Redis, and work again."""
    log.info("eval worker %s on queues=%s burst=%s", worker.name, worker.queue_names(), burst)
    backoff = Backoff(max_s=backoff_max_s)
    while True:
        worker.in_loop, started = True, time.monotonic()
        try:
            worker.work(burst=burst, logging_level="INFO")
        except TRANSIENT as exc:  # rq's registration, before its loop's own guard
            log.warning("eval worker %s: rq's loop could not start: %s", worker.name, exc)
        finally:
            worker.in_loop = False
        if worker.stop_wanted or (burst and worker.drained):
            return 0
        if time.monotonic() - started >= HEALTHY_RUN_S:
            backoff.reset()
        delay = backoff.next()
        log.warning("eval worker %s: rq's loop quit on a fault (logged above by rq.worker); waiting for Redis, "
                    "restarting it in %.1fs", worker.name, delay)
        try:
            time.sleep(delay)
            check_redis(worker.connection, backoff_max_s=backoff_max_s)
        except StopRequested:
            return 0
        worker.renew_name()
