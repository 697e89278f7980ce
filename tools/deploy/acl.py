"""Optional Redis ACL: one user per service, limited to its keys, channels and commands (Redis >= 7).

``python -m tools.deploy.acl --prefix dressage > users.acl`` renders an ACL file (load it with
``redis-server --aclfile users.acl``) from passwords in the environment,
``REDIS_PASSWORD_<SERVICE>`` (e.g. ``REDIS_PASSWORD_ROLLOUT_WORKER``); a missing, empty or
well-known password is refused. Passwords are written as SHA-256 hashes (``#<hex>``), never in
clear. Each service then connects as itself: ``redis://rollout-worker:<password>@redis:6379/0``.

Every user: all commands except the ``@dangerous`` and ``@admin`` ones (no FLUSHALL, KEYS, CONFIG,
DEBUG, SHUTDOWN, ...) and except PUBLISH; read-write on its own keys; read-only (``%R~``) on the
weight-version keys and ``{p}:control`` -- so only the trainer can publish weights, and only the
window-controller (``HGET``/``HSET``, for ``keep_versions``) writes ``{p}:control`` besides ops. Its user,
like the service, is optional: rendered only when ``REDIS_PASSWORD_WINDOW_CONTROLLER`` is set. ``default`` is
switched off. Every key in the rules is a name from shared/keys.py, never a spelled pattern; a service
that starts using a new key needs a ``Keys`` property and a rule here (a test checks each property has one).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shared.config import DEV_PASSWORDS
from shared.keys import Keys

# Every user: the connection handshake, PING, transactions and the version-bus subscription.
CONNECTION = "+auth +hello +ping +client|setname +client|id +select +time +scan +multi +exec +discard +unwatch"  # SCAN: heartbeat checks (names only)
SUBSCRIBE = "+subscribe +unsubscribe +psubscribe +punsubscribe"
STREAM_READ = "+xreadgroup +xread +xrange +xrevrange +xlen +xpending +xinfo|groups +xinfo|stream +xinfo|consumers"
STREAM_CONSUME = f"{STREAM_READ} +xack +xautoclaim +xclaim +xgroup|create +xgroup|createconsumer +watch"
# What shared.streams.trim_acked runs on a stream it trims (the collector's chore on prompts, rollouts, batches).
TRIM = "+xinfo|groups +xpending +xtrim"
KV_READ = "+get +mget +exists +type +ttl +pttl +hget +hmget +hgetall +hexists +smembers +sismember +smismember +scard"
KV_WRITE = "+set +hset +hincrby +hincrbyfloat +sadd +srem +expire +pexpire +watch"


# (commands, key selectors): "~<key>" read-write, "%R~<key>" read-only, every key a name from shared/keys.py.
Grant = tuple[str, tuple[str, ...]]


@dataclass(frozen=True)
class Rule:
    """What one service may do; every grant is rendered as its own ACL selector ``( ... )``, so a
    command is allowed only on the keys of the grant that lists it (Redis ACLs otherwise combine
    every command with every key pattern of a user)."""

    grants: tuple[Grant, ...]
    channels: tuple[str, ...] = ()  # full channel names, subscribe only
    publish: bool = False  # PUBLISH on its channels (the trainer's weights wake-up)
    rq: bool = False  # rq's own keys and channels (rq:*), any non-dangerous command on them only


def _beat(keys: Keys, service: str) -> Grant:
    """Its heartbeat keys (DEL: its own beat at exit)."""
    return f"+set +pexpire +expire +del {KV_READ}", (rw(keys.health(service, "*")),)


def _own(keys: Keys, service: str) -> tuple[Grant, ...]:
    """Every pipeline service: its heartbeat key, metric reports (XADD to the capped stream) and counters."""
    return (_beat(keys, service),
            (f"+xadd {STREAM_READ}", (rw(keys.metrics), rw(keys.dead))),  # dead letters: read by the brake and ops
            ("+hincrby +hset +hgetall +hget +hmget", (rw(keys.stats),)))


def rw(key: str) -> str:
    return "~" + key


def ro(*names: str) -> tuple[str, ...]:
    return tuple("%R~" + k for k in names)


def rules(keys: Keys) -> dict[str, Rule]:
    """What each service may touch, every key named by shared/keys.py (a key the rules do not name is
    refused at run time; tests/unit/test_deploy_acl.py checks every ``Keys`` name has a rule).
    Weight keys are writable by the trainer alone; ``control`` by the window-controller alone (and by the
    operator as admin)."""
    weights = (keys.weights_latest, keys.weights_log)
    buffer = (keys.prompt_buffer_cursor, keys.prompt_buffer_brake, keys.prompt_buffer_dataset)
    collector = (keys.collector_done, keys.collector_closed, keys.collector_window, keys.collector_decisions)
    return {
        "prompt-buffer": Rule(grants=(
            *_own(keys, "prompt-buffer"),
            (f"+xadd +xgroup|create {STREAM_READ}", (rw(keys.prompts),)),
            (f"{KV_READ} {KV_WRITE} +del", tuple(map(rw, buffer))),  # its own state (DEL: rewrites the dataset record)
            (KV_READ + " " + STREAM_READ, ro(*weights, keys.control, keys.trainer_trained, keys.batches, keys.stats)),
        ), channels=(keys.weights_channel,)),
        "rollout-worker": Rule(grants=(
            *_own(keys, "rollout-worker"),
            (STREAM_CONSUME + " +xadd", (rw(keys.prompts),)),  # its group's reads and acks, re-enqueue
            ("+xadd +xlen", (rw(keys.rollouts),)),  # the hand-off only: it never reads or acks the collector's group
            (KV_READ + " " + STREAM_READ, ro(*weights, keys.control)),
        ), channels=(keys.weights_channel,)),
        "group-collector": Rule(grants=(
            *_own(keys, "group-collector"),
            (f"{STREAM_CONSUME} +xadd {TRIM}", (rw(keys.prompts), rw(keys.rollouts))),  # trims what it consumes
            (f"+xadd +xlen +xrange {TRIM}", (rw(keys.batches),)),  # and the batches the trainer acknowledged
            (f"{KV_READ} {KV_WRITE} +xadd +xtrim {STREAM_READ}", tuple(map(rw, collector))),
            (KV_READ + " " + STREAM_READ, ro(*weights, keys.control, keys.stats)),
        ), channels=(keys.weights_channel,)),
        "trainer": Rule(grants=(
            *_own(keys, "trainer"),
            (STREAM_CONSUME, (rw(keys.batches),)),
            (f"{KV_READ} {KV_WRITE} +xadd +xtrim {STREAM_READ}",
             tuple(map(rw, (*weights, keys.trainer_trained, keys.eval_pinned)))),
            (KV_READ, ro(keys.control)),
        ), channels=(keys.weights_channel,), publish=True, rq=True),
        "proxy": Rule(grants=(
            *_own(keys, "proxy"),
            (KV_READ + " " + STREAM_READ, ro(*weights, keys.control)),
        ), channels=(keys.weights_channel,)),
        "eval-worker": Rule(grants=(
            *_own(keys, "eval-worker"),
            (f"{KV_READ} +srem", (rw(keys.eval_pinned),)),  # unpins the checkpoint it evaluated
        ), rq=True),
        "window-controller": Rule(grants=(  # measures, then sets the window; writes no counter, no dead letter
            _beat(keys, "window-controller"),
            (f"+xadd {STREAM_READ}", (rw(keys.metrics), rw(keys.window_controller_decisions))),  # reports; decisions
            ("+hmget", ro(keys.stats)),  # the collector's counters (drop rate)
            ("+hget +hset", (rw(keys.control),)),  # keep_versions: the one write to control besides the admin's
        )),
    }


SERVICES = tuple(rules(Keys()))
OPTIONAL = frozenset({"window-controller"})  # off by default: its user is rendered only when given a password
OPS = "user ops on #{digest} resetkeys resetchannels -@all +@read +@connection +info %R~{prefix}:* %R~rq:*"
USERS = (*SERVICES, "ops")


def env_name(service: str) -> str:
    return "REDIS_PASSWORD_" + service.upper().replace("-", "_")


def user_line(service: str, prefix: str, password: str, table: Mapping[str, Rule]) -> str:
    """One user's ACL line; ``table``: ``rules(Keys(prefix))``, built once per file."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    if service == "ops":  # dressage status / report / health checks: read-only over the deployment
        return OPS.format(digest=digest, prefix=prefix)
    rule = table[service]
    root = [f"user {service} on #{digest} resetkeys resetchannels -@all {CONNECTION}"]
    channels = [f"&{c}" for c in rule.channels]
    if channels:
        root.append(SUBSCRIBE + (" +publish" if rule.publish else ""))
    selectors = [f"({commands} {' '.join(keys)})" for commands, keys in rule.grants]
    if rule.rq:  # rq manages its keys with scripts and pipelines; confined to rq:* (scripts are ACL-checked too)
        selectors.append("(+@all -@dangerous -@admin ~rq:* &rq:*)")
        root.append("+info|server")  # rq reads the server version (INFO server) on enqueue and in its worker
    return " ".join([*root, *channels, *selectors])


def render(prefix: str, passwords: Mapping[str, str], admin_password: str | None = None) -> str:
    """The ACL file; raises ValueError naming the variable of a missing or weak password.
    ``admin_password`` (``REDIS_PASSWORD``): the ``default`` user becomes the operator's admin
    (``redis-cli``, ``dressage`` control commands); without it ``default`` is off."""
    lines = ["user default off resetkeys resetchannels -@all"]  # ACL files take no comments
    if admin_password:
        if admin_password.strip().lower() in DEV_PASSWORDS or len(admin_password) < 12:
            raise ValueError("REDIS_PASSWORD: a non-default admin password of at least 12 characters is required")
        digest = hashlib.sha256(admin_password.encode()).hexdigest()
        lines = [f"user default on #{digest} ~* &* +@all"]
    table = rules(Keys(prefix))
    for service in USERS:
        pw = passwords.get(service, "")
        if service in OPTIONAL and not pw:
            continue
        if pw.strip().lower() in DEV_PASSWORDS or len(pw) < 12:
            raise ValueError(f"{env_name(service)}: a non-default password of at least 12 characters is required")
        lines.append(user_line(service, prefix, pw, table))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.deploy.acl", description=__doc__.splitlines()[0])
    p.add_argument("--prefix", default="dressage")
    args = p.parse_args(argv)
    passwords = {s: os.environ.get(env_name(s), "") for s in USERS}
    try:
        sys.stdout.write(render(args.prefix, passwords, os.environ.get("REDIS_PASSWORD") or None))
    except ValueError as exc:
        sys.stderr.write(f"acl: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
