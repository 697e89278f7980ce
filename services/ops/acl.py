"""Optional Redis ACL: one user per service, limited to its keys, channels and commands (Redis >= 7).

``python -m services.ops.acl --prefix dressage > users.acl`` renders an ACL file (load it with
``redis-server --aclfile users.acl``) from passwords in the environment,
``REDIS_PASSWORD_<SERVICE>`` (e.g. ``REDIS_PASSWORD_ROLLOUT_WORKER``); a missing, empty or
well-known password is refused. Passwords are written as SHA-256 hashes (``#<hex>``), never in
clear. Each service then connects as itself: ``redis://rollout-worker:<password>@redis:6379/0``.

Every user: all commands except the ``@dangerous`` and ``@admin`` ones (no FLUSHALL, KEYS, CONFIG,
DEBUG, SHUTDOWN, ...) and except PUBLISH; read-write on its own keys; read-only (``%R~``) on the
weight-version keys and ``{p}:control`` -- so only the trainer can publish weights, and only the
window-controller (``HGET``/``HSET``, for ``keep_versions``) writes ``{p}:control`` besides ops. Its user,
like the service, is optional: rendered only when ``REDIS_PASSWORD_WINDOW_CONTROLLER`` is set. ``default`` is
switched off. The rules follow the keys each service touches today (shared/keys.py and the
service-private ``{p}:<service>:*`` keys); a service that starts using a new key needs a rule here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shared.config import DEV_PASSWORDS

# Every user: the connection handshake, PING, transactions and the version-bus subscription.
CONNECTION = "+auth +hello +ping +client|setname +client|id +select +time +scan +multi +exec +discard +unwatch"  # SCAN: heartbeat checks (names only)
SUBSCRIBE = "+subscribe +unsubscribe +psubscribe +punsubscribe"
STREAM_READ = "+xreadgroup +xread +xrange +xrevrange +xlen +xpending +xinfo|groups +xinfo|stream +xinfo|consumers"
STREAM_CONSUME = f"{STREAM_READ} +xack +xautoclaim +xclaim +xgroup|create +xgroup|createconsumer +watch"
# What shared.streams.trim_acked runs on a stream it trims (the collector's chore on prompts, rollouts, batches).
TRIM = "+xinfo|groups +xpending +xtrim"
KV_READ = "+get +mget +exists +type +ttl +pttl +hget +hmget +hgetall +hexists +smembers +sismember +smismember +scard"
KV_WRITE = "+set +hset +hincrby +hincrbyfloat +sadd +srem +expire +pexpire +watch"


@dataclass(frozen=True)
class Rule:
    """What one service may do; every grant is rendered as its own ACL selector ``( ... )``, so a
    command is allowed only on the keys of the grant that lists it (Redis ACLs otherwise combine
    every command with every key pattern of a user)."""

    grants: tuple[tuple[str, tuple[str, ...]], ...]  # (commands, key patterns "%R~x", "%W~x" or "~x")
    channels: tuple[str, ...] = ()  # subscribe only
    publish: bool = False  # PUBLISH on its channels (the trainer's weights wake-up)
    rq: bool = False  # rq's own keys and channels (rq:*), any non-dangerous command on them only


def _beat(service: str) -> tuple[str, tuple[str, ...]]:
    """Its heartbeat key (DEL: its own beat at exit)."""
    return f"+set +pexpire +expire +del {KV_READ}", (f"~health:{service}:*",)


def _own(service: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Every pipeline service: its heartbeat key, metric reports (XADD to the capped stream) and counters."""
    return (_beat(service),
            (f"+xadd {STREAM_READ}", ("~metrics", "~dead")),  # dead letters: read by the brake and ops
            ("+hincrby +hset +hgetall +hget +hmget", ("~stats",)))


# What each service does today (shared/keys.py and the service-private {p}:<service>:* keys).
# Weight keys ({p}:weights:*) are writable by the trainer alone; {p}:control by the window-controller alone
# (and by the operator as admin).
RULES: dict[str, Rule] = {
    "prompt-buffer": Rule(grants=(
        *_own("prompt-buffer"),
        (f"+xadd +xgroup|create {STREAM_READ}", ("~prompts",)),
        (f"{KV_READ} {KV_WRITE} +del", ("~prompt_buffer:*",)),  # its own state (DEL: rewrites the dataset record)
        (KV_READ + " " + STREAM_READ, ("%R~weights:*", "%R~control", "%R~trainer:*", "%R~batches", "%R~stats")),
    ), channels=("weights",)),
    "rollout-worker": Rule(grants=(
        *_own("rollout-worker"),
        (STREAM_CONSUME + " +xadd", ("~prompts",)),  # its group's reads and acks, re-enqueue
        ("+xadd +xlen", ("~rollouts",)),  # the hand-off only: it never reads or acks the collector's group
        (KV_READ + " " + STREAM_READ, ("%R~weights:*", "%R~control")),
    ), channels=("weights",)),
    "group-collector": Rule(grants=(
        *_own("group-collector"),
        (f"{STREAM_CONSUME} +xadd {TRIM}", ("~prompts", "~rollouts")),  # trims the streams it consumes
        (f"+xadd +xlen +xrange {TRIM}", ("~batches",)),  # and the batches the trainer acknowledged
        (f"{KV_READ} {KV_WRITE} +xadd +xtrim {STREAM_READ}", ("~collector:*",)),
        (KV_READ + " " + STREAM_READ, ("%R~weights:*", "%R~control", "%R~stats")),
    ), channels=("weights",)),
    "trainer": Rule(grants=(
        *_own("trainer"),
        (STREAM_CONSUME, ("~batches",)),
        (f"{KV_READ} {KV_WRITE} +xadd +xtrim {STREAM_READ}", ("~weights:*", "~trainer:*", "~eval:*")),
        (KV_READ, ("%R~control",)),
    ), channels=("weights",), publish=True, rq=True),
    "proxy": Rule(grants=(
        *_own("proxy"),
        (KV_READ + " " + STREAM_READ, ("%R~weights:*", "%R~control")),
    ), channels=("weights",)),
    "eval-worker": Rule(grants=(
        *_own("eval-worker"),
        (f"{KV_READ} +srem", ("~eval:*",)),  # unpins the checkpoint it evaluated
    ), rq=True),
    "window-controller": Rule(grants=(  # measures, then sets the window; writes no counter, no dead letter
        _beat("window-controller"),
        (f"+xadd {STREAM_READ}", ("~metrics", "~window_controller:*")),  # the trainer's reports; its decisions
        ("+hmget", ("%R~stats",)),  # the collector's counters (drop rate)
        ("+hget +hset", ("~control",)),  # keep_versions: the one write to {p}:control besides the admin's
    )),
}
OPTIONAL = frozenset({"window-controller"})  # off by default: its user is rendered only when given a password
OPS = "user ops on #{digest} resetkeys resetchannels -@all +@read +@connection +info %R~{prefix}:* %R~rq:*"
USERS = (*RULES, "ops")


def env_name(service: str) -> str:
    return "REDIS_PASSWORD_" + service.upper().replace("-", "_")


def _keys(prefix: str, patterns: tuple[str, ...]) -> str:
    return " ".join(p.replace("~", f"~{prefix}:", 1) for p in patterns)


def user_line(service: str, prefix: str, password: str) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    if service == "ops":  # dressage status / report / health checks: read-only over the deployment
        return OPS.format(digest=digest, prefix=prefix)
    rule = RULES[service]
    root = [f"user {service} on #{digest} resetkeys resetchannels -@all {CONNECTION}"]
    channels = [f"&{prefix}:{c}" for c in rule.channels]
    if channels:
        root.append(SUBSCRIBE + (" +publish" if rule.publish else ""))
    selectors = [f"({commands} {_keys(prefix, keys)})" for commands, keys in rule.grants]
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
    for service in USERS:
        pw = passwords.get(service, "")
        if service in OPTIONAL and not pw:
            continue
        if pw.strip().lower() in DEV_PASSWORDS or len(pw) < 12:
            raise ValueError(f"{env_name(service)}: a non-default password of at least 12 characters is required")
        lines.append(user_line(service, prefix, pw))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.ops.acl", description=__doc__.splitlines()[0])
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
