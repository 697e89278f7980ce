"""The adaptive window acts through the operator's control path: a real collector follows it (real Redis)."""

from __future__ import annotations

import itertools
from pathlib import Path

import redis
from rollout_factory import rollout_group

from services.group_collector.collector import GroupCollector
from services.group_collector.core import CollectorCore
from services.window_controller.loop import WindowController
from shared.codec import encode_entry
from shared.config import CollectorConfig, StalenessSection, WindowControllerConfig, load_config
from shared.keys import Keys
from shared.schemas import WeightVersion
from shared.staleness import StalenessConfig, StalenessGroupFilter, StalenessTracker
from shared.telemetry import report_metrics
from shared.versionbus import publish_version
from tools.deploy.plan import RunChoices, build_plan


def test_a_tightened_window_reaches_the_collector_and_drops_the_groups_now_outside(
        redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    for v in range(4):
        publish_version(r, keys, WeightVersion(version=str(v), path="/x", step=v, published_at=float(v)))
    ids = (f"b{i}" for i in itertools.count(1))
    core = CollectorCore(StalenessGroupFilter(StalenessTracker(StalenessConfig(3))), 4, 2,
                         new_batch_id=lambda: next(ids))
    collector = GroupCollector(r, keys, core, CollectorConfig(control_poll_s=0.001, trim_interval_s=0),
                               StalenessSection(keep_versions=3), consumer="c1", burst=True)
    collector.setup()
    for gid, version in (("old", "1"), ("new", "3")):
        r.xadd(keys.rollouts, encode_entry(rollout_group(gid, [version])))
    collector.step(None)
    assert sorted(a.group.group_id for a in core.waiting) == ["new", "old"]  # window {1, 2, 3}

    cfg = WindowControllerConfig(enabled=True, min_keep=1, max_keep=4, target_logprob_diff=0.05, patience=1,
                                 cooldown=0)
    controller = WindowController(r, keys, cfg, default_keep=3)
    controller.start()
    report_metrics(r, keys, "trainer", {"train/train_rollout_logprob_abs_diff": 0.4, "time/wait_s": 0.0,
                                        "time/wall_s": 5.0})
    assert controller.tick().after == 2
    collector.step(None)  # the collector re-reads {p}:control: window {2, 3}
    assert [a.group.group_id for a in core.waiting] == ["new"]
    assert int(r.hget(keys.stats, "groups_dropped_stale") or 0) == 1
    assert r.xlen(keys.window_controller_decisions) == 1


def test_up_starts_the_controller_only_when_enabled(tmp_path: Path) -> None:
    choices = RunChoices(config_path="configs/cpu-demo.yaml", run_dir=tmp_path, redis_url="redis://127.0.0.1:1/0",
                         prefix="p", workers=1, engine_port=31000, proxy_port=8811)
    off = load_config("configs/cpu-demo.yaml", env={"DRESSAGE_WINDOW_CONTROLLER_ENABLED": "false"})
    on = load_config("configs/cpu-demo.yaml", env={"DRESSAGE_WINDOW_CONTROLLER_ENABLED": "true"})
    assert "window-controller" not in [s.name for s in build_plan(off, choices)]
    spec = next(s for s in build_plan(on, choices) if s.name == "window-controller")
    assert spec.optional and list(spec.argv)[3] == "window-controller"
