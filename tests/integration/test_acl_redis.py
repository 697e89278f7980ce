"""The optional per-service Redis ACL on a real redis-server: a rollout worker does its job but can
neither FLUSHALL nor publish weights; only the trainer publishes; the window-controller measures and
sets ``keep_versions`` and writes nothing else."""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from services.group_collector.collector import GroupCollector
from services.window_controller.loop import WindowController
from shared.config import WindowControllerConfig
from shared.keys import GROUP_ROLLOUT, GROUP_TRAINER, Keys
from shared.redisproc import find_redis_server, free_port
from shared.schemas import WeightVersion
from shared.telemetry import heartbeat, report_metrics
from shared.versionbus import publish_version, read_latest
from tools.deploy import acl

PREFIX = "dressage"
KEYS = Keys(PREFIX)


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, str]]]:
    passwords = {s: secrets.token_hex(16) for s in acl.USERS}
    folder = tmp_path_factory.mktemp("acl")
    (folder / "users.acl").write_text(acl.render(PREFIX, passwords))
    port = free_port()
    binary = find_redis_server()
    assert binary is not None
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                             "--save", "", "--appendonly", "no", "--aclfile", str(folder / "users.acl")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, username="ops", password=passwords["ops"]).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)
        yield port, passwords
    finally:
        proc.terminate()
        proc.wait(10)


def client(acl_server: tuple[int, dict[str, str]], user: str) -> redis.Redis:
    port, passwords = acl_server
    return redis.Redis(port=port, username=user, password=passwords[user])


def test_rollout_worker_does_its_job(acl_server: tuple[int, dict[str, str]]) -> None:
    buffer, worker = client(acl_server, "prompt-buffer"), client(acl_server, "rollout-worker")
    buffer.xadd(KEYS.prompts, {"kind": "prompt_group", "group_id": "g1"})
    worker.xgroup_create(KEYS.prompts, GROUP_ROLLOUT, id="0", mkstream=True)
    [(_, [(entry_id, _)])] = worker.xreadgroup(GROUP_ROLLOUT, "w1", {KEYS.prompts: ">"}, count=1)
    pipe = worker.pipeline(transaction=True)  # the hand-off: XADD out + XACK in + counter, one MULTI
    pipe.xadd(KEYS.rollouts, {"kind": "rollout_group", "group_id": "g1"})
    pipe.xack(KEYS.prompts, GROUP_ROLLOUT, entry_id)
    pipe.hincrby(KEYS.stats, "groups_reenqueued", 0)
    pipe.execute()
    heartbeat(worker, KEYS, "rollout-worker", "w1")
    assert worker.exists(KEYS.health("rollout-worker", "w1"))
    assert report_metrics(worker, KEYS, "rollout-worker", {"x": 1}) is not None
    assert read_latest(worker, KEYS) is None  # may read the weight version
    ps = worker.pubsub()
    ps.subscribe(KEYS.weights_channel)  # may follow the version bus
    ps.close()


@pytest.mark.parametrize("command", [
    ("FLUSHALL",), ("FLUSHDB",), ("KEYS", "*"), ("CONFIG", "GET", "*"),
    ("PUBLISH", f"{PREFIX}:weights", "{}"),
    ("SET", f"{PREFIX}:weights:latest", "{}"),
    ("XADD", f"{PREFIX}:weights:log", "*", "version", "99"),
    ("XADD", f"{PREFIX}:batches", "*", "kind", "batch"),
    ("SET", f"{PREFIX}:health:trainer:x", "1"),
    ("SET", "other-app:key", "1"),
])
def test_rollout_worker_is_refused(acl_server: tuple[int, dict[str, str]], command: tuple[str, ...]) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        client(acl_server, "rollout-worker").execute_command(*command)


def test_only_the_trainer_publishes_weights(acl_server: tuple[int, dict[str, str]]) -> None:
    wv = WeightVersion(version="1", path="/ckpt/v1", step=1, published_at=time.time())
    with pytest.raises(redis.exceptions.NoPermissionError):
        publish_version(client(acl_server, "rollout-worker"), KEYS, wv)
    publish_version(client(acl_server, "trainer"), KEYS, wv)
    latest = read_latest(client(acl_server, "proxy"), KEYS)
    assert latest is not None and latest.version == "1"


def test_ops_user_reads_but_never_writes(acl_server: tuple[int, dict[str, str]]) -> None:
    ops = client(acl_server, "ops")
    assert ops.xlen(KEYS.prompts) >= 0 and ops.hgetall(KEYS.stats) is not None
    with pytest.raises(redis.exceptions.NoPermissionError):
        ops.set(f"{PREFIX}:control", "x")


def test_default_user_is_off(acl_server: tuple[int, dict[str, str]]) -> None:
    port, _ = acl_server
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=port).ping()


def test_window_controller_sets_the_window_and_writes_nothing_else(acl_server: tuple[int, dict[str, str]]) -> None:
    report_metrics(client(acl_server, "trainer"), KEYS, "trainer", {"train/rollout_logprob_abs_diff": 0.5})
    client(acl_server, "group-collector").hincrby(KEYS.stats, "groups_batched", 4)
    wc = client(acl_server, "window-controller")
    assert WindowController(wc, KEYS, WindowControllerConfig(enabled=True), 3, consumer="acl", burst=True).run() == 0
    ops = client(acl_server, "ops")  # each write of its job landed (heartbeat and metrics fail only in the log)
    assert ops.hget(f"{PREFIX}:control", "keep_versions") == b"3" and ops.xlen(KEYS.window_controller_decisions) == 1
    assert ops.exists(KEYS.health("window-controller", "acl"))
    assert [f[b"service"] for _, f in ops.xrange(KEYS.metrics)][-2:] == [b"trainer", b"window-controller"]
    for attempt in (lambda: wc.set(f"{PREFIX}:weights:latest", "{}"), lambda: wc.xadd(KEYS.batches, {"x": "1"}),
                    lambda: wc.hincrby(KEYS.stats, "groups_batched", 1), lambda: wc.delete(KEYS.metrics),
                    lambda: wc.xadd(KEYS.dead, {"x": "1"}), lambda: wc.publish(f"{PREFIX}:weights", "{}"),
                    lambda: wc.set(f"{PREFIX}:control", "x"), lambda: wc.xadd(KEYS.prompts, {"x": "1"})):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()


def test_the_collector_trims_what_its_consumers_acknowledged(acl_server: tuple[int, dict[str, str]]) -> None:
    collector, trainer = client(acl_server, "group-collector"), client(acl_server, "trainer")
    collector.xadd(KEYS.batches, {"kind": "batch", "batch_id": "b1"})
    trainer.xgroup_create(KEYS.batches, GROUP_TRAINER, id="0")
    [(_, [(entry_id, _)])] = trainer.xreadgroup(GROUP_TRAINER, "trainer", {KEYS.batches: ">"}, count=1)
    trainer.xack(KEYS.batches, GROUP_TRAINER, entry_id)
    GroupCollector.trim(SimpleNamespace(r=collector, keys=KEYS))  # type: ignore[arg-type]  # trim reads .r and .keys only
    assert collector.xlen(KEYS.batches) == 0


def test_rq_users_read_the_server_version_and_no_other_info(acl_server: tuple[int, dict[str, str]]) -> None:
    for user in ("trainer", "eval-worker"):  # rq asks INFO server for the Redis version
        assert client(acl_server, user).info("server")["redis_version"]
        with pytest.raises(redis.exceptions.NoPermissionError):
            client(acl_server, user).info("clients")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client(acl_server, "rollout-worker").info("server")


def test_weak_or_missing_passwords_are_refused(tmp_path: Path) -> None:
    good = {s: secrets.token_hex(16) for s in acl.USERS}
    optional = {s: pw for s, pw in good.items() if s not in acl.OPTIONAL}
    assert "user window-controller" not in acl.render(PREFIX, optional)  # off unless given a password
    with pytest.raises(ValueError, match="REDIS_PASSWORD_ROLLOUT_WORKER"):
        acl.render(PREFIX, {**good, "rollout-worker": "changeme"})
    with pytest.raises(ValueError, match="REDIS_PASSWORD_TRAINER"):
        acl.render(PREFIX, {k: v for k, v in good.items() if k != "trainer"})
    text = acl.render(PREFIX, good)
    assert all(pw not in text for pw in good.values())  # only hashes on disk
