"""Proxy + real engine on loopback: the openai client end to end, auth / body / validation / capacity
paths, a dead engine, session TTL, and ``dressage proxy`` as a real process (SIGTERM, no secret in logs)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis
import yaml
from openai.types.chat import ChatCompletionMessageParam
from proxy_support import REPO, EngineProc, ProxyThread, free_port, start_engine, wait_healthy
from pydantic import SecretStr
from waits import wait_for

from shared.config import ProxyConfig
from shared.keys import Keys
from shared.redisproc import RedisProcess

KEY = "proxy-test-key-0123456789"
OPERATOR_KEY = "operator-key-for-tests-0123"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProc]:
    eng = start_engine(tmp_path_factory.mktemp("proxy-http"), max_batch_size=8, second_checkpoint=False)
    yield eng
    eng.stop()


def test_openai_client_end_to_end_through_a_session_scoped_base_url(engine: EngineProc) -> None:
    with ProxyThread(ProxyConfig(engines=[engine.url], api_key=SecretStr(KEY)), engine.model_dir) as p:
        client = openai.OpenAI(base_url=f"{p.url}/s/agent-7/v1", api_key=KEY, max_retries=0)
        first = client.chat.completions.create(model="policy", messages=MSG, max_tokens=12)
        reply = first.choices[0].message.content or ""
        assert first.object == "chat.completion" and 1 <= (first.usage.completion_tokens if first.usage else 0) <= 12
        msgs: list[ChatCompletionMessageParam] = [
            *MSG, {"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
        stream = client.chat.completions.create(model="policy", messages=msgs, max_tokens=12, stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        session = httpx.get(f"{p.url}/v1/sessions/agent-7", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert session["turns"] == 2 and session["num_segments"] == 1  # the 2nd prompt extends the 1st turn
        sample = session["samples"][0]
        assert sample["traj_id"] == "agent-7" and set(sample["token_versions"]) == {"-1", "a"}
        assert first.usage is not None  # implied by the 1 <= completion_tokens check above
        n_second = sum(sample["loss_mask"]) - first.usage.completion_tokens
        assert 1 <= n_second <= 12 and len(streamed) <= n_second
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{p.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="policy", messages=MSG)


def test_bad_input_and_over_capacity_paths_on_a_real_server(engine: EngineProc) -> None:
    cfg = ProxyConfig(engines=[engine.url], api_key=SecretStr(KEY), operator_key=SecretStr(OPERATOR_KEY),
                      max_body_bytes=2048, max_tokens_limit=1000, max_messages=8, max_concurrency=1)
    auth = {"Authorization": f"Bearer {KEY}"}
    with ProxyThread(cfg, engine.model_dir) as p, ThreadPoolExecutor(2) as pool:
        assert httpx.post(f"{p.url}/v1/chat/completions", json={"messages": MSG}).status_code == 401
        assert httpx.get(f"{p.url}/health").status_code == 200
        big = {"messages": [{"role": "user", "content": "x" * 4096}]}
        r = httpx.post(f"{p.url}/v1/chat/completions", json=big, headers=auth)
        assert r.status_code == 413 and r.json()["detail"]["error"] == "body_too_large"
        r = httpx.post(f"{p.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 5000}, headers=auth)
        assert r.status_code == 422 and r.json()["detail"]["field"] == "max_tokens"
        r = httpx.get(f"{p.url}/v1/sessions/never-seen", headers=auth)
        assert r.status_code == 404 and r.json()["detail"]["error"] == "session_not_found"
        slow = pool.submit(httpx.post, f"{p.url}/v1/generate", headers=auth, timeout=60,
                           json={"input_ids": [5], "sampling_params": {"max_new_tokens": 800, "ignore_eos": True}})
        _wait_in_flight(p, {"Authorization": f"Bearer {OPERATOR_KEY}"})  # rollout state: operator scope
        r = httpx.post(f"{p.url}/v1/chat/completions", json={"messages": MSG}, headers=auth)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["detail"]["error"] == "over_capacity"
        assert slow.result().status_code == 200
        assert "Traceback" not in r.text


def _wait_in_flight(p: ProxyThread, auth: dict[str, str]) -> None:
    wait_for(lambda: httpx.get(f"{p.url}/v1/rollout/state", headers=auth).json()["in_flight_requests"] >= 1,
             20, "a request in flight", period=0.01)


def test_dead_engine_is_a_fast_503_not_a_hang(engine: EngineProc) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with ProxyThread(ProxyConfig(engines=[dead], connect_timeout_s=1.0), engine.model_dir) as p:
        t0 = time.monotonic()
        r = httpx.post(f"{p.url}/v1/chat/completions", json={"messages": MSG}, timeout=30)
        assert r.status_code == 503 and r.json()["detail"]["error"] == "upstream_unavailable"
        assert time.monotonic() - t0 < 5


def test_idle_sessions_expire_after_the_ttl(engine: EngineProc) -> None:
    with ProxyThread(ProxyConfig(engines=[engine.url], session_ttl_s=0.4), engine.model_dir) as p:
        r = httpx.post(f"{p.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 4},
                       headers={"X-Session-Id": "short-lived"}, timeout=30)
        assert r.status_code == 200
        assert httpx.get(f"{p.url}/v1/sessions/short-lived").status_code == 200
        wait_for(lambda: httpx.get(f"{p.url}/v1/sessions/short-lived").status_code == 404, 10,
                 "the idle session expired after its 0.4 s TTL")
        assert p.state()["sessions"] == 0


def test_proxy_process_serves_heartbeats_and_stops_cleanly_without_logging_the_key(
        engine: EngineProc, redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys,
        tmp_path: Path) -> None:
    port = free_port()
    cfg = {"redis": {"url": redis_server.url, "prefix": keys.prefix}, "model": {"path": str(engine.model_dir)},
           "proxy": {"port": port, "engines": [engine.url], "api_key": KEY, "operator_key": OPERATOR_KEY}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    log_path = tmp_path / "proxy.log"
    proc = subprocess.Popen([sys.executable, "-m", "services.proxy", "--config", str(tmp_path / "cfg.yaml")],
                            cwd=REPO, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 4}, headers=auth,
                          timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/rollout/state", headers={"Authorization": "Bearer nope"}).status_code == 401
        deadline = time.monotonic() + 10
        while not redis_client.keys(keys.health("proxy", "*")):
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/rollout/state", headers=auth).status_code == 403  # agent key: no operator scope
        operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        assert httpx.get(f"{url}/v1/rollout/state", headers=operator).json()["following_versions"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
    assert code == 0, log_path.read_text()
    assert KEY not in log_path.read_text() and OPERATOR_KEY not in log_path.read_text()
