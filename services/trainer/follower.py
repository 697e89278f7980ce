"""A trainer rank other than 0: no Redis, no files written — it trains the rows rank 0 sends it.

Invariant: a follower does exactly what rank 0's commands say, in order (``services.trainer.parallel``):
``step`` → ``Learner.train_shards``, ``export`` → join the gather of the full state, ``idle`` → nothing,
``stop`` → leave the process group and exit 0. SIGTERM alone does not stop it: rank 0 (which gets the
same signal from torchrun) finishes its step and sends ``stop``, so no collective is left half-joined.
"""

from __future__ import annotations

import logging

from services.trainer.learner import Learner

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, learner: Learner) -> None:
        self.learner, self.parallel = learner, learner.parallel

    def run(self, burst: bool = False) -> int:
        """Obey rank 0 until it says stop; ``burst`` changes nothing here (rank 0 decides when to stop)."""
        rank = self.parallel.rank
        while True:
            cmd = self.parallel.receive()
            if cmd.kind == "step":
                self.learner.train_shards(cmd.shards)
                log.debug("rank=%d step=%d rows=%d", rank, self.learner.step, sum(len(s.rows) for s in cmd.shards))
            elif cmd.kind == "export":
                self.learner.export()
            elif cmd.kind == "stop":
                break
        self.parallel.close()
        log.info("rank=%d stopped step=%d", rank, self.learner.step)
        return 0
