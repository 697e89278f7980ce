"""Proxy HTTP app (ASGI, in process) over the fake engine: routes, sessions, errors, guards, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from proxy_fake_engine import FakeEngine, http_client

from services.proxy.app import build_app
from services.proxy.engine_client import EngineClient
from services.proxy.runtime import ProxyRuntime
from shared.config import ProxyConfig
from shared.modeling.tokenizer import build_tokenizer

ENGINE = "http://engine-1"
TOKENIZER = build_tokenizer()
MSG = [{"role": "user", "content": "hello"}]


def run_proxy(test: Callable[[httpx.AsyncClient, ProxyRuntime, FakeEngine], Awaitable[None]],
              engine: FakeEngine | None = None, **cfg: Any) -> None:
    eng = engine or FakeEngine("a", stop_after=6)
    config = ProxyConfig(engines=[ENGINE], **cfg)
    rt = ProxyRuntime(config, TOKENIZER, client=EngineClient([ENGINE], transport=http_client({ENGINE: eng})))
    app = build_app(rt)

    async def main() -> None:
        await rt.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
                await asyncio.wait_for(test(c, rt, eng), 20)
        finally:
            await rt.stop()

    asyncio.run(main())


def detail(resp: httpx.Response) -> dict[str, Any]:
    return resp.json()["detail"]


def test_chat_turns_are_recorded_as_one_extending_segment() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r1 = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 20},
                          headers={"X-Session-Id": "traj-1"})
        assert r1.status_code == 200 and r1.headers["x-session-id"] == "traj-1"
        body = r1.json()
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["dressage"]["versions"] == ["a"] and body["dressage"]["segment_index"] == 0
        reply = body["choices"][0]["message"]["content"]
        msgs = [*MSG, {"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        r2 = await c.post("/s/traj-1/v1/chat/completions", json={"messages": msgs})
        assert r2.status_code == 200 and r2.json()["dressage"]["segment_index"] == 0
        s = (await c.get("/v1/sessions/traj-1")).json()
        assert s["session_id"] == "traj-1" and s["turns"] == 2 and s["versions"] == ["a"]
        (sample,) = s["samples"]
        assert sum(sample["loss_mask"]) == 12 and sample["token_versions"].count("a") == 12
        assert eng.generate_bodies[1]["input_ids"][:len(sample["token_ids"]) - 6] == sample["token_ids"][:-6]
    run_proxy(t)


def test_generate_route_takes_token_ids_and_returns_sglang_shape() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/generate", json={"input_ids": [10, 11], "session_id": "w-1",
                                               "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}})
        assert r.status_code == 200
        body = r.json()
        assert body["output_ids"] == [12, 13, 14] and body["session_id"] == "w-1"
        assert body["meta_info"]["output_token_versions"] == ["a"] * 3
        assert body["meta_info"]["output_token_logprobs"][0] == [-0.25, 12, None]
        assert eng.generate_bodies[0]["sampling_params"]["temperature"] == 0.0
        sample = (await c.get("/v1/sessions/w-1")).json()["samples"][0]
        assert sample["token_ids"] == [10, 11, 12, 13, 14] and sample["loss_mask"] == [0, 0, 1, 1, 1]
    run_proxy(t)


def test_pseudo_stream_carries_the_same_text_as_a_plain_reply() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        plain = (await c.post("/v1/chat/completions", json={"messages": MSG})).json()
        r = await c.post("/v1/chat/completions",
                         json={"messages": MSG, "stream": True, "stream_options": {"include_usage": True}})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
        assert text == plain["choices"][0]["message"]["content"]
        assert chunks[-1]["usage"]["completion_tokens"] == 6
    run_proxy(t)


def test_sessions_finalize_is_idempotent_then_refuses_turns_and_delete_frees() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        await c.post("/v1/chat/completions", json={"messages": MSG, "session_id": "s-9"})
        f1 = await c.post("/v1/sessions/s-9/finalize")
        f2 = await c.post("/v1/sessions/s-9/finalize")
        assert f1.status_code == f2.status_code == 200 and f1.json() == f2.json() and f1.json()["finalized"]
        again = await c.post("/v1/chat/completions", json={"messages": MSG}, headers={"X-Session-Id": "s-9"})
        assert again.status_code == 409 and detail(again)["error"] == "session_conflict"
        assert (await c.delete("/v1/sessions/s-9")).json() == {"session_id": "s-9", "deleted": True}
        for r in (await c.get("/v1/sessions/s-9"), await c.delete("/v1/sessions/s-9"),
                  await c.post("/v1/sessions/nope/finalize")):
            assert r.status_code == 404 and detail(r)["error"] == "session_not_found"
    run_proxy(t)


def test_n_choices_are_generated_and_recorded_one_per_named_session() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "n": 3, "seed": 7, "max_tokens": 20},
                         headers={"X-Session-Ids": "g-s0, g-s1,g-s2"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2] and r.headers["x-session-ids"] == "g-s0,g-s1,g-s2"
        assert [d["session_id"] for d in body["dressage"]["choices"]] == ["g-s0", "g-s1", "g-s2"]
        assert body["usage"]["completion_tokens"] == 18 and body["usage"]["prompt_tokens"] > 0
        for sid in ("g-s0", "g-s1", "g-s2"):
            rec = (await c.get(f"/v1/sessions/{sid}")).json()
            assert rec["turns"] == 1 and len(rec["samples"]) == 1 and sum(rec["samples"][0]["loss_mask"]) == 6
        assert sorted(b["sampling_params"]["sampling_seed"] for b in eng.generate_bodies) == [7, 8, 9]  # distinct
        assert eng.batch_sizes == [3]  # one engine request for the three first chunks
    run_proxy(t)


@pytest.mark.parametrize(("body", "headers", "status", "field"), [
    ({"messages": MSG, "n": 2}, {}, 400, "n"),  # n > 1 without a session per choice
    ({"messages": MSG, "n": 3}, {"X-Session-Ids": "a,b"}, 422, "n"),
    ({"messages": MSG}, {"X-Session-Ids": "a,b"}, 422, "n"),
    ({"messages": MSG, "n": 2}, {"X-Session-Ids": "a,a"}, 422, "X-Session-Ids"),
    ({"messages": MSG, "n": 2}, {"X-Session-Ids": "a,bad id"}, 422, "X-Session-Ids"),
    ({"messages": MSG, "n": 2}, {"X-Session-Ids": "a,b", "X-Session-Id": "a"}, 422, "X-Session-Ids"),
    ({"messages": MSG, "n": 2, "stream": True}, {"X-Session-Ids": "a,b"}, 400, "stream"),
    ({"messages": MSG, "n": 2, "response_format": {"type": "json_object"}}, {"X-Session-Ids": "a,b"}, 400,
     "response_format"),
])
def test_n_choices_refuse_what_they_cannot_honour_naming_the_field(body: dict[str, Any], headers: dict[str, str],
                                                                   status: int, field: str) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == status and field in json.dumps(detail(r)), r.text
        assert len(rt.sessions) == 0 and not eng.generate_bodies  # refused before any compute
    run_proxy(t)


def test_n_choices_are_all_or_nothing_and_the_refused_session_is_named() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        await c.post("/v1/chat/completions", json={"messages": MSG}, headers={"X-Session-Id": "g-s1"})
        await c.post("/v1/sessions/g-s1/finalize")
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "n": 2},
                         headers={"X-Session-Ids": "g-s0,g-s1"})
        assert r.status_code == 409 and detail(r)["error"] == "session_conflict"
        assert detail(r)["session_id"] == "g-s1"
        assert rt.sessions.get("g-s0").turns == 0 and len(eng.generate_bodies) == 1  # refused before any compute
    run_proxy(t)


def test_sessions_close_finalizes_reads_and_drops_a_group_in_one_call() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        for sid in ("g-s0", "g-s1"):
            assert (await c.post("/v1/chat/completions", json={"messages": MSG},
                                 headers={"X-Session-Id": sid})).status_code == 200
        single = (await c.get("/v1/sessions/g-s0")).json()  # what finalize would answer, before the close
        r = await c.post("/v1/sessions/close", json={"session_ids": ["g-s0", "never-opened", "g-s1"]})
        assert r.status_code == 200
        body = r.json()
        assert body["closed"] == ["g-s0", "g-s1"] and body["missing"] == ["never-opened"]
        assert body["records"]["g-s0"] == {**single, "finalized": True}
        assert [s["traj_id"] for s in body["records"]["g-s1"]["samples"]] == ["g-s1"]
        assert len(rt.sessions) == 0 and (await c.get("/v1/sessions/g-s0")).status_code == 404
        # dropping only, and a second close of the same ids finds nothing
        await c.post("/v1/chat/completions", json={"messages": MSG}, headers={"X-Session-Id": "g-s2"})
        r = await c.post("/v1/sessions/close", json={"session_ids": ["g-s2", "g-s0"], "records": False})
        assert r.json() == {"closed": ["g-s2"], "missing": ["g-s0"], "records": {}} and len(rt.sessions) == 0
    run_proxy(t)


@pytest.mark.parametrize(("body", "field"), [
    ({"session_ids": []}, "session_ids"),
    ({"session_ids": ["a", "a"]}, "session_ids"),
    ({"session_ids": ["ok", "bad id"]}, "session_ids"),
    ({"session_ids": ["a"], "recrods": False}, "recrods"),
    ({}, "session_ids"),
])
def test_sessions_close_refuses_a_bad_body_naming_the_field(body: dict[str, Any], field: str) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        await c.post("/v1/chat/completions", json={"messages": MSG}, headers={"X-Session-Id": "a"})
        r = await c.post("/v1/sessions/close", json=body)
        assert r.status_code == 422 and detail(r)["field"] == field, r.text
        assert len(rt.sessions) == 1  # nothing closed
    run_proxy(t)


def test_sessions_close_records_a_running_turn_first() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        turn = asyncio.ensure_future(c.post("/v1/chat/completions", json={"messages": MSG},
                                            headers={"X-Session-Id": "slow"}))
        while len(rt.sessions) == 0:
            await asyncio.sleep(0.01)
        closed = (await c.post("/v1/sessions/close", json={"session_ids": ["slow"]})).json()
        assert (await turn).status_code == 200
        assert closed["closed"] == ["slow"] and len(closed["records"]["slow"]["samples"]) == 1
    run_proxy(t, engine=FakeEngine("a", step_s=0.03, stop_after=6))


def test_bearer_auth_is_required_except_for_health_and_the_key_is_never_echoed(
        caplog: pytest.LogCaptureFixture) -> None:
    key = "s3cret-key-value"

    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        assert (await c.get("/health")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            r = await c.post("/v1/chat/completions", json={"messages": MSG}, headers=headers)
            assert r.status_code == 401 and detail(r)["error"] == "unauthorized" and key not in r.text
        assert (await c.get("/v1/rollout/state")).status_code == 401
        ok = await c.post("/v1/chat/completions", json={"messages": MSG}, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200 and eng.generate_bodies
    with caplog.at_level(logging.DEBUG):
        run_proxy(t, api_key=key)
    assert key not in caplog.text


def test_body_limit_by_content_length_and_by_streamed_bytes() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        r = await c.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and detail(r)["error"] == "body_too_large"

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted while received
            for i in range(0, len(big), 512):
                yield big[i:i + 512]
        r = await c.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and detail(r)["error"] == "body_too_large"
        assert eng.generate_bodies == []
    run_proxy(t, max_body_bytes=4096)


@pytest.mark.parametrize(("body", "headers", "field"), [
    ({"messages": MSG, "max_tokens": 65}, {}, "max_tokens"),
    ({"messages": MSG * 5}, {}, "messages"),
    ({"messages": [{"role": "user", "content": "y" * 300}]}, {}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, {}, "messages.0.role"),
    ({"messages": []}, {}, "messages"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, {}, "tools.0.function"),
    ({"messages": MSG, "session_id": "a"}, {"X-Session-Id": "b"}, "session_id"),
    ({"messages": MSG}, {"X-Session-Id": "bad id"}, "X-Session-Id"),
    ({"messages": MSG}, {"X-Dressage-Partial-Rollout": "maybe"}, "X-Dressage-Partial-Rollout"),
    ("{not json", {}, "body"),
])
def test_invalid_requests_get_422_naming_the_field(body: Any, headers: dict[str, str], field: str) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        kw: dict[str, Any] = {"content": body} if isinstance(body, str) else {"json": body}
        r = await c.post("/v1/chat/completions", headers=headers, **kw)
        assert r.status_code == 422, r.text
        assert detail(r)["error"] == "invalid_request" and detail(r)["field"] == field
        assert "Traceback" not in r.text and eng.generate_bodies == []
    run_proxy(t, max_tokens_limit=64, max_messages=4, max_prompt_tokens=100)


def test_generate_route_validates_token_ids_and_sampling_fields() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        cases = [({"input_ids": [1, -2]}, "input_ids"), ({"input_ids": [1], "sampling_params": {"max_tokens": 3}},
                 "sampling_params.max_tokens"), ({"input_ids": [1] * 101}, "input_ids"),
                 ({"input_ids": [1], "sampling_params": {"max_new_tokens": 65}}, "sampling_params.max_new_tokens")]
        for body, field in cases:
            r = await c.post("/v1/generate", json=body)
            assert r.status_code == 422 and detail(r)["field"] == field, r.text
    run_proxy(t, max_tokens_limit=64, max_prompt_tokens=100)


def test_over_capacity_is_503_with_retry_after_and_never_queued() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        slow = asyncio.create_task(c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 50}))
        await eng.started.wait()
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 5})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert detail(r)["error"] == "over_capacity"
        assert (await slow).status_code == 200
        assert (await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 5})).status_code == 200
    run_proxy(t, engine=FakeEngine("a", step_s=0.01), max_concurrency=1)


def test_unexpected_errors_are_500_internal_error_without_details(monkeypatch: pytest.MonkeyPatch) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        async def boom(*a: Any, **k: Any) -> None:
            raise RuntimeError("hidden-internal-detail")
        monkeypatch.setattr(rt.controller, "generate", boom)
        r = await c.post("/v1/chat/completions", json={"messages": MSG})
        assert r.status_code == 500 and r.json() == {"error": "internal_error"}
        assert (await c.get("/health")).status_code == 200  # still serving
    run_proxy(t)


def test_non_partial_header_turns_a_pause_into_generation_preempted() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        req = asyncio.create_task(c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 60},
                                         headers={"X-Session-Id": "np", "X-Dressage-Partial-Rollout": "0"}))
        await eng.started.wait()
        p = await c.post("/v1/rollout/pause", json={"reason": "test"})
        assert p.status_code == 200 and p.json()["quiesced"]
        r = await req
        assert r.status_code == 502 and detail(r)["error"] == "generation_preempted"
        assert (await c.post("/v1/rollout/resume", json={"version": "a"})).json()["status"] == "resumed"
        assert (await c.get("/v1/sessions/np")).json()["turns"] == 0  # the refused turn is not recorded
    run_proxy(t, engine=FakeEngine("a", step_s=0.005))


def test_rollout_state_health_models_and_metrics() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        await c.post("/v1/chat/completions", json={"messages": MSG})
        state = (await c.get("/v1/rollout/state")).json()
        assert state["version"] == "a" and state["paused"] is False and state["sessions"] == 1
        assert (await c.get("/health")).json()["version"] == "a"
        assert (await c.get("/s/x/v1/models")).json()["data"][0]["id"] == "dressage"
        bad = await c.post("/v1/rollout/pause", json={"timeout": 3})
        assert bad.status_code == 422 and detail(bad)["field"] == "timeout"
        text = (await c.get("/metrics")).text
        assert 'dressage_proxy_requests_total{code="200",route="chat"} 1.0' in text
        assert "dressage_proxy_trajectory_version_span_bucket" in text
        assert "dressage_proxy_sessions 1.0" in text
    run_proxy(t)
