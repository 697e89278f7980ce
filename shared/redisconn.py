"""One place that turns ``redis.url`` into a client: one server, a Redis Cluster, or a Sentinel-managed primary.

URL forms (``redis.url`` / ``REDIS_URL``):

* ``redis://[user@]host:port/db``, ``rediss://…``, ``unix://…`` — one server;
* ``redis+cluster://[user@]host:port[,host:port…]`` — a Redis Cluster; the hosts are seeds, the
  client learns the slot map and follows MOVED/ASK itself;
* ``redis+sentinel://[user@]host:port[,host:port…]/<service>[/db]`` — the current primary of the
  Sentinel-monitored ``<service>``; after a failover the next connection asks the sentinels again,
  so a dead primary is one more transient connection error the services already back off from.

Invariants:
* in a cluster every key of one run hashes to one slot: ``run_prefix`` wraps a plain prefix in a
  hash tag (``dressage`` → ``{dressage}``), so every MULTI/EXEC, WATCH and Lua call of the hand-offs
  stays in one slot, and runs with different prefixes spread over the cluster's slots;
* ``wait_replicas`` = n > 0 (``redis.wait_replicas``): every MULTI/EXEC is followed, on the same
  connection, by ``WAIT n wait_timeout_ms`` — the hand-off is on n replicas before the caller goes
  on. A timeout is logged and counted (``replication_waits_short``), never raised: the write is done
  on the primary either way, and the idempotent hand-offs make a re-delivery after a failover safe.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.client import Pipeline

log = logging.getLogger(__name__)

CLUSTER_SCHEME = "redis+cluster"
SENTINEL_SCHEME = "redis+sentinel"
_TAGGED = re.compile(r"\{[^{}]+\}")
short_waits = 0  # WAITs that returned fewer replicas than asked, this process


class RedisUrlError(ValueError):
    """A ``redis+cluster://`` / ``redis+sentinel://`` URL that cannot be used; the message says why."""


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME + "://")


def is_cluster_client(r: Any) -> bool:
    from redis.cluster import RedisCluster

    return isinstance(r, RedisCluster)


def run_prefix(prefix: str, url: str) -> str:
    """The key prefix to use: hash-tagged (``{prefix}``) on a cluster unless it already carries a tag."""
    if is_cluster_url(url) and not _TAGGED.search(prefix):
        return "{" + prefix + "}"
    return prefix


def _hosts(netloc: str, scheme: str) -> tuple[str | None, list[tuple[str, int]]]:
    user, _, hostpart = netloc.rpartition("@")
    hosts = []
    for item in hostpart.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise RedisUrlError(f"redis.url: {scheme}:// needs host:port[,host:port...], got {item!r}")
        hosts.append((host.strip("[]"), int(port)))
    return (unquote(user.split(":")[0]) if user else None), hosts


class WaitingPipeline(Pipeline):  # type: ignore[misc]  # redis is followed as untyped (pyproject)
    """A pipeline whose MULTI/EXEC is followed by WAIT on the same connection."""

    wait_replicas = 0
    wait_timeout_ms = 1000

    def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> Any:
        result = super()._execute_transaction(connection, commands, raise_on_error)
        if self.wait_replicas > 0:
            connection.send_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            acked = int(connection.read_response())
            if acked < self.wait_replicas:
                global short_waits
                short_waits += 1
                log.warning("WAIT: hand-off on %d of %d replicas after %d ms (replication_waits_short=%d)",
                            acked, self.wait_replicas, self.wait_timeout_ms, short_waits)
        return result


class WaitingRedis(redis.Redis):  # type: ignore[misc]  # redis is followed as untyped (pyproject)
    """``redis.Redis`` whose transactions wait for replicas (class attributes set by ``connect``)."""

    pipeline_class: type[WaitingPipeline] = WaitingPipeline

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        return self.pipeline_class(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def _waiting_class(replicas: int, timeout_ms: int) -> type[redis.Redis]:
    plain: type[redis.Redis] = redis.Redis
    if replicas <= 0:
        return plain
    pipe = type("WaitingPipelineN", (WaitingPipeline,), {"wait_replicas": replicas, "wait_timeout_ms": timeout_ms})
    return type("WaitingRedisN", (WaitingRedis,), {"pipeline_class": pipe})


def connect(url: str, password: str | None = None, *, decode_responses: bool = False, socket_timeout: float = 30.0,
            wait_replicas: int = 0, wait_timeout_ms: int = 1000) -> Any:
    """A client for ``url`` (any of the forms in the module docstring)."""
    common: dict[str, Any] = {"password": password, "decode_responses": decode_responses,
                              "socket_timeout": socket_timeout, "socket_connect_timeout": 5}
    parts = urlsplit(url)
    if parts.scheme == CLUSTER_SCHEME:
        from redis.cluster import ClusterNode, RedisCluster

        user, hosts = _hosts(parts.netloc, parts.scheme)
        if wait_replicas:
            raise RedisUrlError("redis.wait_replicas: not supported on redis+cluster:// (use the cluster's own "
                                "min-replicas-to-write)")
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts], username=user,
                            **common)
    if parts.scheme == SENTINEL_SCHEME:
        from redis.sentinel import Sentinel

        user, hosts = _hosts(parts.netloc, parts.scheme)
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise RedisUrlError("redis.url: redis+sentinel:// needs the monitored service name as its path, "
                                "e.g. redis+sentinel://h1:26379,h2:26379/mymaster")
        db = int(path[1]) if len(path) > 1 and path[1].isdigit() else 0
        sentinel = Sentinel(hosts, sentinel_kwargs={"socket_timeout": 2, "socket_connect_timeout": 2},
                            username=user, db=db, health_check_interval=15, **common)
        return sentinel.master_for(path[0], redis_class=_waiting_class(wait_replicas, wait_timeout_ms))
    client_class = _waiting_class(wait_replicas, wait_timeout_ms)
    return client_class.from_url(url, health_check_interval=15, **common)
