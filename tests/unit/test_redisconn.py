"""URL forms of ``shared.redisconn`` and the cluster hash tag of a run's keys (no server needed)."""

from __future__ import annotations

import pytest
import redis

from shared.config import load_config
from shared.redisconn import RedisUrlError, WaitingRedis, connect, is_cluster_url, run_prefix


def test_run_prefix_is_hash_tagged_only_on_a_cluster() -> None:
    assert run_prefix("dressage", "redis+cluster://h:1") == "{dressage}"
    assert run_prefix("{mine}-x", "redis+cluster://h:1") == "{mine}-x"  # a tag of its own is kept
    assert run_prefix("dressage", "redis://h:1/0") == "dressage"
    assert is_cluster_url("redis+cluster://a:1,b:2") and not is_cluster_url("redis://a:1")


def test_config_keys_share_one_slot_on_a_cluster() -> None:
    cfg = load_config(None, env={}, overrides={"redis": {"url": "redis+cluster://127.0.0.1:7000", "prefix": "run7"}})
    k = cfg.keys()
    names = [k.prompts, k.rollouts, k.batches, k.dead, k.weights_latest, k.weights_log, k.stats]
    assert all(n.startswith("{run7}:") for n in names)
    from redis.crc import key_slot

    assert len({key_slot(n.encode()) for n in names}) == 1
    plain = load_config(None, env={}, overrides={"redis": {"prefix": "run7"}}).keys()
    assert plain.prompts == "run7:prompts"  # single-server key names are unchanged


def test_connect_builds_the_client_of_each_url_form() -> None:
    assert type(connect("redis://127.0.0.1:1/0")) is redis.Redis
    assert isinstance(connect("redis://127.0.0.1:1/0", wait_replicas=1), WaitingRedis)
    s = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster")
    assert s.connection_pool.service_name == "mymaster"
    with pytest.raises(RedisUrlError, match="service name"):
        connect("redis+sentinel://127.0.0.1:1")
    with pytest.raises(RedisUrlError, match="host:port"):
        connect("redis+sentinel://127.0.0.1/x")
    with pytest.raises(RedisUrlError, match="wait_replicas"):
        connect("redis+cluster://127.0.0.1:1", wait_replicas=1)
