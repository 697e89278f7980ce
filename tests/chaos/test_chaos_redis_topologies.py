"""The whole pipeline on Redis beyond one node (issue 13, item 3): a 3-primary Cluster and Sentinel failover.

* Cluster: two runs (prefixes ``ca``, ``cb`` → hash tags ``{ca}``, ``{cb}``) on one cluster of three
  primaries started from ``redis-server`` binaries; every service gets the ``redis+cluster://`` URL.
  The runs' keys live on different primaries, every hand-off MULTI stays in its run's slot (a
  CROSSSLOT error would kill a service), and the history checker finds nothing lost or duplicated.
* Sentinel: one primary, one replica, three sentinels; services get the ``redis+sentinel://`` URL with
  ``redis.wait_replicas: 1``. The primary is SIGKILLed mid-run; the sentinels promote the replica, every
  service reconnects to it, the run settles, and the history checker (which recorded what the old
  primary acknowledged) finds nothing lost or duplicated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from harness import Cluster, Engine, wait_until

from shared.redisconn import connect, run_prefix
from shared.redistopo import LocalCluster, LocalSentinels

pytestmark = pytest.mark.chaos


@dataclass
class Deployment(Cluster):
    """The chaos harness on a cluster / Sentinel URL (its own single redis-server stays unused)."""

    url: str = ""
    redis_extra_config: dict[str, Any] | None = None

    def client(self) -> redis.Redis:
        return connect(self.url, socket_timeout=10)  # type: ignore[no-any-return]

    def config_data(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        data = super().config_data(extra)
        data["redis"].update({"url": self.url, **(self.redis_extra_config or {})})
        return data


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(3, tmp_path / "cluster").start()
    yield c
    c.cleanup()


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[LocalSentinels]:
    s = LocalSentinels("dressage", tmp_path / "sentinel").start()
    yield s
    s.cleanup()


def test_two_runs_on_a_three_primary_cluster(cluster: LocalCluster, model_dir: Path, engine: Engine,
                                             tmp_path: Path) -> None:
    runs = []
    for name in ("ca", "cb"):
        prefix = run_prefix(name, cluster.url)
        assert prefix == "{" + name + "}"
        runs.append(Deployment(tmp_path / name, model_dir, engine.url, rows=3, prefix=prefix, url=cluster.url))
    try:
        r = runs[0].r
        nodes = {r.get_node_from_key(d.keys.prompts).port for d in runs}  # type: ignore[attr-defined]
        assert len(nodes) == 2, "the two runs hash to different primaries"
        for d in runs:
            assert len({r.keyslot(k) for k in (d.keys.prompts, d.keys.rollouts, d.keys.batches, d.keys.dead,  # type: ignore[attr-defined]
                                                d.keys.weights_latest, d.keys.custom("stats"))}) == 1
            d.start_pipeline(workers=1)
        for d in runs:
            d.wait_settled(timeout=150)
            h = d.verdict()
            assert h.ok and h.summary()["produced"] == 3 and h.summary()["trained"] >= 1, h.render()
            d.assert_alive()
            d.record_figures("redis::cluster", **h.summary())
        keys = {k.decode() for k in r.scan_iter(match="*", count=1000)}
        assert keys and all(k.startswith(("{ca}:", "{cb}:")) for k in keys), sorted(keys)[:20]
    finally:
        for d in runs:
            d.close()


def test_sentinel_failover_loses_nothing_acknowledged(sentinels: LocalSentinels, model_dir: Path, engine: Engine,
                                                      tmp_path: Path) -> None:
    d = Deployment(tmp_path / "run", model_dir, engine.url, rows=8, url=sentinels.url,
                   redis_extra_config={"wait_replicas": 1, "wait_timeout_ms": 500, "reconnect_backoff_max_s": 1.0},
                   overrides={"pacing": {"max_in_flight_groups": 4}})
    try:
        d.start_pipeline(workers=2)
        wait_until(lambda: d.stats().get("groups_trained", 0) >= 2, 120, "two trained groups", d.explain)
        old = sentinels.primary_port()
        trained_before = d.stats().get("groups_trained", 0)
        sentinels.kill_primary()
        sentinels.wait_failover()
        assert sentinels.primary_port() != old
        d.wait_settled(timeout=180)
        h = d.verdict()
        assert h.ok and h.summary()["produced"] == 8, h.render()
        assert d.stats()["groups_trained"] > trained_before  # work went on through the promoted replica
        assert h.summary()["lost"] == 0 and h.summary()["duplicated"] == 0, h.render()
        d.assert_alive()
        d.record_figures("redis::sentinel-failover", **h.summary())
    finally:
        d.close()
