"""Collector and trainer SIGKILLed between consuming and acknowledging; trainer killed around
checkpoints (issue 7, items 3 and 7). Full pipeline, real processes.

The trainer's crash points come from its fault-injection hook (``DRESSAGE_FAULT``, see
``services/trainer/faults.py``): the process SIGKILLs itself at that exact instant. The collector is
SIGKILLed while it holds rollout entries it has read but not yet acknowledged (pending in
``{p}:rollouts``). Subscriber catch-up and late older versions are covered in
``tests/integration/test_versionbus.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from harness import Cluster, wait_until

from shared.modeling import missing_files
from shared.versionbus import published_versions, read_latest


def trainer_died(c: Cluster) -> int:
    return int(c.procs["trainer"].wait(120))


def test_collector_and_trainer_killed_between_consuming_and_acknowledging_lose_and_double_nothing(
        make_cluster: Callable[..., Cluster]) -> None:
    with make_cluster(rows=8, overrides={"train": {"groups_per_batch": 2}}) as c:
        c.start_pipeline(workers=2, trainer=False)
        c.start("trainer", env={"DRESSAGE_FAULT": "after_checkpoint:1"})  # v0 is written at start, v1 after batch 1
        assert trainer_died(c) == -9, c.explain()
        c.faults.append("trainer:SIGKILL after_checkpoint")
        # The first batch is trained and in checkpoint v1, but neither acknowledged nor announced.
        latest = read_latest(c.r, c.keys)
        assert c.pending("batches", "trainer") == 1 and latest is not None and latest.version == "0"
        # With the trainer gone the collector holds the next groups (read, unacknowledged): kill it then.
        wait_until(lambda: c.pending("rollouts", "collector") > 0, 60, "the collector to hold groups", c.explain,
                   period=0.02)
        c.kill("collector")
        held = c.r.xpending_range(c.keys.rollouts, "collector", min="-", max="+", count=100, consumername="collector")
        c.start("group-collector", "collector2")  # another consumer: it must reclaim (XAUTOCLAIM) what c1 held
        c.start("trainer")
        c.wait_settled(timeout=120)
        h = c.verdict()
        assert h.ok and h.summary()["trained"] == 8, c.explain()
        assert all(n == 1 for n in h.batched.values()) and len(h.batched) == 8
        log = c.procs["trainer"].tail(10**6)
        assert "already in a checkpoint: acknowledging without training" in log, log
        # What the dead collector held was reclaimed by collector2 (XAUTOCLAIM) and batched once.
        assert held and c.pending("rollouts", "collector") == 0 and c.pending("rollouts") == 0
        c.record_figures("crashes::collector_and_trainer")


def checkpoint_dirs(c: Cluster) -> list[str]:
    return sorted(p.name for p in (c.root / "ckpt").iterdir())


def test_trainer_killed_around_checkpoints_never_announces_a_partial_one_and_versions_keep_increasing(
        make_cluster: Callable[..., Cluster]) -> None:
    with make_cluster(rows=6) as c:
        c.start_pipeline(workers=2, trainer=False)
        # 1. Killed while writing v1 (hit 1 of mid_checkpoint is v0 at start): files in a temp dir only.
        c.start("trainer", env={"DRESSAGE_FAULT": "mid_checkpoint:2"})
        assert trainer_died(c) == -9, c.explain()
        c.faults.append("trainer:SIGKILL mid_checkpoint")
        assert any(n.startswith(".tmp-v00000001") for n in checkpoint_dirs(c)), checkpoint_dirs(c)
        assert published_versions(c.r, c.keys) == ["0"]
        # 2. Restarted, retrains the batch, writes v1 and acknowledges it, killed before announcing it.
        c.start("trainer", env={"DRESSAGE_FAULT": "after_ack:1"})
        assert trainer_died(c) == -9, c.explain()
        c.faults.append("trainer:SIGKILL after_ack")
        assert not any(n.startswith(".tmp-") for n in checkpoint_dirs(c)), "a restart removes partial checkpoints"
        assert "v00000001" in checkpoint_dirs(c) and published_versions(c.r, c.keys) == ["0"]
        # 3. Restarted cleanly: announces the complete v1 first, then goes on.
        c.start("trainer")
        c.wait_settled(timeout=120)
        h = c.verdict()
        assert h.ok and h.summary()["trained"] == 6, c.explain()
        versions = published_versions(c.r, c.keys)
        assert [int(v) for v in versions] == list(range(len(versions))) and len(versions) >= 2, versions
        for _, fields in c.r.xrange(c.keys.weights_log):
            path = Path(fields[b"path"].decode())
            assert re.fullmatch(r"v\d{8}", path.name) and not missing_files(path), path
            assert (path / "checkpoint.json").is_file(), f"published {path} without its manifest"
        proxy_log = c.procs["proxy"].tail(10**6)
        assert "not loaded" not in proxy_log and f"weights version={versions[-1]}" in proxy_log, proxy_log
        c.record_figures("crashes::trainer_checkpoints", versions=len(versions))
