"""The one consumer-loop shell of the Redis-loop services (prompt-buffer, group-collector, trainer).

``ConsumerLoop.run(step)`` calls ``step()`` until the stop flag is set. ``step`` does one unit of work
and says whether more may be waiting right now:

* True: call it again at once;
* False: nothing to do now: in burst mode the loop ends (the run reached quiescence), otherwise
  ``idle()`` is called (a service that blocks in its read passes none) and the loop goes on.

A Redis connection error or timeout never ends the loop: it waits ``Backoff.next()`` on the stop
flag (so a stop interrupts the wait; the delay doubles from 0.1 s up to ``redis.reconnect_backoff_max_s``),
then calls ``recover()`` (re-read own pending entries, re-announce state); the first step that succeeds
resets the delay. A lost consumer group (``NOGROUP``: Redis came back without its data) calls
``regroup()``, which re-creates the groups the service reads, and the loop goes on. Any other exception
propagates: it is a bug or a poison the service guards itself.
``done()`` ends the loop like the stop flag (a trainer that reached ``max_steps``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from shared.lifecycle import StopFlag
from shared.retry import TRANSIENT, Backoff
from shared.streams import lost_group

log = logging.getLogger(__name__)


class ConsumerLoop:
    def __init__(self, name: str, stop: StopFlag, *, backoff_max_s: float) -> None:
        self.name, self.stop = name, stop
        self.backoff = Backoff(max_s=backoff_max_s)

    def run(self, step: Callable[[], bool], *, burst: bool, idle: Callable[[], object] | None = None,
            recover: Callable[[], None] | None = None, done: Callable[[], bool] | None = None,
            regroup: Callable[[], None] | None = None) -> None:
        while not self.stop.is_set and not (done is not None and done()):
            try:
                more = step()
                self.backoff.reset()
            except TRANSIENT as exc:
                self.wait_out(exc)
                if recover is not None:
                    try:
                        recover()
                    except TRANSIENT:
                        continue  # still down: the next step fails and waits longer
                continue
            except redis.ResponseError as exc:
                if regroup is None or not lost_group(exc):
                    raise
                log.warning("%s: a consumer group is gone (%s); re-creating it", self.name, exc)
                regroup()
                continue
            if more:
                continue
            if burst:
                return
            if idle is not None:
                idle()

    def wait_out(self, exc: BaseException) -> None:
        """Log the outage and wait the next backoff delay (a stop ends the wait early)."""
        delay = self.backoff.next()
        log.warning("%s: redis unavailable (%s: %s); retrying in %.1fs", self.name, type(exc).__name__, exc, delay)
        self.stop.wait(delay)
