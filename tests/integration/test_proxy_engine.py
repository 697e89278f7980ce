"""Proxy + real engine on loopback, weight versions published on a private Redis: partial rollout
across an update, the span limit's exact 502, non-partial rejections, pause keeping partial tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
from proxy_support import EngineProc, ProxyThread, start_engine
from waits import wait_for

from shared.config import ProxyConfig
from shared.keys import Keys
from shared.redisproc import RedisProcess
from shared.schemas import WeightVersion
from shared.versionbus import publish_version

LONG = 1500  # tokens: long enough to be interrupted after a few dozen, even on a fast engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProc]:
    eng = start_engine(tmp_path_factory.mktemp("proxy-engine"))
    yield eng
    eng.stop()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as p:
        yield p


def proxy(engine: EngineProc, redis_server: RedisProcess, keys: Keys, **cfg: Any) -> ProxyThread:
    engine.reset("a")
    config = ProxyConfig(engines=[engine.url], pause_timeout_s=10, **cfg)
    return ProxyThread(config, engine.model_dir, redis_server.port, keys)


def long_request(pool: ThreadPoolExecutor, url: str, session: str, n: int = LONG,
                 headers: dict[str, str] | None = None) -> Future[httpx.Response]:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}
    return pool.submit(httpx.post, f"{url}/v1/generate", json=body,
                       headers={"X-Session-Id": session, **(headers or {})}, timeout=120)


def wait_tokens(p: ProxyThread, engine: EngineProc, n: int) -> None:
    """Until the in-flight request of ``p`` has produced at least ``n`` tokens on the engine."""
    p.wait_state(lambda s: s["active_generations"] == 1)
    start = engine.info()["generated_tokens"]
    wait_for(lambda: engine.info()["generated_tokens"] - start >= n, 20, f"{n} tokens generated")


def publish_b_midway(p: ProxyThread, engine: EngineProc, r: redis.Redis, keys: Keys) -> None:
    """Once the engine produced some tokens of the in-flight request, publish version "b"."""
    wait_tokens(p, engine, 20)
    publish_version(r, keys, WeightVersion(version="b", path=str(engine.second_dir), step=1, published_at=time.time()))


def a_then_b(r: httpx.Response) -> tuple[dict[str, Any], int]:
    """The response's meta_info and its count of "a" tokens: LONG tokens, some of "a", then the rest of "b"."""
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    versions = meta["output_token_versions"]
    k = versions.count("a")
    assert len(r.json()["output_ids"]) == LONG and 0 < k < LONG
    assert versions == ["a"] * k + ["b"] * (LONG - k)  # one response, two versions, in order
    return meta, k


def test_generation_interrupted_by_a_published_version_resumes_on_the_new_weights(
        engine: EngineProc, redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys,
        pool: ThreadPoolExecutor) -> None:
    with proxy(engine, redis_server, keys, partial_rollout=True) as p:
        fut = long_request(pool, p.url, "traj-ab")
        publish_b_midway(p, engine, redis_client, keys)
        meta, k = a_then_b(fut.result())
        versions = meta["output_token_versions"]
        assert meta["preempts"] == 1 and meta["partial_rollout_chunks"][0]["preempted"]
        assert meta["partial_rollout_chunks"][0]["num_output_tokens"] == k
        (sample,) = httpx.get(f"{p.url}/v1/sessions/traj-ab").json()["samples"]
        assert sample["token_versions"] == ["-1"] * 3 + versions
        assert (sample["start_version"], sample["end_version"], sample["partial_rollout"]) == ("a", "b", True)
        assert sample["version_spans"][1:] == [{"start": 3, "end": 3 + k, "version": "a"},
                                               {"start": 3 + k, "end": 3 + LONG, "version": "b"}]
        state = p.state()
        assert state["version"] == "b" and state["last_update"]["engines"] == {"engine0": "loaded"}
        assert engine.info()["weight_version"] == "b"
        metrics = httpx.get(f"{p.url}/metrics").text
        assert "dressage_proxy_preemptions_total 1.0" in metrics


def test_span_limit_zero_returns_the_exact_502_and_spends_no_compute_on_the_continuation(
        engine: EngineProc, redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys,
        pool: ThreadPoolExecutor) -> None:
    with proxy(engine, redis_server, keys, partial_rollout=True, max_partial_rollout_preempts=0) as p:
        fut = long_request(pool, p.url, "traj-span")
        publish_b_midway(p, engine, redis_client, keys)
        r = fut.result()
        assert r.status_code == 502
        body = r.json()
        # OpenAI's error shape for SDK clients, with the original's fields kept readable in both places.
        assert body["error"]["code"] == "partial_rollout_staleness_exceeded"
        assert body["error"]["versions"] == ["a", "b"] and body["error"]["max_preempts"] == 0
        assert {k: v for k, v in body.items() if k != "error"} == {"detail": {
            "error": "partial_rollout_staleness_exceeded",
            "message": "Partial rollout model version span exceeded limit; rejecting the trajectory instead "
                       "of continuing it.",
            "versions": ["a", "b"], "version_span": 2, "version_switches": 1, "max_preempts": 0,
            "max_version_span": 1, "session_id": "traj-span"}}
        assert httpx.get(f"{p.url}/v1/sessions/traj-span").json()["turns"] == 0  # not recorded
        metrics = httpx.get(f"{p.url}/metrics").text
        assert "dressage_proxy_resumed_chunks_total 0.0" in metrics  # refused before dispatching
        assert "dressage_proxy_span_limit_rejections_total 1.0" in metrics
        # A fresh trajectory on "b" alone is fine.
        ok = httpx.post(f"{p.url}/v1/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 4}},
                        headers={"X-Session-Id": "traj-new"}, timeout=60)
        assert ok.status_code == 200 and set(ok.json()["meta_info"]["output_token_versions"]) == {"b"}


def test_non_partial_mode_rejects_preempted_generations_and_turns_on_a_changed_version(
        engine: EngineProc, redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys,
        pool: ThreadPoolExecutor) -> None:
    with proxy(engine, redis_server, keys, partial_rollout=False) as p:
        first = httpx.post(f"{p.url}/v1/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 4}},
                           headers={"X-Session-Id": "np-2turns"}, timeout=60)
        assert first.status_code == 200
        fut = long_request(pool, p.url, "np-long")
        publish_b_midway(p, engine, redis_client, keys)
        r = fut.result()
        assert r.status_code == 502 and r.json()["detail"]["error"] == "generation_preempted"
        assert r.json()["detail"]["partial_tokens"] >= 20
        p.wait_state(lambda s: s["version"] == "b")
        ids = [5, *first.json()["output_ids"], 9]
        second = httpx.post(f"{p.url}/v1/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}},
                            headers={"X-Session-Id": "np-2turns"}, timeout=60)
        assert second.status_code == 502
        assert second.json()["detail"] | {"message": ""} == {
            "error": "trajectory_version_changed", "message": "", "previous_versions": ["a"],
            "new_versions": ["b"], "session_id": "np-2turns"}
        assert httpx.get(f"{p.url}/v1/sessions/np-2turns").json()["turns"] == 1


def test_operator_pause_aborts_on_the_engine_and_the_partial_tokens_are_kept(
        engine: EngineProc, redis_server: RedisProcess, keys: Keys, pool: ThreadPoolExecutor) -> None:
    with proxy(engine, redis_server, keys, partial_rollout=True) as p:
        fut = long_request(pool, p.url, "traj-pause", n=1500)
        wait_tokens(p, engine, 20)
        paused = httpx.post(f"{p.url}/v1/rollout/pause", json={"reason": "test"}, timeout=30).json()
        assert paused["status"] == "paused" and paused["quiesced"] and len(paused["preempted_request_ids"]) == 1
        st = p.wait_state(lambda s: s["suspended_generations"] == 1)
        assert st["active_generations"] == 0 and engine.info()["running"] == 0  # nothing runs while paused
        resumed = httpx.post(f"{p.url}/v1/rollout/resume", json={}, timeout=30).json()
        assert resumed["status"] == "resumed"
        r = fut.result()
        assert r.status_code == 200
        chunks = r.json()["meta_info"]["partial_rollout_chunks"]
        assert chunks[0]["preempted"] and chunks[0]["finish_reason"] == "abort" and chunks[0]["num_output_tokens"] > 0
        assert sum(c["num_output_tokens"] for c in chunks) == 1500 == len(r.json()["output_ids"])
        assert set(r.json()["meta_info"]["output_token_versions"]) == {"a"}


def test_live_update_swaps_weights_under_a_running_generation_without_a_pause_or_preemption(
        engine: EngineProc, redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys,
        pool: ThreadPoolExecutor) -> None:
    with proxy(engine, redis_server, keys, partial_rollout=True, weight_updates="live") as p:
        fut = long_request(pool, p.url, "live-ab")
        publish_b_midway(p, engine, redis_client, keys)
        meta, _ = a_then_b(fut.result())  # swapped between two decode steps of one request
        assert meta["preempts"] == 0 and len(meta["partial_rollout_chunks"]) == 1  # one rid, never aborted
        state = p.state()
        assert state["version"] == "b" and state["last_update"]["live"] and state["last_update"]["preempted"] == 0
        assert state["weight_update_seconds_total"] == 0 and state["weight_load_seconds_total"] > 0
        assert state["weight_updates_mode"] == "live" and engine.info()["weight_version"] == "b"
        metrics = httpx.get(f"{p.url}/metrics").text
        assert "dressage_proxy_preemptions_total 0.0" in metrics


def test_live_update_enforces_the_span_limit_on_the_tokens_that_came_back(
        engine: EngineProc, redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys,
        pool: ThreadPoolExecutor) -> None:
    with proxy(engine, redis_server, keys, partial_rollout=True, max_partial_rollout_preempts=0,
               weight_updates="live") as p:
        fut = long_request(pool, p.url, "live-span")
        publish_b_midway(p, engine, redis_client, keys)
        r = fut.result()
        assert r.status_code == 502 and r.json()["error"]["code"] == "partial_rollout_staleness_exceeded"
        assert r.json()["error"]["versions"] == ["a", "b"]
        assert httpx.get(f"{p.url}/v1/sessions/live-span").json()["turns"] == 0  # nothing recorded


def test_live_update_lets_a_non_partial_generation_finish_on_its_weights_then_swaps(
        engine: EngineProc, redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys,
        pool: ThreadPoolExecutor) -> None:
    with proxy(engine, redis_server, keys, partial_rollout=False, weight_updates="live") as p:
        first = httpx.post(f"{p.url}/v1/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 4}},
                           headers={"X-Session-Id": "np-live-2turns"}, timeout=60)
        assert first.status_code == 200
        fut = long_request(pool, p.url, "np-live")
        publish_b_midway(p, engine, redis_client, keys)
        r = fut.result()
        assert r.status_code == 200, r.text  # not preempted: the swap waited for it
        assert set(r.json()["meta_info"]["output_token_versions"]) == {"a"} and len(r.json()["output_ids"]) == LONG
        p.wait_state(lambda s: s["version"] == "b")
        assert engine.info()["weight_version"] == "b"
        ids = [5, *first.json()["output_ids"], 9]
        second = httpx.post(f"{p.url}/v1/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}},
                            headers={"X-Session-Id": "np-live-2turns"}, timeout=60)
        assert second.status_code == 502 and second.json()["detail"]["error"] == "trajectory_version_changed"
