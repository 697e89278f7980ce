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
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import redis
from rq import Worker
from rq.job import Job
from rq.queue import Queue

from services.eval_worker.admission import JobPolicy
from shared.evaluation import SERIALIZER
from shared.keys import Keys
from shared.telemetry import Heartbeat

log = logging.getLogger(__name__)

SERVICE = "eval-worker"


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
    """``rq.Worker`` that also refreshes ``{p}:health:eval-worker:<name>`` on rq's heartbeat."""

    def __init__(self, *args: Any, beat: Heartbeat | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._beat = beat

    def heartbeat(self, *args: Any, **kwargs: Any) -> Any:
        out = super().heartbeat(*args, **kwargs)
        if self._beat is not None:
            self._beat.beat({"queue": ",".join(self.queue_names())})
        return out


def rq_worker_name(keys: Keys, consumer: str) -> str:
    """Unique per process: a dead predecessor's registration never blocks a restart."""
    return f"{keys.prefix}-{consumer}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def build_worker(r: redis.Redis, keys: Keys, queue: str, consumer: str, heartbeat_ttl_s: float, *,
                 policy: JobPolicy) -> EvalWorker:
    beat = Heartbeat(r, keys, SERVICE, consumer, heartbeat_ttl_s)
    job_class = job_class_for(policy)
    rq_queue = Queue(queue, connection=r, serializer=SERIALIZER, job_class=job_class)
    return EvalWorker([rq_queue], connection=r, serializer=SERIALIZER, beat=beat, job_class=job_class,
                      name=rq_worker_name(keys, consumer))


def run_worker(worker: EvalWorker, burst: bool) -> int:
    """Work the queue (until it is empty in burst mode); 0 on a clean exit."""
    log.info("eval worker %s on queues=%s burst=%s", worker.name, worker.queue_names(), burst)
    worker.work(burst=burst, logging_level="INFO")
    return 0
