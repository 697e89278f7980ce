"""Samples of the engine's and the proxy's own clocks, for the run's time decomposition.

``dressage up`` reports them every few seconds as service ``ops`` rows in ``{p}:metrics``:
``engine/busy_s`` (the engine scheduler's cumulative seconds with a forward pass running,
summed over the run's engines) and ``proxy/weight_update_s`` / ``proxy/weight_updates`` (the
proxy's cumulative weight-publication pause: pause, engine loads, resume), and ``cpu/<service>_s``
(user + system CPU seconds of each service's processes and everything they started -- the eval worker's
forked work horses -- from ``/proc/<pid>/stat``, replicas summed:
on a small machine this is where the cores go). Differences between two samples divided by the time
between them give the busy and pause fractions and the cores used (``tools.reports.timing``). A probe
that fails returns nothing: telemetry never stops a run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
TIMEOUT_S = 2.0


def _get_json(url: str, token: str | None) -> dict[str, Any] | None:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:  # noqa: S310 (loopback URLs of this run)
            body = json.loads(resp.read())
    except (OSError, ValueError, urllib.error.URLError) as exc:
        log.debug("probe %s failed: %s", url, exc)
        return None
    return body if isinstance(body, dict) else None


def _stat_fields(pid: int, proc: Path) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``pid (comm)``: state is [0], ppid [1], utime [11],
    stime [12], cutime [13] and cstime [14] (children waited for); None when unreadable."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _ticks(fields: list[str] | None) -> int | None:
    """utime + stime + cutime + cstime of parsed stat ``fields``; None when they are missing or unreadable."""
    if fields is None or len(fields) < 15:
        return None
    try:
        return sum(int(f) for f in fields[11:15])
    except ValueError:
        return None


def parent_pid(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The parent of a live process; None when it is gone or unreadable."""
    fields = _stat_fields(pid, proc)
    return int(fields[1]) if fields is not None and len(fields) > 1 else None


def process_children(proc: Path = Path("/proc")) -> dict[int, list[int]]:
    """ppid -> live child pids, from one scan of ``/proc``."""
    out: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit() and (ppid := parent_pid(int(entry.name), proc)) is not None:
            out.setdefault(ppid, []).append(int(entry.name))
    return out


def cpu_seconds(pid: int, proc: Path = Path("/proc"), children: dict[int, list[int]] | None = None) -> float | None:
    """User + system CPU seconds of a live process and of every process it started (Linux ``/proc``):
    its own, its children's that it waited for, and its live descendants' (an rq worker's work horse,
    a forked job). None when unreadable. ``children`` is a ``/proc`` scan to reuse across calls."""
    ticks = _ticks(_stat_fields(pid, proc))
    if ticks is None:
        return None
    tree = process_children(proc) if children is None else children
    todo, seen = list(tree.get(pid, [])), {pid}
    while todo:
        child = todo.pop()
        if child in seen or (sub := _ticks(_stat_fields(child, proc))) is None:
            continue  # a child that exited since the scan: its time is in our cutime once reaped
        seen.add(child)
        ticks += sub
        todo.extend(tree.get(child, []))
    return ticks / os.sysconf("SC_CLK_TCK")


def service_of(process: str) -> str:
    """``rollout-worker-2`` -> ``rollout-worker``: replicas are summed under their service."""
    return re.sub(r"-\d+$", "", process)


def cpu_by_service(pids: Mapping[str, int], proc: Path = Path("/proc")) -> dict[str, float]:
    out: dict[str, float] = {}
    tree = process_children(proc) if pids else {}
    for name, pid in pids.items():
        seconds = cpu_seconds(pid, proc, tree)
        if seconds is not None:
            key = f"cpu/{service_of(name)}_s"
            out[key] = round(out.get(key, 0.0) + seconds, 3)
    return out


class ServiceProbe:
    """``sample()`` -> the newest cumulative clocks of the engines and the proxy (absent when unreachable)."""

    def __init__(self, engines: Sequence[str], proxy: str | None, proxy_token: str | None = None,
                 engine_token: str | None = None, pids: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.pids = pids  # process name -> pid of the run's services (the supervisor's), for CPU seconds
        self.engines = [e.rstrip("/") for e in engines]
        self.proxy = proxy.rstrip("/") if proxy else None
        self.proxy_token, self.engine_token = proxy_token, engine_token

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        busy = [b for b in (_get_json(f"{e}/health", self.engine_token) for e in self.engines) if b is not None]
        if busy and len(busy) == len(self.engines) and all("busy_s" in b for b in busy):
            out["engine/busy_s"] = round(sum(float(b["busy_s"]) for b in busy), 4)
        if self.proxy:
            state = _get_json(f"{self.proxy}/v1/rollout/state", self.proxy_token)
            if state is not None and "weight_update_seconds_total" in state:
                out["proxy/weight_update_s"] = float(state["weight_update_seconds_total"])
                out["proxy/weight_updates"] = float(state.get("weight_updates_total", 0))
        if self.pids is not None:
            out.update(cpu_by_service(self.pids()))
        return out
