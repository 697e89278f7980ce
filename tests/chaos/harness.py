"""Chaos harness: a private Redis, real service processes, fault injection and the history checker.

``Cluster`` owns one deployment for one test: a ``redis-server`` (``RedisProcess``, AOF on or off,
same directory on restart), a YAML config (``configs/test.yaml`` + chaos overrides: unique prefix,
free ports, tiny model, small dataset, stream trimming off), service processes started with
``python -m services.cli <service> --config FILE`` and logging to files, signals (SIGKILL, SIGSTOP,
SIGCONT, SIGTERM), and a ``Recorder`` thread that tails the streams into a ``history.History`` (history.py)
so the history outlives Redis itself (a restart without AOF cannot hide what it lost).

Waiting is always polling a condition in Redis or over HTTP (``wait_until``), never a fixed sleep.
``Cluster.verdict()`` = recorded history + what Redis holds now; tests assert ``verdict().ok``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import launching
import redis
import yaml
from history import History, collect, poll
from paths import REPO
from waits import wait_for

from shared.config import merge_layers
from shared.keys import GROUP_COLLECTOR, GROUP_ROLLOUT, GROUP_TRAINER, Keys
from shared.modeling import ModelSpec, ensure_model
from shared.redisproc import RedisProcess, free_port
from tools.deploy.supervisor import Proc as Started

# Smaller than the default tiny model: the chaos suite checks plumbing, and every process loads it.
CHAOS_SPEC = ModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=128)
HEALTH = {"prompt-buffer": "prompt-buffer", "rollout-worker": "rollout-worker", "group-collector": "group-collector",
          "trainer": "trainer", "eval-worker": "eval-worker"}  # service -> heartbeat service name
STREAM_GROUPS = {"prompts": GROUP_ROLLOUT, "rollouts": GROUP_COLLECTOR, "batches": GROUP_TRAINER}


def build_model(path: Path) -> Path:
    """The tiny random-init policy every chaos process loads (built once per session)."""
    ensure_model(path, "reverse", spec=CHAOS_SPEC, seed=0)
    return path


def write_dataset(path: Path, n: int, source: Path = REPO / "data" / "reverse" / "train.jsonl") -> Path:
    """The first ``n`` rows of a task dataset (one epoch of it = ``n`` prompt groups)."""
    rows = source.read_text().splitlines()[:n]
    path.write_text("\n".join(rows) + "\n")
    return path


# Chaos waits poll Redis or HTTP: every 0.1 s is enough and keeps the polling off the services' cores.
wait_until = functools.partial(wait_for, period=0.1)


def clean_env() -> dict[str, str]:
    """The test's environment without anything that would point a service elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DRESSAGE_") and k not in ("REDIS_URL", "REDIS_PASSWORD")}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


@dataclass
class Proc:
    name: str
    service: str
    popen: Started
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


@dataclass
class Engine:
    """The session's shared engine process (tests/chaos/conftest.py)."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def counters(self) -> dict[str, Any]:
        """``/get_server_info``: scheduler counters, ``requests`` = generations accepted since start."""
        return dict(httpx.get(f"{self.url}/get_server_info", timeout=10).json())


class Recorder:
    """Tails the history streams into a ``History`` every ``period`` s; rides out Redis outages."""

    def __init__(self, factory: Callable[[], redis.Redis], keys: Keys, period: float = 0.1) -> None:
        self.factory, self.keys, self.period = factory, keys, period
        self.history = History()
        self.lock = threading.RLock()
        self._cursors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="history-recorder", daemon=True)

    def start(self) -> Recorder:
        self._thread.start()
        return self

    def attempts(self) -> dict[str, set[int]]:
        """group id -> attempts enqueued so far (a copy, safe to read while the recorder runs)."""
        with self.lock:
            return {g: set(a) for g, a in self.history.attempts.items()}

    def sync(self, r: redis.Redis) -> None:
        with self.lock:
            poll(r, self.keys, self.history, self._cursors)

    def _run(self) -> None:
        r = self.factory()
        while not self._stop.is_set():
            try:
                self.sync(r)
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                pass  # Redis is down or restarting: try again on the next tick
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Cluster:
    """One deployment under test. Use as a context manager (``close()`` kills whatever is left)."""

    root: Path
    model_dir: Path
    engine_url: str | None = None
    rows: int = 8
    appendonly: bool = True
    password: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    redis_extra: list[str] = field(default_factory=list)
    own_engine: bool = False  # start an engine of its own (``start("engine")``) instead of the shared one
    prefix: str | None = None  # key prefix; None = a unique one (ACL patterns need the real "dressage")
    users: dict[str, str] | None = None  # ACL user (= service name) -> password; services log in as theirs

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        self.redis = RedisProcess(self.root / "redis", appendonly=self.appendonly, password=self.password,
                                  extra=self.redis_extra).start()
        self.keys = Keys(self.prefix or f"chaos{uuid.uuid4().hex[:8]}")
        self.r = self.client()
        self.dataset = write_dataset(self.root / "dataset.jsonl", self.rows)
        self.proxy_port = free_port()
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}"
        self.engine_port = free_port()
        if self.own_engine:
            self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.procs: dict[str, Proc] = {}
        self.faults: list[str] = []  # every fault injected, for the figures
        self.config_path = self.write_config(self.overrides)
        self.recorder = Recorder(self.client, self.keys).start()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- config -------------------------------------------------------------------------------

    def config_data(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        base = yaml.safe_load((REPO / "configs" / "test.yaml").read_text())
        chaos = {
            "redis": {"url": f"redis://127.0.0.1:{self.redis.port}/0", "prefix": self.keys.prefix,
                      "reconnect_backoff_max_s": 1.0, "socket_timeout_s": 10.0},
            "model": {"path": str(self.model_dir), "task": "reverse", "warm_steps": 0},
            "engine": {"port": self.engine_port, "num_threads": 1, "max_batch_size": 32, "weight_version": "0"},
            "proxy": {"port": self.proxy_port, "engines": [self.engine_url or "http://127.0.0.1:9"],
                      "partial_rollout": True, "max_partial_rollout_preempts": 2, "session_ttl_s": 120.0},
            "prompt_buffer": {"dataset": str(self.dataset), "n_samples": 2, "epochs": 1, "poll_s": 0.1},
            "pacing": {"max_versions_ahead": None, "max_in_flight_groups": 6},
            "rollout": {"proxy_url": self.proxy_url, "concurrency": 2, "grace_period_s": 5.0, "max_new_tokens": 6,
                        "claim_idle_ms": 2500, "block_ms": 200, "trajectory_timeout_s": 30.0, "max_retries": 2},
            "staleness": {"keep_versions": 0},
            "collector": {"claim_idle_ms": 2500, "block_ms": 200, "trim_interval_s": 0, "control_poll_s": 0.5,
                          "metrics_interval_s": 2.0},
            "train": {"groups_per_batch": 1, "max_steps": None, "checkpoint_dir": str(self.root / "ckpt"),
                      "keep_checkpoints": 1000, "claim_idle_ms": 2500, "block_ms": 200, "consumer": "trainer"},
            "eval": {"every_versions": 0},
            "ops": {"heartbeat_ttl_s": 3.0, "metrics_port_base": None},
        }
        return merge_layers(base, chaos, extra or {})

    def write_config(self, extra: dict[str, Any] | None = None, name: str = "config.yaml") -> Path:
        path = self.root / name
        path.write_text(yaml.safe_dump(self.config_data(extra), sort_keys=False))
        return path

    @property
    def max_retries(self) -> int:
        return int(self.config_data(self.overrides)["rollout"]["max_retries"])

    # --- Redis --------------------------------------------------------------------------------

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.redis.port, password=self.password, socket_timeout=10,
                           socket_connect_timeout=5)

    def stats(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.keys.stats).items()}

    def pending(self, stream: str, consumer: str | None = None) -> int:
        key, group = getattr(self.keys, stream), STREAM_GROUPS[stream]
        try:
            if consumer is None:
                return int(self.r.xpending(key, group)["pending"])
            return len(self.r.xpending_range(key, group, min="-", max="+", count=10_000, consumername=consumer))
        except redis.ResponseError:
            return 0

    def restart_redis(self, wait_dead: bool = True) -> None:
        """SIGKILL redis-server (no shutdown save) and start it again on the same port and directory."""
        self.faults.append("redis:SIGKILL+restart")
        self.redis.kill()
        self.redis.start()

    # --- processes ----------------------------------------------------------------------------

    def start(self, service: str, name: str | None = None, args: Iterable[str] = (), env: dict[str, str] | None = None,
              config: Path | None = None) -> Proc:
        name = name or service
        assert name not in self.procs or not self.procs[name].alive(), f"{name} is already running"
        log = self.root / "logs" / f"{name}.log"
        full_env = {**clean_env(), "DRESSAGE_CONSUMER": name, **(env or {})}
        if self.users is not None and service in self.users:
            full_env.setdefault("REDIS_URL", f"redis://{service}@127.0.0.1:{self.redis.port}/0")
            full_env.setdefault("REDIS_PASSWORD", self.users[service])
        if self.password is not None:
            full_env.setdefault("REDIS_PASSWORD", self.password)
        argv = [service, "--config", str(config or self.config_path), *args]
        popen: Started
        if service in launching.TORCH_SERVICES:  # forked: torch imported once per test process
            popen = launching.start("services.cli", argv, full_env, REPO, log)
        else:
            with log.open("ab") as out:
                popen = subprocess.Popen([sys.executable, "-m", "services.cli", *argv],
                                         cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT)
        proc = self.procs[name] = Proc(name, service, popen, log)
        return proc

    def start_pipeline(self, workers: int = 2, proxy: bool = True, trainer: bool = True,
                       up_timeout: float = 90) -> None:
        """proxy, trainer, collector, prompt-buffer, then (once the proxy answers) ``workers`` rollout
        workers w1..wN; returns when every one of them is up (each within ``up_timeout`` s)."""
        if self.own_engine:
            self.start("engine")
        if proxy:
            self.start("proxy")
        if trainer:
            self.start("trainer")
        self.start("group-collector", "collector")
        self.start("prompt-buffer")
        if proxy:
            self.wait_up("proxy", *(["engine"] if self.own_engine else []), timeout=up_timeout)
        for i in range(1, workers + 1):
            self.start("rollout-worker", f"w{i}")
        self.wait_up(*self.procs, timeout=up_timeout)

    def wait_up(self, *names: str, timeout: float = 90) -> None:
        for name in names:
            p = self.procs[name]
            if p.service == "proxy":
                self.wait_http(f"{self.proxy_url}/health", p, timeout)
            elif p.service == "engine":
                self.wait_http(f"http://127.0.0.1:{self.engine_port}/health", p, timeout)
            elif p.service in HEALTH:
                def beating(p: Proc = p) -> bool:
                    return bool(self.r.exists(self.keys.health(HEALTH[p.service], p.name))) or not p.alive()

                wait_until(beating, timeout, f"{p.name} heartbeat", p.tail)
                assert p.alive(), f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}"

    def wait_http(self, url: str, proc: Proc | None, timeout: float = 90) -> None:
        def ok() -> bool:
            assert proc is None or proc.alive(), f"{proc.name} exited:\n{proc.tail()}"
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(ok, timeout, url, proc.tail if proc else lambda: "", period=0.2)

    def signal(self, name: str, sig: int) -> None:
        self.faults.append(f"{name}:{signal.Signals(sig).name}")
        self.procs[name].send(sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(10)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)

    def terminate(self, name: str, timeout: float = 30) -> int:
        """SIGTERM and wait for the exit code."""
        self.procs[name].send(signal.SIGTERM)
        return self.procs[name].wait(timeout)

    def restart_dead(self) -> list[str]:
        """Start again (same name) every service that is not running; returns their names."""
        dead = [n for n, p in self.procs.items() if not p.alive()]
        for n in dead:
            self.start(self.procs[n].service, n)
        return dead

    def assert_alive(self, *names: str) -> None:
        for n in names or tuple(self.procs):
            assert self.procs[n].alive(), f"{n} died (rc={self.procs[n].popen.returncode}):\n{self.procs[n].tail()}"

    def logs(self, names: Iterable[str] | None = None, chars: int = 1500) -> str:
        return "\n".join(f"----- {n}\n{self.procs[n].tail(chars)}" for n in (names or self.procs))

    # --- quiescence and the verdict -------------------------------------------------------------

    def settled(self, expected: int) -> bool:
        """Every produced group has an outcome (trained or dead-lettered) and all were produced."""
        s = self.stats()
        produced = s.get("groups_produced", 0)
        return produced >= expected and s.get("groups_trained", 0) + s.get("groups_dead_lettered", 0) >= produced

    def wait_settled(self, expected: int | None = None, timeout: float = 90) -> None:
        expected = self.rows if expected is None else expected
        wait_until(lambda: self.settled(expected), timeout, f"{expected} groups to settle",
                   lambda: f"stats={self.stats()}\n{self.verdict().render()}\n{self.logs()}", period=0.25)

    def verdict(self, allow_trimmed: bool = False) -> History:
        """The recorded history plus everything Redis holds now (live and missing entries marked)."""
        with self.recorder.lock:  # a snapshot: the recorder goes on feeding its own copy
            h = collect(self.r, self.keys, into=self.recorder.history, max_retries=self.max_retries,
                        allow_trimmed=allow_trimmed)
            return copy.deepcopy(h)

    def explain(self) -> str:
        return f"{self.verdict().render()}\nstats={self.stats()}\nfaults={self.faults}\n{self.logs()}"

    def figures(self) -> dict[str, Any]:
        s = self.verdict().summary()
        return {"faults": len(self.faults), "produced": s["produced"], "trained": s["trained"],
                "dead_lettered": s["dead_lettered"], "reenqueued": s["reenqueued"], "lost": s["lost"],
                "duplicated": s["duplicated"]}

    def record_figures(self, test: str, **extra: Any) -> None:
        """Append this run's figures to ``$CHAOS_FIGURES`` (JSON lines) when set, for docs/reliability.md."""
        record_figures(test, {**self.figures(), **extra})

    def close(self) -> None:
        for p in self.procs.values():
            if p.alive():
                p.send(signal.SIGCONT)
                p.send(signal.SIGKILL)
                p.wait(10)
        self.recorder.stop()
        self.r.close()
        self.redis.cleanup()


def record_figures(test: str, figures: dict[str, Any]) -> None:
    """Append ``figures`` to ``$CHAOS_FIGURES`` (JSON lines) when set (also after a cluster is closed)."""
    path = os.environ.get("CHAOS_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **figures}, default=str) + "\n")


@dataclass
class Fault:
    """One injected fault: what, when (monotonic), and when the victim was let back (restart/SIGCONT)."""

    name: str  # process name, or "redis"
    kind: str  # "SIGKILL" (then restarted), "SIGSTOP" (then SIGCONT), "redis:SIGKILL" (AOF restart)
    at: float
    back_at: float | None = None


class ChaosDriver:
    """Every ``period`` s a seeded random fault on a random service of ``names``: SIGKILL and a restart
    after ``down_s`` s, or (with probability ``stop_share``) SIGSTOP and SIGCONT after ``down_s`` s.
    With ``redis_at`` set, Redis itself is SIGKILLed and restarted (same AOF directory) once, at the
    first fault due after ``redis_at`` seconds. The schedule is a pure function of ``seed``."""

    def __init__(self, cluster: Cluster, names: list[str], period: tuple[float, float], down_s: float,
                 seed: int = 0, stop_share: float = 0.0, redis_at: float | None = None) -> None:
        self.cluster, self.names, self.period, self.down_s = cluster, names, period, down_s
        self.stop_share, self.redis_at = stop_share, redis_at
        self.rng = random.Random(seed)
        self.kills: list[str] = []
        self.faults: list[Fault] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-driver", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> ChaosDriver:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            while not self._stop.wait(self.rng.uniform(*self.period)):
                name = self.rng.choice(self.names)
                stop = self.rng.random() < self.stop_share
                if self.redis_at is not None and time.monotonic() - t0 >= self.redis_at:
                    self.redis_at = None
                    fault = Fault("redis", "redis:SIGKILL", time.monotonic())
                    self.faults.append(fault)
                    self.cluster.restart_redis()
                    fault.back_at = time.monotonic()
                    continue
                proc = self.cluster.procs[name]
                fault = Fault(name, "SIGSTOP" if stop else "SIGKILL", time.monotonic())
                self.faults.append(fault)
                if stop:
                    self.cluster.signal(name, signal.SIGSTOP)
                else:
                    self.cluster.kill(name)
                    self.kills.append(name)
                if self._stop.wait(self.down_s):
                    if stop:
                        self.cluster.signal(name, signal.SIGCONT)
                    break
                if stop:
                    self.cluster.signal(name, signal.SIGCONT)
                else:
                    self.cluster.start(proc.service, name)
                fault.back_at = time.monotonic()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise self.error
