"""Security and limits (issue 7): Redis password and ACL users, msgpack size limits, no secret in logs.

* Every service logs in with ``REDIS_PASSWORD``; a wrong or missing one stops it at once (exit 2)
  with a message naming the setting — never a reconnect loop, never the secret itself.
* ``redis.require_password`` refuses empty and well-known default passwords.
* ``tools.deploy.acl`` (the one ACL definition): the whole pipeline, evaluation included (the
  trainer's enqueue, the eval-worker's job), runs under one ACL user per service without a single denial, while every forbidden write of issue 16 is refused (the weight key
  by anyone but the trainer; the rollout worker's SET/DEL/XTRIM/EVAL on prompts, the collector's group),
  and the worker can do its own XREADGROUP/XADD/XACK.
* msgpack bodies and containers beyond explicit limits are refused as ``MalformedEntry``;
  extension types (the only door to custom deserialisation) are refused outright.
The proxy's API key under load (auth, body size, validation, concurrency) is in test_chaos_proxy_load.py.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis
from harness import Cluster, wait_until
from rollout_factory import prompt_group

from shared import codec
from shared.codec import decode_entry, encode_entry
from shared.config import DEV_PASSWORDS, load_config
from shared.errors import ConfigError, MalformedEntry
from shared.schemas import PromptGroup
from tools.deploy import acl as ops_acl

SERVICES = ("prompt-buffer", "rollout-worker", "group-collector", "trainer", "proxy", "eval-worker")


def test_services_log_in_with_the_redis_password_and_a_wrong_or_missing_one_fails_fast_without_leaking(
        make_cluster: Callable[..., Cluster]) -> None:
    password, wrong = f"pw-{secrets.token_hex(12)}", f"wrong-{secrets.token_hex(12)}"
    with make_cluster(rows=2, password=password) as c:
        for service, name in (("prompt-buffer", "prompt-buffer"), ("group-collector", "collector"),
                              ("rollout-worker", "w1")):
            c.start(service, name)
        c.wait_up("prompt-buffer", "collector", "w1")  # the right password: up and heart-beating
        url = f"redis://:{wrong}@127.0.0.1:{c.redis.port}/0"
        bad = [c.start(s, f"{s}-wrong", env={"REDIS_PASSWORD": wrong}) for s in SERVICES]
        bad += [c.start(s, f"{s}-none", env={"REDIS_PASSWORD": ""}) for s in SERVICES[:3]]
        bad += [c.start("group-collector", "collector-url", env={"REDIS_URL": url, "REDIS_PASSWORD": ""}),
                c.start("group-collector", "collector-default", env={"DRESSAGE_REDIS_REQUIRE_PASSWORD": "true",
                                                                      "REDIS_PASSWORD": "changeme"})]
        for p in bad:
            assert p.wait(90) == 2, f"{p.name}:\n{p.tail()}"
            log = p.tail(10**6)
            expected = "a non-empty, non-default password" if p.name == "collector-default" else "refused the credentials"
            assert expected in log and "REDIS_PASSWORD" in log, f"{p.name}:\n{log}"
            assert "retrying" not in log, f"{p.name} retried a credential error:\n{log}"
        for p in c.procs.values():  # no secret in any log, including the services that run fine
            log = p.tail(10**7)
            assert password not in log and wrong not in log and "changeme" not in log, p.name
        c.assert_alive("prompt-buffer", "collector", "w1")


@pytest.mark.parametrize("pw", [*sorted(DEV_PASSWORDS), "   ", "CHANGEME", " Redis "])
def test_require_password_refuses_empty_and_default_passwords(pw: str) -> None:
    with pytest.raises(ConfigError, match="redis.*password") as info:
        load_config(None, env={"DRESSAGE_REDIS_REQUIRE_PASSWORD": "true", "REDIS_PASSWORD": pw})
    assert repr(pw) not in str(info.value) and "<redacted>" in str(info.value)  # named, never echoed


def test_require_password_refuses_a_missing_one_and_accepts_a_strong_one() -> None:
    with pytest.raises(ConfigError, match="REDIS_PASSWORD"):
        load_config(None, env={"DRESSAGE_REDIS_REQUIRE_PASSWORD": "true"})
    strong = secrets.token_hex(16)
    cfg = load_config(None, env={"DRESSAGE_REDIS_REQUIRE_PASSWORD": "true", "REDIS_PASSWORD": strong})
    assert cfg.redis.password is not None and strong not in repr(cfg) and strong not in str(cfg.model_dump())


ACL_USERS = ("prompt-buffer", "rollout-worker", "group-collector", "trainer", "proxy", "eval-worker", "ops")
EVAL_EVERY = 2  # the trainer queues an evaluation every 2 versions; the eval-worker runs it, each as itself


def acl_file(users: dict[str, str], out: Path) -> Path:
    """The ACL file from ``tools.deploy.acl`` (the one definition), with an unrestricted password-less
    default user for the test harness (loopback only)."""
    text = ops_acl.render("dressage", users)
    out.write_text(text.replace("user default off resetkeys resetchannels -@all", "user default on nopass ~* &* +@all"))
    return out


def evaluated(r: redis.Redis) -> set[bytes]:
    """The versions whose evaluation was reported to ``{p}:metrics`` (by the job, as the eval-worker's user)."""
    return {f[b"eval/version"] for _, f in r.xrange("dressage:metrics") if f.get(b"service") == b"eval"}


def test_pipeline_runs_under_per_service_acl_users_and_each_forbidden_write_is_refused(
        make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    users = {u: secrets.token_hex(12) for u in ACL_USERS}
    acl = acl_file(users, tmp_path / "users.acl")
    evaluation = {"eval": {"every_versions": EVAL_EVERY, "n_examples": 4, "batch_size": 4}}
    with make_cluster(rows=4, prefix="dressage", users=users, redis_extra=["--aclfile", str(acl)],
                      overrides=evaluation) as c:
        c.start_pipeline(workers=1)
        c.start("eval-worker")
        c.wait_up("eval-worker")
        c.wait_settled(timeout=120)
        assert c.verdict().ok, c.explain()
        # Versions 2 and 4 (of 4 batches) were queued by the trainer and evaluated by the eval-worker.
        wait_until(lambda: {b"2", b"4"} <= evaluated(c.r) and not c.r.smembers("dressage:eval:pinned"), 120,
                   "versions 2 and 4 evaluated and unpinned", lambda: c.logs(["eval-worker", "trainer"]))
        # No legitimate command of any service was denied.
        denied = [e for e in c.r.acl_log(count=1000) if e["object"] != "client|setinfo"]
        assert denied == [], [(e["username"], e["object"], e["count"]) for e in denied]

        def login(user: str) -> redis.Redis:
            return redis.Redis(port=c.redis.port, username=user, password=users[user])
        w = login("rollout-worker")
        # issue 16: every service but the trainer could SET the weight key; the worker could SET the prompts
        # stream to a string, read/ack in the collector's group, DEL, XTRIM to 0 and EVAL.
        def set_weights_as(user: str) -> Callable[[], object]:
            return lambda: login(user).set("dressage:weights:latest", "{}")
        forbidden: list[tuple[str, Callable[[], object]]] = [
            (u, set_weights_as(u))
            for u in ("proxy", "prompt-buffer", "group-collector", "rollout-worker", "eval-worker", "ops")]
        forbidden += [
            ("rollout-worker", w.flushall), ("rollout-worker", lambda: w.publish("dressage:weights", "{}")),
            ("rollout-worker", lambda: w.xadd("dressage:batches", {"x": "1"})),
            ("rollout-worker", lambda: w.config_get("*")),
            ("rollout-worker", lambda: w.set("dressage:prompts", "x")),
            ("rollout-worker", lambda: w.delete("dressage:prompts")),
            ("rollout-worker", lambda: w.xtrim("dressage:prompts", maxlen=0)),
            ("rollout-worker", lambda: w.eval("return 1", 0)),
            ("rollout-worker", lambda: w.xreadgroup("collector", "evil", {"dressage:rollouts": "0"})),
            ("rollout-worker", lambda: w.xack("dressage:rollouts", "collector", "0-1")),
            ("proxy", lambda: login("proxy").xadd("dressage:weights:log", {"version": "99"})),
            ("group-collector", lambda: login("group-collector").delete("dressage:batches")),
            ("prompt-buffer", lambda: login("prompt-buffer").xtrim("dressage:prompts", maxlen=0)),
            ("eval-worker", lambda: login("eval-worker").xadd("dressage:batches", {"x": "1"})),
            ("ops", lambda: login("ops").set("dressage:control", "x")),
        ]
        for who, attempt in forbidden:
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
            assert who in users
        assert c.r.xlen("dressage:prompts") > 0 and c.r.type("dressage:prompts") == b"stream"  # nothing happened
        assert c.terminate("w1") == 0  # the real worker would take the entry below first
        fields = encode_entry(prompt_group("acl-g", 0))
        eid = w.xadd("dressage:prompts", fields)
        got = w.xreadgroup("rollout", "acl-test", {"dressage:prompts": ">"}, count=10)
        assert eid in [e for e, _ in got[0][1]] and w.xack("dressage:prompts", "rollout", eid) == 1
        for p in c.procs.values():
            assert not any(pw in p.tail(10**7) for pw in users.values()), p.name


def test_msgpack_bodies_beyond_the_size_limits_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = encode_entry(prompt_group("g", 0))
    monkeypatch.setattr(codec, "MAX_BODY_BYTES", len(fields["body"]) - 1)  # the body-size check, at its edge
    with pytest.raises(MalformedEntry, match="exceeds the limit"):
        decode_entry(fields, PromptGroup)
    monkeypatch.undo()
    assert decode_entry(fields, PromptGroup).group_id == "g"
    oversized = {  # name -> a body beyond one of codec._LIMITS, refused by the unpacker before it builds anything
        "string": b"\xdb" + (16 * 2**20 + 1).to_bytes(4, "big") + b"a" * (16 * 2**20 + 1),
        "array": b"\xdd" + (2**21 + 1).to_bytes(4, "big"),
        "map": b"\xdf" + (2**16 + 1).to_bytes(4, "big"),
        "ext type": msgpack.packb(msgpack.ExtType(1, b"pickle!")),
    }
    for body in oversized.values():
        with pytest.raises(MalformedEntry, match="not valid msgpack"):
            decode_entry({**fields, "body": body}, PromptGroup)
