"""One proxy over three real CPU engines (issue 13, item 2): load-spread sticky sessions, an engine
SIGKILLed mid-generation, a version published while it is down, and its rejoin through the catch-up.

* sessions spread over all three engines (least loaded first) and a session's next turn stays on
  its engine;
* SIGKILL of an engine while it generates: every in-flight request still completes with all its
  tokens — its chunk resumed on another engine from the tokens the proxy holds — and nothing hangs;
* the weight update ("b") published while it is down reaches the two live engines; the engine is
  restarted (serving "a"), the proxy's probe sees it, the catch-up loads "b" into it, and only then
  do new sessions go to it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxy_support import REPO, ProxyThread, free_port, wait_healthy
from reference_model import save_perturbed

from shared.config import ProxyConfig
from shared.keys import Keys
from shared.modeling import ModelSpec, build_model_dir
from shared.redisproc import RedisProcess
from shared.schemas import WeightVersion
from shared.versionbus import publish_version

N = 300  # tokens per request: long enough to be cut by the kill on a loaded machine


class Engines:
    """Three engine processes on fixed ports over one model directory; any of them restartable."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model, self.second = root / "model", root / "ckpt" / "v00000001"  # under the engines' checkpoint root
        build_model_dir(self.model, "reverse", ModelSpec(max_position_embeddings=2048), seed=0)
        save_perturbed(self.model, self.second)
        self.ports = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes]] = [self._start(i) for i in range(3)]
        for i in range(3):
            wait_healthy(self.url(i), self.procs[i], self.root / f"engine{i}.log")

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def _start(self, i: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "DRESSAGE_ENGINE_NUM_THREADS": "1", "DRESSAGE_ENGINE_MAX_BATCH_SIZE": "16",
               "DRESSAGE_TRAIN_CHECKPOINT_DIR": str(self.root / "ckpt")}
        return subprocess.Popen([sys.executable, "-m", "services.engine", "--model-path", str(self.model),
                                 "--port", str(self.ports[i]), "--weight-version", "a"], cwd=REPO, env=env,
                                stdout=(self.root / f"engine{i}.log").open("ab"), stderr=subprocess.STDOUT)

    def kill(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(10)

    def restart(self, i: int) -> None:
        self.procs[i] = self._start(i)
        wait_healthy(self.url(i), self.procs[i], self.root / f"engine{i}.log")

    def info(self, i: int) -> dict[str, Any]:
        return httpx.get(f"{self.url(i)}/get_server_info", timeout=10).json()

    def version(self, i: int) -> str:
        return str(httpx.get(f"{self.url(i)}/get_weight_version", timeout=10).json()["weight_version"])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    e = Engines(tmp_path_factory.mktemp("three-engines"))
    yield e
    e.close()


def generate(url: str, session: str, n: int = N) -> httpx.Response:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}
    return httpx.post(f"{url}/v1/generate", json=body, headers={"X-Session-Id": session}, timeout=180)


def in_flight(state: dict[str, Any]) -> dict[str, int]:
    return {name: e["in_flight"] for name, e in state["engines"].items()}


def test_three_engines_spread_survive_a_sigkill_and_the_engine_rejoins_caught_up(
        engines: Engines, redis_server: RedisProcess, keys: Keys, tmp_path: Path) -> None:
    cfg = ProxyConfig(engines=[engines.url(i) for i in range(3)], partial_rollout=True, load_poll_s=0.2,
                      engine_check_s=0.5, engine_sync_wait_s=60, pause_timeout_s=10, connect_timeout_s=1.0)
    with ProxyThread(cfg, engines.model, redis_server.port, keys) as p, ThreadPoolExecutor(8) as pool:
        # 1. Six concurrent sessions: the least-loaded pick puts two on each engine.
        futures = {f"s{i}": pool.submit(generate, p.url, f"s{i}") for i in range(6)}
        st = p.wait_state(lambda s: sum(in_flight(s).values()) == 6, timeout=60)
        assert sorted(in_flight(st).values()) == [2, 2, 2], st["engines"]

        # 2. SIGKILL engine-1 while it generates for its two sessions.
        victim = 1
        start = engines.info(victim)["generated_tokens"]
        deadline = time.monotonic() + 60
        while engines.info(victim)["generated_tokens"] - start < 10:
            assert time.monotonic() < deadline, "engine-1 generated nothing"
            time.sleep(0.01)
        engines.kill(victim)
        results = {sid: f.result(timeout=180) for sid, f in futures.items()}
        for sid, r in results.items():
            assert r.status_code == 200, (sid, r.text)
            body = r.json()
            assert len(body["output_ids"]) == N, sid  # every token, none lost, none twice
            chunks = body["meta_info"]["partial_rollout_chunks"]
            assert sum(c["num_output_tokens"] for c in chunks) == N
        lost = [sid for sid, r in results.items() if any(c.get("engine_lost") for c in
                                                         r.json()["meta_info"]["partial_rollout_chunks"])]
        assert len(lost) == 2, lost  # exactly the victim's two sessions moved, the others never did
        st = p.state()
        assert st["engines_down"] == [engines.url(victim)] and st["failovers"] == 2

        # 3. Stickiness: a session's next request goes where its last chunk ran.
        keep = next(sid for sid in results if sid not in lost)
        before = {i: engines.info(i)["generated_tokens"] for i in (0, 2)}
        assert generate(p.url, keep, n=8).status_code == 200
        moved = [i for i in (0, 2) if engines.info(i)["generated_tokens"] > before[i]]
        assert len(moved) == 1

        # 4. A version published while engine-1 is down reaches the live engines only.
        r = redis_server_client(redis_server)
        publish_version(r, keys, WeightVersion(version="b", path=str(engines.second), step=1,
                                               published_at=time.time()))
        p.wait_state(lambda s: s["target_version"] == "b", timeout=60)
        assert engines.version(0) == engines.version(2) == "b"

        # 5. Restarted (serving "a"), engine-1 is probed, caught up to "b", then routable again.
        engines.restart(victim)
        st = p.wait_state(lambda s: not s["engines_down"] and not s["engines_behind"], timeout=60)
        assert engines.version(victim) == "b"
        fresh = [pool.submit(generate, p.url, f"t{i}") for i in range(6)]
        st = p.wait_state(lambda s: sum(in_flight(s).values()) == 6, timeout=60)
        assert sorted(in_flight(st).values()) == [2, 2, 2], st["engines"]  # engine-1 takes its share again
        assert all(f.result(timeout=180).status_code == 200 for f in fresh)
        versions = {v for f in fresh for v in f.result().json()["meta_info"]["output_token_versions"]}
        assert versions == {"b"}


def redis_server_client(server: RedisProcess) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=server.port)
