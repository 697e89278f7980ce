"""What ``dressage up`` runs: the process list of a local deployment, computed from config + options.

Pure apart from reading nothing: given a validated config and the run's choices (Redis URL, prefix,
run directory, ports, worker count) it returns ``ProcessSpec``s. Every child gets the same
``--config`` file plus env overrides (``DRESSAGE_<SECTION>_<KEY>``) that pin it to this run:
Redis URL and prefix, checkpoint directory, engine/proxy ports, the eval queue, ``max_steps``.
Tiers give the start order (and reverse stop order): engine, proxy, consumers, prompt-buffer, workers.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from services.cli import COMMANDS
from shared.config import DressageConfig
from shared.telemetry import local_replica
from tools.deploy.prefork import TORCH_SERVICES
from tools.deploy.supervisor import ProcessSpec

# Start tiers; stop runs them in reverse (workers first, the engine last). TIER_AFTER: a job started
# after the trainer's last step (deferred evaluation), alone in its tier so that it can be stopped alone.
TIER_ENGINE, TIER_PROXY, TIER_CONSUMERS, TIER_SOURCE, TIER_WORKERS, TIER_AFTER = range(6)


@dataclass(frozen=True)
class RunChoices:
    config_path: str
    run_dir: Path
    redis_url: str
    prefix: str
    workers: int
    engine_port: int
    proxy_port: int
    max_steps: int | None = None
    python: str = sys.executable
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. REDIS_PASSWORD for an external Redis


def run_prefix(base: str, run_name: str) -> str:
    """A Redis prefix private to one run, valid for ``redis.prefix`` (letters, digits, ``_.-``)."""
    clean = re.sub(r"[^A-Za-z0-9_.\-]", "-", run_name).strip("-") or "run"
    return f"{base}-{clean}"[:64]


def public_url(url: str) -> str:
    """A URL without credentials, safe to write to disk or print."""
    parts = urlsplit(url)
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def http_ok(url: str, timeout: float = 1.0) -> Callable[[], bool]:
    """A readiness probe: true when GET ``url`` answers 2xx."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback URL we built
                status: int = resp.status
                return 200 <= status < 300
        except (urllib.error.URLError, OSError, ValueError):
            return False

    return probe


def common_env(cfg: DressageConfig, c: RunChoices) -> dict[str, str]:
    engine_url = f"http://{cfg.engine.host}:{c.engine_port}"
    env = {
        "REDIS_URL": c.redis_url,
        "DRESSAGE_REDIS_URL": c.redis_url,  # wins over a stray DRESSAGE_REDIS_URL in the shell
        "DRESSAGE_REDIS_PREFIX": c.prefix,
        "DRESSAGE_ENGINE_PORT": str(c.engine_port),
        "DRESSAGE_PROXY_PORT": str(c.proxy_port),
        "DRESSAGE_PROXY_ENGINES": json.dumps([engine_url]),
        "DRESSAGE_ROLLOUT_PROXY_URL": f"http://{cfg.proxy.host}:{c.proxy_port}",
        "DRESSAGE_TRAIN_CHECKPOINT_DIR": str(c.run_dir / "checkpoints"),
        "DRESSAGE_EVAL_QUEUE": f"{c.prefix}-eval",  # rq queues are global: one per run
        "TOKENIZERS_PARALLELISM": "false",
        **c.extra_env,
    }
    if c.max_steps is not None:
        env["DRESSAGE_TRAIN_MAX_STEPS"] = str(c.max_steps)
    return env


def prefork_module(cfg: DressageConfig, service: str) -> str | None:
    """The module the pre-imported launcher loads for ``service`` (``ops.prefork``), or None to exec it: only the
    services that load torch, and only on the CPU -- CUDA does not survive a fork, so a GPU service starts fresh."""
    devices = {"trainer": cfg.train.device, "engine": cfg.engine.device, "eval-worker": cfg.eval.device}
    assert set(devices) == set(TORCH_SERVICES)
    if not cfg.ops.prefork or devices.get(service) != "cpu":
        return None
    return COMMANDS[service][0]


def _factory(cfg: DressageConfig, c: RunChoices) -> Callable[..., ProcessSpec]:
    """``proc(service, tier, name=None, extra=None, **ProcessSpec fields)``: one service of this run."""
    env = common_env(cfg, c)
    logs = c.run_dir / "logs"

    def proc(service: str, tier: int, name: str | None = None, extra: dict[str, str] | None = None,
             args: tuple[str, ...] = (), **kw: object) -> ProcessSpec:
        name = name or service
        argv = [c.python, "-m", "services", service, "--config", c.config_path, *args]
        # A stable consumer name per process: a restarted process re-reads its own pending entries.
        penv = {**env, "DRESSAGE_CONSUMER": f"{socket.gethostname()}-{name}", **(extra or {})}
        threads = cfg.ops.service_threads.get(service)
        if threads is not None:  # torch reads these at import: intra-op threads of this process
            penv.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
        return ProcessSpec(name=name, argv=argv, env=penv, log_path=logs / f"{name}.log", tier=tier,
                           nice=cfg.ops.service_nice.get(service, 0), prefork=prefork_module(cfg, service),
                           sched=cfg.ops.service_sched.get(service), **kw)  # type: ignore[arg-type]  # kw holds ProcessSpec keyword fields only

    return proc


def build_plan(cfg: DressageConfig, c: RunChoices) -> list[ProcessSpec]:
    """Every service of a local deployment as a supervised process, in start order."""
    proc = _factory(cfg, c)
    ready_timeout = cfg.ops.ready_timeout_s
    specs = [
        proc("engine", TIER_ENGINE, ready=http_ok(f"http://{cfg.engine.host}:{c.engine_port}/health"),
             ready_timeout_s=ready_timeout),
        proc("proxy", TIER_PROXY, ready=http_ok(f"http://{cfg.proxy.host}:{c.proxy_port}/health"),
             ready_timeout_s=ready_timeout),
        proc("trainer", TIER_CONSUMERS, ends_run=True),
        proc("group-collector", TIER_CONSUMERS),
    ]
    if cfg.window_controller.enabled:  # the adaptive window: its failure leaves the last window in force
        specs.append(proc("window-controller", TIER_CONSUMERS, optional=True))
    if cfg.eval.live:
        specs.append(proc("eval-worker", TIER_CONSUMERS, optional=True))  # its failure never ends the run
    specs.append(proc("prompt-buffer", TIER_SOURCE, may_finish=True))
    for i in range(1, c.workers + 1):
        # The worker's Prometheus port is metrics_port_base + 2 + replica; on one host replicas 0..2
        # would collide with the collector (+3), trainer (+4) and eval (+5): local_replica starts past them.
        specs.append(proc("rollout-worker", TIER_WORKERS, name=f"rollout-worker-{i}",
                          extra={"DRESSAGE_REPLICA": str(local_replica(i))}))
    return specs


def deferred_evaluation(cfg: DressageConfig, c: RunChoices) -> ProcessSpec | None:
    """With ``eval.defer``: the eval worker that ``dressage up`` runs in burst mode after the trainer's
    last step (it runs the queued jobs, then exits); None when evaluation is off or live."""
    if not cfg.eval.deferred:
        return None
    return _factory(cfg, c)("eval-worker", TIER_AFTER, args=("--burst",))
