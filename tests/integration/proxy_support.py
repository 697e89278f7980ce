"""Helpers for the proxy's integration tests: a real engine process and proxies on loopback.

``start_engine`` builds a tiny model (and a perturbed second checkpoint) with ``shared.modeling``
and runs ``python -m services.engine`` on a free port. ``ProxyThread`` serves the proxy app
with uvicorn in a background thread (its own event loop), so a test can run several proxy
configurations against one engine; one test also runs the proxy as a process via ``main``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx
import redis
import torch
import uvicorn
from paths import REPO
from reference_model import save_perturbed
from waits import wait_for

from services.proxy.app import build_app
from services.proxy.runtime import ProxyRuntime
from shared.config import ProxyConfig
from shared.keys import Keys
from shared.modeling import ModelSpec, build_model_dir, load_tokenizer
from shared.redisproc import free_port


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, log_path: Path | None, timeout: float = 90) -> None:
    wait_for(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, timeout, f"{url} healthy",
             why=lambda: log_path.read_text() if log_path else "", process=proc, period=0.1,
             ignore=(httpx.TransportError,))


@dataclass
class EngineProc:
    url: str
    model_dir: Path  # checkpoint served as version "a"
    second_dir: Path  # perturbed checkpoint, published as version "b"
    proc: subprocess.Popen[bytes]
    log_path: Path

    def reset(self, version: str = "a") -> None:
        """Serve the first checkpoint again under ``version`` (tests share one engine)."""
        r = httpx.post(f"{self.url}/update_weights_from_disk",
                       json={"model_path": str(self.model_dir), "weight_version": version}, timeout=60)
        assert r.status_code == 200, r.text

    def info(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/get_server_info", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def start_engine(root: Path, max_batch_size: int = 16, second_checkpoint: bool = True) -> EngineProc:
    torch.set_num_threads(1)
    model_dir, second = root / "model", root / "step-b"
    build_model_dir(model_dir, "reverse", ModelSpec(max_position_embeddings=2048), seed=0)
    if second_checkpoint:
        save_perturbed(model_dir, second)
    port = free_port()
    env = {**os.environ, "DRESSAGE_ENGINE_NUM_THREADS": "1", "DRESSAGE_ENGINE_MAX_NEW_TOKENS_LIMIT": "1800",
           "DRESSAGE_ENGINE_MAX_BATCH_SIZE": str(max_batch_size),
           # The engine loads weights only from under its checkpoint root (or its own model dir).
           "DRESSAGE_TRAIN_CHECKPOINT_DIR": str(root)}
    log_path = root / "engine.log"
    proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--model-path", str(model_dir),
                             "--port", str(port), "--weight-version", "a"], cwd=REPO, env=env,
                            stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log_path)
    return EngineProc(url, model_dir, second, proc, log_path)


class AppThread:
    """An ASGI app under uvicorn in a daemon thread (its own event loop); ``url`` once started."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()  # a given port: the same server started again
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)


class ProxyThread(AppThread):
    """The proxy app (over its own runtime) under uvicorn in a daemon thread."""

    def __init__(self, cfg: ProxyConfig, tokenizer_dir: Path, redis_port: int | None = None,
                 keys: Keys | None = None) -> None:
        factory = (lambda: redis.Redis(host="127.0.0.1", port=redis_port)) if redis_port else None
        self.runtime = ProxyRuntime(cfg, load_tokenizer(tokenizer_dir), redis_factory=factory, keys=keys,
                                    heartbeat_ttl_s=5.0)
        super().__init__(build_app(self.runtime))

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/rollout/state", timeout=10).json()

    def wait_state(self, predicate: Any, timeout: float = 20) -> dict[str, Any]:
        def matched() -> dict[str, Any] | None:
            st = self.state()
            return st if predicate(st) else None

        state: dict[str, Any] = wait_for(matched, timeout, "proxy state", why=lambda: str(self.state()),
                                         period=0.01)
        return state
