"""Chaos fixtures: one tiny model and one engine process per session, a fresh ``Cluster`` per test."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from harness import REPO, Cluster, Engine, build_model, clean_env, wait_until

from shared.redisproc import free_port


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("chaos-model") / "tiny")


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Engine]:
    """The real CPU engine, shared: it holds no Redis state, and each cluster's trainer re-publishes "0"."""
    root = tmp_path_factory.mktemp("chaos-engine")
    port = free_port()
    cfg = root / "engine.yaml"
    # The engine loads only checkpoints under train.checkpoint_dir (or its model): every cluster's
    # checkpoints live under the session's base temp dir.
    cfg.write_text(yaml.safe_dump({"model": {"path": str(model_dir)},
                                   "train": {"checkpoint_dir": str(tmp_path_factory.getbasetemp())},
                                   "engine": {"port": port, "num_threads": 1, "max_batch_size": 32,
                                              "max_queue": 100_000, "weight_version": "0"}}))
    log = root / "engine.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "engine", "--config", str(cfg)], cwd=REPO,
                                env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
    eng = Engine(f"http://127.0.0.1:{port}", proc, log)

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(f"{eng.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 120, "the engine", log.read_text, period=0.2)
        yield eng
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def make_cluster(tmp_path: Path, model_dir: Path, engine: Engine) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(name: str = "c", **kw: Any) -> Cluster:
        c = Cluster(tmp_path / name, model_dir, engine.url, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here is a ``chaos`` test (``-m "not chaos"`` skips the tier); the soak is also ``slow``."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.chaos)
            if Path(str(item.fspath)).name == "test_chaos_soak.py":
                item.add_marker(pytest.mark.slow)
