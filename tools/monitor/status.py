"""``dressage status [--watch]``: one screen about a deployment, read from Redis only.

Sections (docs/operations.md gives the redis-cli command behind each): VERSION, WINDOW, STREAMS,
GROUPS (pending, lag, consumers with idle times), PIPELINE ({p}:stats counters and groups in
flight), DEAD (by reason), THROUGHPUT ({p}:metrics over the last minute, and {p}:stats deltas
between two refreshes), TIME (where the wall-clock goes: the trainer's wait/train/checkpoint/publish
fractions since it started, the engine's busy fraction over the last minute; ``tools.reports.timing``), DATASET
(rows the prompt-buffer read, malformed rows it skipped), LIVENESS (heartbeat keys and their TTLs), ENGINES (HTTP health and loaded
weight version, asked by the rules the proxy uses (``shared.sglang_compat``), so that this project's
engine and each SGLang release are spoken to as the proxy speaks to them: SGLang's /health takes >= 1 s, its weight version
moved to /model_info in 0.5.21; the engines write nothing to Redis). ``render`` is pure:
snapshot in, text out. Where to look: ``--redis-url``/``--prefix``, else ``--run DIR`` (its run.json), else
``--config``/``REDIS_URL``, else the newest ``dressage up`` run (``runs/latest/run.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from shared.config import load_config
from shared.errors import ConfigError
from shared.keys import Keys
from shared.sglang_compat import INFO_ROUTES, dialect_for, weight_version_of
from tools.deploy.plan import public_url
from tools.monitor.snapshot import Snapshot, collect
from tools.reports import series, timing

# Services that write heartbeat keys. The engine speaks SGLang's API and never touches Redis: it
# is probed over HTTP instead (ENGINES line: its health and weight-version routes).
SERVICES = ("proxy", "prompt-buffer", "rollout-worker", "group-collector", "trainer", "eval-worker")


def probe_engines(urls: Sequence[str], timeout: float = 1.0, health_timeout_s: float = 5.0,
                  engine_key: str | None = None) -> list[tuple[str, str]]:
    """(url, state) per engine: alive with its dialect and loaded weight version, or down and why.
    ``health_timeout_s`` bounds an SGLang health check (a generation, >= 1 s); ``timeout`` the rest."""
    headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
    with httpx.Client(headers=headers) as client:
        return [(public_url(u), _engine_state(client, u.rstrip("/"), timeout, health_timeout_s)) for u in urls]


def _get(client: httpx.Client, url: str, routes: Sequence[str], timeout: float) -> Any:
    """The JSON body of the first of ``routes`` that does not 404 (the dialect's fallback order);
    None when none answers 200 with JSON. httpx.HTTPError when the engine cannot be reached."""
    for route in routes:
        r = client.get(url + route, timeout=timeout)
        if r.status_code == 404:
            continue
        try:
            return r.json() if r.status_code == 200 else None
        except ValueError:
            return None
    return None


def _engine_state(client: httpx.Client, url: str, timeout: float, health_timeout_s: float) -> str:
    """One engine, spoken to in its dialect (shared.sglang_compat: the routes the proxy uses)."""
    try:
        dialect = dialect_for(_get(client, url, INFO_ROUTES, health_timeout_s))
        health = client.get(url + dialect.health_route, timeout=health_timeout_s if dialect.slow_health else timeout)
    except httpx.HTTPError:
        return "DOWN (/health unreachable)"
    if health.status_code != 200:
        return f"DOWN (/health answered {health.status_code})"  # SGLang: 503 while starting or unhealthy
    try:
        version = weight_version_of(_get(client, url, dialect.weight_version_routes, timeout))
    except httpx.HTTPError:
        version = None
    return f"alive ({dialect.name}, weight_version {version or '?'})"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def _throughput(s: Snapshot, previous: Snapshot | None) -> list[str]:
    lines: list[str] = []
    train = series.trainer_rows(s.recent)
    if len(train) >= 2:
        steps = (series.pick(train[-1], series.STEP) or 0) - (series.pick(train[0], series.STEP) or 0)
        dt = (series.number(train[-1].get("ts")) or 0) - (series.number(train[0].get("ts")) or 0)
        if dt > 0:
            lines.append(f"trainer {60 * steps / dt:.2f} steps/min")
    ops = [r for r in s.recent if r.get("service") == "ops"]
    if len(ops) >= 2:
        dt = (series.number(ops[-1].get("ts")) or 0) - (series.number(ops[0].get("ts")) or 0)
        for name in ("groups_produced", "groups_trained"):
            a, b = series.number(ops[0].get(f"stats/{name}")), series.number(ops[-1].get(f"stats/{name}"))
            if dt > 0 and a is not None and b is not None:
                lines.append(f"{name.removeprefix('groups_')} {60 * (b - a) / dt:.1f} groups/min")
    if previous is not None and s.taken_at > previous.taken_at:
        dt = s.taken_at - previous.taken_at
        for name in ("groups_produced", "groups_trained"):
            delta = s.stats.get(name, 0) - previous.stats.get(name, 0)
            lines.append(f"{name.removeprefix('groups_')} {delta / dt:.2f}/s since last refresh")
    by_service: dict[str, int] = {}
    for r in s.recent:
        by_service[str(r.get("service"))] = by_service.get(str(r.get("service")), 0) + 1
    if by_service:
        lines.append("reports/min " + ", ".join(f"{k} {v}" for k, v in sorted(by_service.items())))
    return lines or ["no metrics in the last minute"]


def render(s: Snapshot, previous: Snapshot | None = None, expected: Sequence[str] = SERVICES,
           where: str = "", engines: Sequence[tuple[str, str]] = ()) -> str:
    out: list[str] = [f"dressage status  prefix={s.prefix}  {where}  "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.taken_at))}"]
    if s.latest:
        published_at = s.latest.get("published_at")
        age = s.taken_at - float(published_at) if isinstance(published_at, (int, float)) else None
        out.append(f"VERSION     current {s.latest.get('version')} (step {s.latest.get('step')}, "
                   f"published {_ago(age)} ago)  published versions: {s.published}")
    else:
        out.append("VERSION     none published yet")
    if s.window:
        w = s.window
        out.append(f"WINDOW      keep_versions {w.get('keep_versions')}  current {w.get('current_version')}  "
                   f"cutoff {w.get('cutoff_version')}  waiting groups {w.get('waiting_groups', '?')}")
    else:
        out.append("WINDOW      (collector has not written {p}:collector:window)")
    if s.control:
        out.append("CONTROL     " + "  ".join(f"{k}={v}" for k, v in sorted(s.control.items())))
    if s.brake and s.brake.get("engaged") == "1":
        out.append(f"PAUSED      prompt-buffer admits nothing (dead-letter brake): {s.brake.get('why', '?')}")
    if s.dataset:
        d = s.dataset
        bad = f"  first: {d['first_error']}" if d.get("first_error") else ""
        out.append(f"DATASET     {d.get('path', '?')}: {d.get('rows', '?')} rows, "
                   f"{d.get('malformed', '0')} malformed rows skipped{bad}")
    for name, why in sorted(s.degraded.items()):
        out.append(f"DEGRADED    optional service {name} is down: {why}")
    out.append("STREAMS     " + "  ".join(f"{k} {v}" for k, v in s.streams.items()))
    out.append("GROUPS      stream    group      pending  lag     consumers (pending, idle)")
    for g in s.groups:
        lag = "?" if g.lag is None else (f">={g.lag}" if g.lag_capped else str(g.lag))
        cons = ", ".join(f"{c.name} ({c.pending}, {_ago(c.idle_ms / 1000)})" for c in g.consumers) or "-"
        out.append(f"            {g.stream:<9} {g.group:<10} {g.pending:<8} {lag:<7} {cons}")
    if not s.groups:
        out.append("            (no consumer groups yet)")
    st = s.stats
    in_flight = st.get("groups_produced", 0) - st.get("groups_trained", 0) - st.get("groups_dead_lettered", 0)
    out.append(f"PIPELINE    produced {st.get('groups_produced', 0)}  batched {st.get('groups_batched', 0)}  "
               f"trained {st.get('groups_trained', 0)} ({st.get('batches_trained', 0)} batches)  "
               f"in flight {in_flight}")
    out.append(f"DROPS       stale dropped {st.get('groups_dropped_stale', 0)}  "
               f"re-enqueued {st.get('groups_reenqueued', 0)}  dead-lettered {st.get('groups_dead_lettered', 0)}  "
               f"poison {st.get('poison_dead_lettered', 0)}  duplicates discarded "
               f"{st.get('groups_duplicate_discarded', 0)}")
    dead = ", ".join(f"{k} {v}" for k, v in s.dead_by_reason.most_common()) or "none"
    out.append(f"DEAD        {dead}")
    out.append("THROUGHPUT  " + "; ".join(_throughput(s, previous)))
    out.append("TIME        " + timing.one_line(timing.decompose(s.recent)))
    out.append("LIVENESS    service          consumer                      state")
    seen = {b.service for b in s.beats}
    for b in s.beats:
        state = f"alive (beat {_ago(b.age_s)} ago, ttl {b.ttl_ms / 1000:.0f}s)" if b.ttl_ms != -1 \
            else "alive (no ttl!)"
        out.append(f"            {b.service:<16} {b.consumer:<29} {state}")
    for name in expected:
        if name not in seen:
            out.append(f"            {name:<16} {'-':<29} DOWN (no heartbeat key)")
    for url, state in engines:
        out.append(f"ENGINES     {url:<46} {state}" if url == engines[0][0] else f"            {url:<46} {state}")
    return "\n".join(out)


@dataclass(frozen=True)
class Target:
    url: str
    prefix: str
    password: str | None
    expected: list[str]  # services that should have a heartbeat key
    engines: list[str]  # engine base URLs to probe over HTTP
    engine_health_timeout_s: float = 5.0  # proxy.engine_health_timeout_s (SGLang's /health: >= 1 s)
    engine_key: str | None = None  # proxy.engine_api_key, sent to the engines


def resolve_target(args: argparse.Namespace) -> Target:
    """Where to look, from the flags, a run dir (run.json), or a config (+ env)."""
    cfg = load_config(args.config)
    expected = [s for s in SERVICES if s != "eval-worker" or cfg.eval.live]  # a deferred one runs after the run
    pw = cfg.redis.secret()
    health_s = cfg.proxy.engine_health_timeout_s
    engine_key = cfg.proxy.engine_api_key.get_secret_value() if cfg.proxy.engine_api_key else None
    run_json: Path | None = None
    if args.run:
        run_json = Path(args.run) / "run.json"
    elif not (args.redis_url or args.config or os.environ.get("REDIS_URL")):
        candidate = Path(cfg.ops.run_dir) / "latest" / "run.json"
        run_json = candidate if candidate.exists() else None
    if run_json is not None:
        info = json.loads(run_json.read_text())
        services = [s for s in info.get("services", expected) if s in SERVICES]
        return Target(args.redis_url or info["redis_url"], args.prefix or info["prefix"], pw, services,
                      list(info.get("engines", [])), health_s, engine_key)
    return Target(args.redis_url or cfg.redis.url, args.prefix or cfg.redis.prefix, pw, expected,
                  list(cfg.proxy.engines), health_s, engine_key)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dressage status", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--config", help="deployment config (redis.url, redis.prefix)")
    p.add_argument("--redis-url")
    p.add_argument("--prefix")
    p.add_argument("--run", help="a dressage up run directory (reads its run.json)")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import redis

    from shared.redisconn import connect, run_prefix

    args = parse_args(argv)
    try:
        t = resolve_target(args)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"dressage status: {exc}\n")
        return 2
    r: Any = connect(t.url, t.password, socket_timeout=10)  # redis://, redis+cluster://, redis+sentinel://
    keys = Keys(run_prefix(t.prefix, t.url))
    where = f"redis={public_url(t.url)}"  # never print a password from the URL
    previous: Snapshot | None = None
    try:
        while True:
            snap = collect(r, keys)
            screen = render(snap, previous, t.expected, where,
                            probe_engines(t.engines, health_timeout_s=t.engine_health_timeout_s, engine_key=t.engine_key))
            if args.watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            sys.stdout.write(screen + "\n")
            sys.stdout.flush()
            if not args.watch:
                return 0
            previous = snap
            time.sleep(max(0.2, args.interval))
    except KeyboardInterrupt:
        return 0
    except redis.RedisError as exc:
        sys.stderr.write(f"dressage status: cannot read {where}: {exc}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
