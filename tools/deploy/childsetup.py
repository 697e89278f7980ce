"""What a supervised child runs before it becomes its service, exec'd (``preexec_fn``) or forked (prefork).

Invariant: the same setup either way -- the parent-death signal (Linux), the niceness and the scheduling
policy, set before the service starts a thread, so every thread it later starts (torch's included) inherits
them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable


def die_with_parent(parent: int | None = None) -> None:  # pragma: no cover - runs in the child before its service
    """Linux: deliver SIGTERM to this process when its parent dies, even by SIGKILL. ``parent``: the pid of the
    parent that forked us; one that died before the signal was armed (between the fork and here) ends us now,
    as the signal would have."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


SCHED_POLICIES = {"batch": "SCHED_BATCH", "idle": "SCHED_IDLE"}  # ops.service_sched values -> os constants


def child_setup(nice: int, sched: str | None = None, parent: int | None = None) -> Callable[[], None]:
    """What the child runs before its service (between fork and exec, or in a forked launcher child): the
    parent-death signal (Linux), its niceness and its scheduling policy. ``parent``: the forking process
    (default: the caller, which is the parent when this is a ``preexec_fn``). A policy this platform lacks
    (not Linux) is left out: the service runs as normal."""
    linux = sys.platform.startswith("linux")
    parent = os.getpid() if parent is None else parent
    policy = getattr(os, SCHED_POLICIES[sched], None) if sched else None

    def setup() -> None:  # pragma: no cover - runs in the child before its service
        if linux:
            die_with_parent(parent)
        if nice:
            os.nice(nice)
        if policy is not None:
            os.sched_setscheduler(0, policy, os.sched_param(0))

    return setup
