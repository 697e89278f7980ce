"""An eval-worker killed by SIGKILL comes back (issue 14): its dead registration never blocks the restart."""

from __future__ import annotations

from pathlib import Path

import redis
from rq import Worker

from services.eval_worker.admission import JobPolicy
from services.eval_worker.worker import build_worker, run_worker
from shared.keys import Keys


def test_restart_after_sigkill_is_not_refused_for_the_dead_workers_name(redis_client: redis.Redis, keys: Keys,
                                                                       tmp_path: Path) -> None:
    policy = JobPolicy(checkpoint_root=str(tmp_path / "ckpt"), data_root=str(tmp_path / "data"))
    queue = f"{keys.prefix}-eval"
    dead = build_worker(redis_client, keys, queue, "eval-worker", 15.0, policy=policy)
    dead.register_birth()  # ... and then SIGKILL: no register_death, the registration outlives the process
    assert dead.name in {w.name for w in Worker.all(connection=redis_client)}
    restarted = build_worker(redis_client, keys, queue, "eval-worker", 15.0, policy=policy)
    assert restarted.name != dead.name and restarted.name.startswith(f"{keys.prefix}-eval-worker-")
    assert run_worker(restarted, burst=True) == 0  # registers (no "There exists an active worker named ...")
