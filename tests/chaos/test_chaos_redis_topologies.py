"""The whole pipeline on Redis beyond one node (issue 13, item 3): a 3-primary Cluster and Sentinel failover.

* Cluster: two runs (prefixes ``ca``, ``cb`` → hash tags ``{ca}``, ``{cb}``) on one cluster of three
  primaries started from ``redis-server`` binaries; every service gets the ``redis+cluster://`` URL.
  Run ``ca`` is the whole pipeline (proxy, engine, trainer, ...); run ``cb`` is prompt-buffer, worker
  and collector against a fake proxy (its batches wait for a trainer it does not have) — lighter on
  a shared machine, the same hand-offs. The runs' keys live on different primaries, every hand-off
  MULTI stays in its run's slot (a CROSSSLOT error would kill a service), and the history checker
  finds nothing lost or duplicated.
* Sentinel: one primary, one replica, three sentinels; services get the ``redis+sentinel://`` URL with
  ``redis.wait_replicas: 1``. The primary is SIGKILLed mid-run; the sentinels promote the replica, every
  service reconnects to it, the run settles, and the history checker (which recorded what the old
  primary acknowledged) finds nothing lost or duplicated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from harness import Cluster, Engine, wait_until
from redistopo import LocalCluster, LocalSentinels

from services.rollout_worker.fake_proxy import FakeProxy, serve
from shared.redisconn import connect, run_prefix
from shared.schemas import WeightVersion
from shared.versionbus import publish_version

T = TypeVar("T")

pytestmark = pytest.mark.chaos


@dataclass
class Deployment(Cluster):
    """The chaos harness on a cluster / Sentinel URL (its own single redis-server stays unused)."""

    url: str = ""
    redis_extra_config: dict[str, Any] | None = None

    def client(self) -> redis.Redis:
        return connect(self.url, socket_timeout=10)

    def _riding(self, read: Callable[[], T]) -> T:
        """The test's own reads ride out a failover (the services do it with their backoff)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return read()
            except redis.ConnectionError:  # includes Sentinel's MasterNotFoundError while it re-elects
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stats(self) -> dict[str, int]:
        return self._riding(super().stats)

    def start_pipeline(self, workers: int = 2, proxy: bool = True, trainer: bool = True,
                       up_timeout: float = 300) -> None:
        """The harness's start order, with start-up waits for a machine shared with other test runs."""
        for svc, name in (("proxy", "proxy"), ("trainer", "trainer"), ("group-collector", "collector"),
                          ("prompt-buffer", "prompt-buffer")):
            self.start(svc, name)
        self.wait_up("proxy", timeout=up_timeout)
        for i in range(1, workers + 1):
            self.start("rollout-worker", f"w{i}")
        self.wait_up(*self.procs, timeout=up_timeout)

    def verdict(self, allow_trimmed: bool = False) -> Any:
        return self._riding(lambda: super(Deployment, self).verdict(allow_trimmed))

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
    s = LocalSentinels("dressage", tmp_path / "sentinel", down_after_ms=2000).start()  # no flapping under load
    yield s
    s.cleanup()


@pytest.mark.timeout(900)
def test_two_runs_on_a_three_primary_cluster(cluster: LocalCluster, model_dir: Path, engine: Engine,
                                             tmp_path: Path) -> None:
    runs: list[Deployment] = []
    with serve(FakeProxy(reply=lambda sid, msgs: "21", version="0")) as fake_url:
        try:
            for name in ("ca", "cb"):
                prefix = run_prefix(name, cluster.url)
                assert prefix == "{" + name + "}"
                extra = {} if name == "ca" else {"rollout": {"proxy_url": fake_url},
                                                  "collector": {"max_ready_batches": 10}}
                runs.append(Deployment(tmp_path / name, model_dir, engine.url, rows=3, prefix=prefix, url=cluster.url,
                                       overrides=extra))
            full, light = runs
            r = full.r
            nodes = {r.get_node_from_key(d.keys.prompts).port for d in runs}
            assert len(nodes) == 2, "the two runs hash to different primaries"
            for d in runs:
                assert len({r.keyslot(k) for k in (d.keys.prompts, d.keys.rollouts, d.keys.batches,
                                                    d.keys.dead, d.keys.weights_latest, d.keys.stats)}) == 1
            full.start_pipeline(workers=1)
            publish_version(light.r, light.keys, WeightVersion(version="0", path="/x", step=0, published_at=0.0))
            for svc, name in (("prompt-buffer", "prompt-buffer"), ("group-collector", "collector"),
                              ("rollout-worker", "w1")):
                light.start(svc, name)
            full.wait_settled(timeout=240)
            h = full.verdict()
            assert h.ok and h.summary()["produced"] == 3 and h.summary()["trained"] >= 1, h.render()
            wait_until(lambda: light.stats().get("groups_batched", 0) >= 3, 120, "cb's groups batched", light.explain)
            hl = light.verdict()
            assert hl.ok and hl.summary()["produced"] == 3, hl.render()  # nothing lost; batches wait for a trainer
            for d in runs:
                d.assert_alive()
            full.record_figures("redis::cluster", **h.summary())
            keys = {k.decode() for k in r.scan_iter(match="*", count=1000)}
            assert keys and all(k.startswith(("{ca}:", "{cb}:")) for k in keys), sorted(keys)[:20]
        finally:
            for d in runs:
                d.close()


@pytest.mark.timeout(900)
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
