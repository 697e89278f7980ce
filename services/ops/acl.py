"""Optional Redis ACL: one user per service, limited to its keys, channels and commands (Redis >= 7).

``python -m services.ops.acl --prefix dressage > users.acl`` renders an ACL file (load it with
``redis-server --aclfile users.acl``) from passwords in the environment,
``REDIS_PASSWORD_<SERVICE>`` (e.g. ``REDIS_PASSWORD_ROLLOUT_WORKER``); a missing, empty or
well-known password is refused. Passwords are written as SHA-256 hashes (``#<hex>``), never in
clear. Each service then connects as itself: ``redis://rollout-worker:<password>@redis:6379/0``.

Every user: all commands except the ``@dangerous`` and ``@admin`` ones (no FLUSHALL, KEYS, CONFIG,
DEBUG, SHUTDOWN, ...) and except PUBLISH; read-write on its own keys; read-only (``%R~``) on the
weight-version keys and ``{p}:control`` -- so only the trainer can publish weights. ``default`` is
switched off. The rules follow the keys each service touches today (shared/keys.py and the
service-private ``{p}:<service>:*`` keys); a service that starts using a new key needs a rule here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Mapping

from shared.config import DEV_PASSWORDS

BASE_COMMANDS = "+@all -@dangerous -@admin -publish"
# Keys every pipeline service writes: counters, metric reports, dead letters.
COMMON_RW = ("stats", "metrics", "dead")
RULES: dict[str, dict[str, tuple[str, ...]]] = {
    # rw: read-write key patterns; ro: read-only patterns; channels: pub/sub channels (subscribe only)
    "prompt-buffer": {"rw": ("prompts", "prompt_buffer:*"), "ro": ("weights:*", "control", "trainer:*"),
                      "channels": ("weights",)},
    "rollout-worker": {"rw": ("prompts", "rollouts"), "ro": ("weights:*", "control"), "channels": ("weights",)},
    "group-collector": {"rw": ("prompts", "rollouts", "batches", "collector:*"), "ro": ("weights:*", "control"),
                        "channels": ("weights",)},
    # eval:* holds {p}:eval:pinned (shared/evaluation.py): the trainer pins and reads, the eval worker unpins.
    "trainer": {"rw": ("batches", "weights:*", "trainer:*", "eval:*"), "ro": ("control",), "channels": ("weights",)},
    "proxy": {"rw": (), "ro": ("weights:*", "control"), "channels": ("weights",)},
    "eval-worker": {"rw": ("eval:*",), "ro": (), "channels": ()},
    "ops": {"rw": (), "ro": ("*",), "channels": ()},  # dressage status / report: read everything
}
PUBLISHERS = {"trainer"}  # the only service allowed to PUBLISH (the weights wake-up)
RQ_USERS = {"trainer", "eval-worker"}  # rq keys and channels (the trainer enqueues, the worker runs)


def env_name(service: str) -> str:
    return "REDIS_PASSWORD_" + service.upper().replace("-", "_")


def user_line(service: str, prefix: str, password: str) -> str:
    rule = RULES[service]
    rw = [f"~{prefix}:{k}" for k in (*COMMON_RW, f"health:{service}:*", *rule["rw"])] if service != "ops" else []
    ro = [f"%R~{prefix}:{k}" for k in rule["ro"]]
    channels = [f"&{prefix}:{c}" for c in rule["channels"]]
    commands = BASE_COMMANDS
    if service in PUBLISHERS:
        commands += " +publish"
    if service in RQ_USERS:
        rw.append("~rq:*")
        channels.append("&rq:*")
    if service == "ops":
        commands = "-@all +@read +@connection +info"  # read-only tool
    digest = hashlib.sha256(password.encode()).hexdigest()
    parts = [f"user {service} on #{digest} resetkeys resetchannels", *rw, *ro, *channels, commands]
    return " ".join(parts)


def render(prefix: str, passwords: Mapping[str, str]) -> str:
    """The ACL file; raises ValueError naming the variable of a missing or weak password."""
    lines = ["user default off resetkeys resetchannels -@all"]  # ACL files take no comments
    for service in RULES:
        pw = passwords.get(service, "")
        if pw.strip().lower() in DEV_PASSWORDS or len(pw) < 12:
            raise ValueError(f"{env_name(service)}: a non-default password of at least 12 characters is required")
        lines.append(user_line(service, prefix, pw))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.ops.acl", description=__doc__.splitlines()[0])
    p.add_argument("--prefix", default="dressage")
    args = p.parse_args(argv)
    passwords = {s: os.environ.get(env_name(s), "") for s in RULES}
    try:
        sys.stdout.write(render(args.prefix, passwords))
    except ValueError as exc:
        sys.stderr.write(f"acl: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
