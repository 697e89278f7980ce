"""The rq worker that runs evaluation jobs, with the project's heartbeat.

Jobs travel JSON-serialised (``shared.evaluation.SERIALIZER``): a job whose payload is not JSON
fails to deserialise and lands in rq's failed registry; nothing is ever unpickled. rq's ``Worker``
forks one work horse per job, so a job that crashes or times out never takes the worker down.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from rq import Worker

from shared.evaluation import SERIALIZER, eval_queue
from shared.keys import Keys
from shared.telemetry import Heartbeat

log = logging.getLogger(__name__)

SERVICE = "eval-worker"


class EvalWorker(Worker):
    """``rq.Worker`` that also refreshes ``{p}:health:eval-worker:<name>`` on rq's heartbeat."""

    def __init__(self, *args: Any, beat: Heartbeat | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._beat = beat

    def heartbeat(self, *args: Any, **kwargs: Any) -> Any:
        out = super().heartbeat(*args, **kwargs)
        if self._beat is not None:
            self._beat.beat({"queue": ",".join(self.queue_names())})
        return out


def build_worker(r: redis.Redis, keys: Keys, queue: str, consumer: str, heartbeat_ttl_s: float) -> EvalWorker:
    beat = Heartbeat(r, keys, SERVICE, consumer, heartbeat_ttl_s)
    return EvalWorker([eval_queue(r, queue)], connection=r, serializer=SERIALIZER, beat=beat,
                      name=f"{keys.prefix}-{consumer}")


def run_worker(worker: EvalWorker, burst: bool) -> int:
    """Work the queue (until it is empty in burst mode); 0 on a clean exit."""
    log.info("eval worker %s on queues=%s burst=%s", worker.name, worker.queue_names(), burst)
    worker.work(burst=burst, logging_level="INFO")
    return 0
