"""Multi-node Redis on loopback from ``redis-server`` binaries: a 3-primary Cluster, a Sentinel group.

Test infrastructure, so it lives in ``tests/`` (``bench/capacity.py`` puts ``tests/`` on its path): for
tests, benches and trying the URLs of ``shared.redisconn`` on one machine. Every process listens on
127.0.0.1 on a free port with its own directory; ``cleanup()`` kills what was started.

* ``LocalCluster(n)``: n primaries with ``cluster-enabled yes``, the 16384 slots split evenly
  (CLUSTER ADDSLOTSRANGE), joined with CLUSTER MEET; ready when every node reports ``cluster_state:ok``.
* ``LocalSentinels``: one primary, one replica (REPLICAOF), three sentinels monitoring them under
  ``service`` with quorum 2; ``kill_primary()`` SIGKILLs the primary, ``wait_failover()`` returns
  once the sentinels name the replica as the new primary.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import redis
from waits import wait_for

from shared.redisproc import RedisProcess, find_redis_server, free_port

SLOTS = 16384


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too and still a valid port."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _wait(pred: Callable[[], object], timeout: float, what: str) -> None:
    """A topology settling: Redis errors (a node still starting) count as "not yet"."""
    wait_for(pred, timeout, what, ignore=(redis.RedisError,), period=0.1)


class LocalCluster:
    def __init__(self, primaries: int = 3, directory: str | Path | None = None) -> None:
        self.dir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="dressage-cluster-"))
        self.nodes = [RedisProcess(self.dir / f"n{i}", port=cluster_port(), appendonly=True,
                                   extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                          "--cluster-node-timeout", "2000", "--appendfsync", "everysec"])
                      for i in range(primaries)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start and join the nodes; on any failure everything started is stopped again."""
        try:
            return self._start(timeout)
        except BaseException:
            self.cleanup()
            raise

    def _start(self, timeout: float) -> LocalCluster:
        for n in self.nodes:
            n.start()
        clients = [redis.Redis(port=n.port) for n in self.nodes]
        per = SLOTS // len(self.nodes)
        for i, c in enumerate(clients):
            hi = SLOTS - 1 if i == len(clients) - 1 else (i + 1) * per - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)
        for n in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)
        _wait(lambda: all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") and
                          int(c.execute_command("CLUSTER", "INFO").split(b"cluster_known_nodes:")[1].split(b"\r")[0])
                          == len(self.nodes) for c in clients), timeout, "cluster_state:ok on every node")
        for c in clients:
            c.close()
        return self

    def cleanup(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class LocalSentinels:
    def __init__(self, service: str = "dressage", directory: str | Path | None = None,
                 down_after_ms: int = 1000) -> None:
        self.dir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="dressage-sentinel-"))
        self.service, self.down_after_ms = service, down_after_ms
        self.primary = RedisProcess(self.dir / "primary", appendonly=True, extra=["--appendfsync", "everysec"])
        self.replica = RedisProcess(self.dir / "replica", appendonly=True, extra=["--appendfsync", "everysec"])
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{self.service}"

    def start(self, timeout: float = 30.0) -> LocalSentinels:
        """Start primary, replica and sentinels; on any failure everything started is stopped again."""
        try:
            return self._start(timeout)
        except BaseException:
            self.cleanup()
            raise

    def _start(self, timeout: float) -> LocalSentinels:
        self.primary.start()
        self.replica.extra += ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        binary = find_redis_server()
        assert binary is not None
        for i, port in enumerate(self.sentinel_ports):
            d = self.dir / f"s{i}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "sentinel.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
                            f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 2\n"
                            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {self.service} 5000\n"
                            f"sentinel parallel-syncs {self.service} 1\n")
            self.sentinels.append(subprocess.Popen([binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL, start_new_session=True))
        replica = redis.Redis(port=self.replica.port)
        _wait(lambda: replica.info("replication").get("master_link_status") == "up", timeout, "replica in sync")
        _wait(lambda: all(int(redis.Redis(port=p).sentinel_master(self.service)["num-other-sentinels"]) == 2
                          for p in self.sentinel_ports), timeout, "three sentinels that know each other")
        return self

    def primary_port(self) -> int:
        host_port = redis.Redis(port=self.sentinel_ports[0]).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(host_port[1])

    def kill_primary(self) -> None:
        """SIGKILL the current primary (no shutdown, no final sync)."""
        self.primary.kill()

    def wait_failover(self, timeout: float = 60.0) -> None:
        _wait(lambda: self.primary_port() == self.replica.port and
              redis.Redis(port=self.replica.port).info("replication")["role"] == "master", timeout,
              "the sentinels to promote the replica")

    def cleanup(self) -> None:
        for p in self.sentinels:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.replica.stop()
        self.primary.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
