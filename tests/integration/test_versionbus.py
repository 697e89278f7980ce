"""Version bus on a real redis-server: atomic publication, refusal of regressions, monotone catch-up."""

from __future__ import annotations

import time

import pytest
import redis

from shared.errors import VersionRegression
from shared.keys import Keys
from shared.redisproc import RedisProcess
from shared.schemas import WeightVersion
from shared.versionbus import VersionWatcher, publish_version, published_versions, read_latest
from shared.versions import version_newer


def wv(v: int) -> WeightVersion:
    return WeightVersion(version=str(v), path=f"/ckpt/v{v}", step=v, published_at=time.time())


def test_publish_sets_key_log_and_channel(redis_client: redis.Redis, keys: Keys) -> None:
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.weights_channel)
    publish_version(redis_client, keys, wv(0))
    publish_version(redis_client, keys, wv(1))
    latest = read_latest(redis_client, keys)
    assert latest is not None and (latest.version, latest.path, latest.step) == ("1", "/ckpt/v1", 1)
    assert published_versions(redis_client, keys) == ["0", "1"]
    got: list[str] = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=0.5)
        if msg:
            got.append(WeightVersion.model_validate_json(msg["data"]).version)
    assert got == ["0", "1"]


def test_older_or_equal_version_is_refused(redis_client: redis.Redis, keys: Keys) -> None:
    publish_version(redis_client, keys, wv(5))
    for bad in (5, 4):
        with pytest.raises(VersionRegression):
            publish_version(redis_client, keys, wv(bad))
    assert published_versions(redis_client, keys) == ["5"]


def test_version_order_is_numeric_for_integers() -> None:
    assert version_newer("10", "9") and not version_newer("9", "10") and version_newer("a", None)


def test_watcher_sees_versions_in_order_and_ignores_late_older_ones(redis_client: redis.Redis, keys: Keys,
                                                                    redis_server: RedisProcess) -> None:
    seen: list[str] = []
    watcher = VersionWatcher(lambda: redis.Redis(port=redis_server.port), keys, lambda v: seen.append(v.version),
                             poll_s=0.05).start()
    try:
        publish_version(redis_client, keys, wv(1))
        assert watcher.wait_for(lambda v: v is not None and v.version == "1", 5)
        publish_version(redis_client, keys, wv(2))
        assert watcher.wait_for(lambda v: v is not None and v.version == "2", 5)
        # A late, older announcement (e.g. replayed by hand) must not move the watcher back.
        redis_client.set(keys.weights_latest, wv(1).model_dump_json())
        redis_client.publish(keys.weights_channel, wv(1).model_dump_json())
        time.sleep(0.3)
        assert watcher.latest is not None and watcher.latest.version == "2"
        assert seen == ["1", "2"]
    finally:
        watcher.stop()


def test_a_watcher_with_a_long_poll_stops_at_once_and_still_reads_the_key_on_its_timer(
        redis_client: redis.Redis, keys: Keys, redis_server: RedisProcess) -> None:
    # A service's stop waits for its watcher's thread: the thread must not sit out a whole poll (1 s in the
    # services) before it sees the stop. The timer's read of the key stays once per poll.
    watcher = VersionWatcher(lambda: redis.Redis(port=redis_server.port), keys, poll_s=2.0).start()
    try:
        publish_version(redis_client, keys, wv(1))
        assert watcher.wait_for(lambda v: v is not None and v.version == "1", 5)
        redis_client.set(keys.weights_latest, wv(2).model_dump_json())  # the key alone: no message wakes it
        assert watcher.wait_for(lambda v: v is not None and v.version == "2", 5)  # the timer's read
    finally:
        t0 = time.monotonic()
        watcher.stop(timeout=30)
        stopped_in = time.monotonic() - t0
    assert watcher._thread is not None and not watcher._thread.is_alive()
    assert stopped_in < 1.0, stopped_in  # a poll is 2 s; the thread wakes every WAKE_S (0.1 s)


def test_disconnected_subscriber_catches_up(tmp_path) -> None:
    server = RedisProcess(directory=tmp_path, appendonly=True).start()
    keys = Keys("catchup")
    try:
        client = redis.Redis(port=server.port)
        publish_version(client, keys, wv(1))
        watcher = VersionWatcher(lambda: redis.Redis(port=server.port, socket_timeout=1), keys, poll_s=0.05,
                                 backoff_max_s=0.2).start()
        try:
            assert watcher.wait_for(lambda v: v is not None and v.version == "1", 5)
            server.kill()  # the watcher loses its connection; versions are published while it is away
            server.start()
            client = redis.Redis(port=server.port)
            publish_version(client, keys, wv(2))
            publish_version(client, keys, wv(3))
            assert watcher.wait_for(lambda v: v is not None and v.version == "3", 10)
        finally:
            watcher.stop()
    finally:
        server.cleanup()
