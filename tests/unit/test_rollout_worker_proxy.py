"""Proxy client contract: the in-process fake and the HTTP client (over the fake's routes) behave alike."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from services.rollout_worker.errors import TrajectoryFailed
from services.rollout_worker.fake_proxy import FakeProxy, FakeProxyClient
from services.rollout_worker.proxy_client import (
    ClosedSessions,
    HttpProxyClient,
    ProxyClient,
    closed_sessions,
    proxy_error,
)
from shared.codes import STALENESS_EXCEEDED

MSGS = [{"role": "user", "content": "reverse 12"}]


def make_client(kind: str, fake: FakeProxy) -> ProxyClient:
    if kind == "fake":
        return FakeProxyClient(fake, "http://proxy")
    return HttpProxyClient("http://proxy/", fake.api_key, transport=fake.transport())


CLIENTS = pytest.mark.parametrize("kind", ["fake", "http"])


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


@CLIENTS
def test_chat_returns_the_reply_and_records_a_sample_in_the_session(kind: str) -> None:
    fake = FakeProxy(reply=lambda sid, msgs: f"hi {sid}", version="7")
    client = make_client(kind, fake)

    async def go() -> tuple[str, dict[str, Any]]:
        text = await client.chat("sess-1", MSGS, 8, 1.0)
        return text, await client.finalize("sess-1")

    text, record = run(go)
    assert text == "hi sess-1"
    assert record["session_id"] == "sess-1" and len(record["samples"]) == 1
    s = record["samples"][0]
    assert s["traj_id"] == "sess-1" and s["end_version"] == "7" and sum(s["loss_mask"]) == len("hi sess-1")
    assert fake.calls == [("sess-1", MSGS)]


@CLIENTS
@pytest.mark.parametrize("code, expected", [
    (STALENESS_EXCEEDED, STALENESS_EXCEEDED),
    ("trajectory_version_changed", "trajectory_version_changed"),
    ("generation_preempted", "generation_preempted"),
    ("upstream_unavailable", "upstream_unavailable"),
    ("http_500", "proxy_http_500"),
])
def test_proxy_errors_map_to_trajectory_failures(kind: str, code: str, expected: str) -> None:
    fake = FakeProxy(fail=lambda sid, i: code)
    client = make_client(kind, fake)
    with pytest.raises(TrajectoryFailed) as info:
        run(lambda: client.chat("s", MSGS, 8, 1.0))
    assert info.value.code == expected and info.value.session_id == "s" and info.value.retryable
    assert "s" not in fake.sessions  # the rejected step is not recorded


@CLIENTS
def test_over_capacity_is_waited_out_not_a_failure(kind: str) -> None:
    refusals = [2]

    def fail(sid: str, i: int) -> str | None:
        refusals[0] -= 1
        return "over_capacity" if refusals[0] >= 0 else None

    fake = FakeProxy(fail=fail)
    assert run(lambda: make_client(kind, fake).chat("s", MSGS, 8, 1.0)) == "42"
    assert len(fake.calls) == 3 and len(fake.sessions["s"]) == 1


@CLIENTS
def test_unknown_session_is_a_failure_but_deleting_it_is_fine(kind: str) -> None:
    client = make_client(kind, FakeProxy())
    with pytest.raises(TrajectoryFailed) as info:
        run(lambda: client.finalize("nope"))
    assert info.value.code == "session_not_found"
    run(lambda: client.delete_session("nope"))


@CLIENTS
def test_a_finalized_session_takes_no_more_turns(kind: str) -> None:
    client = make_client(kind, FakeProxy())

    async def go() -> None:
        await client.chat("s", MSGS, 8, 1.0)
        assert (await client.finalize("s"))["finalized"] is True
        await client.chat("s", MSGS, 8, 1.0)

    with pytest.raises(TrajectoryFailed) as info:
        run(go)
    assert info.value.code == "proxy_http_409"


@CLIENTS
def test_delete_drops_the_session(kind: str) -> None:
    fake = FakeProxy()
    client = make_client(kind, fake)

    async def go() -> None:
        await client.chat("a/b c", MSGS, 8, 1.0)  # ids are path-quoted
        await client.delete_session("a/b c")

    run(go)
    assert fake.sessions == {} and fake.deleted == ["a/b c"]


@CLIENTS
def test_close_sessions_returns_records_and_missing_ids_in_one_call(kind: str) -> None:
    fake = FakeProxy()
    client = make_client(kind, fake)

    async def go() -> tuple[ClosedSessions, ClosedSessions]:
        await client.chat("g-s0", MSGS, 8, 1.0)
        await client.chat("g-s1", MSGS, 8, 1.0)
        first = await client.close_sessions(["g-s0", "g-s1", "gone"])
        return first, await client.close_sessions(["g-s0"], records=False)

    first, again = run(go)
    assert sorted(first.records) == ["g-s0", "g-s1"] and first.missing == ["gone"]
    assert first.records["g-s1"]["finalized"] is True and len(first.records["g-s1"]["samples"]) == 1
    assert again.records == {} and again.missing == ["g-s0"] and fake.sessions == {}
    assert fake.closes == [["g-s0", "g-s1", "gone"], ["g-s0"]]


def test_a_close_answer_without_records_is_an_invalid_proxy_response() -> None:
    with pytest.raises(TrajectoryFailed) as info:
        closed_sessions({"closed": []}, "g-s0")
    assert info.value.code == "invalid_proxy_response"


@CLIENTS
def test_bearer_key_is_sent_when_configured(kind: str) -> None:
    fake = FakeProxy(api_key="sekrit")
    assert run(lambda: make_client(kind, fake).chat("s", MSGS, 8, 1.0)) == "42"
    stranger = HttpProxyClient("http://proxy", None, transport=fake.transport())
    with pytest.raises(TrajectoryFailed) as info:
        run(lambda: stranger.chat("s", MSGS, 8, 1.0))
    assert info.value.code == "proxy_http_401"


@CLIENTS
def test_agent_base_url_is_session_scoped(kind: str) -> None:
    assert make_client(kind, FakeProxy()).agent_base_url("g-a0-s1-x") == "http://proxy/s/g-a0-s1-x/v1"


def test_http_client_sends_the_session_header_and_openai_body() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

    client = HttpProxyClient("http://p", transport=httpx.MockTransport(handler))
    assert run(lambda: client.chat("sid-9", MSGS, 5, 0.5)) == "ok"
    req = seen[0]
    assert req.url.path == "/v1/chat/completions" and req.headers["X-Session-Id"] == "sid-9"
    body = httpx.Response(200, content=req.content).json()
    assert body["messages"] == MSGS and body["max_tokens"] == 5 and body["temperature"] == 0.5


def test_http_timeout_and_unreachable_proxy_are_named_failures() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    with pytest.raises(TrajectoryFailed) as info:
        run(lambda: HttpProxyClient("http://p", transport=httpx.MockTransport(slow)).chat("s", MSGS, 5, 1.0))
    assert info.value.code == "proxy_timeout"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the call: nobody listens there
    with pytest.raises(TrajectoryFailed) as info:
        run(lambda: HttpProxyClient(f"http://127.0.0.1:{port}").chat("s", MSGS, 5, 1.0))
    assert info.value.code == "proxy_unreachable"


def test_malformed_completion_is_a_failure() -> None:
    client = HttpProxyClient("http://p", transport=httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    with pytest.raises(TrajectoryFailed) as info:
        run(lambda: client.chat("s", MSGS, 5, 1.0))
    assert info.value.code == "invalid_proxy_response"


@pytest.mark.parametrize("status, body, code", [
    (502, {"detail": {"error": STALENESS_EXCEEDED, "message": "span 3 > 2"}}, STALENESS_EXCEEDED),
    (502, {"error": "generation_preempted"}, "generation_preempted"),  # top-level error object
    (502, "Bad Gateway", "proxy_http_502"),  # a 502 from something else in between
    (503, {"detail": "upstream_unavailable"}, "upstream_unavailable"),
    (503, {"detail": {"error": "over_capacity"}}, "over_capacity"),
    # an engine answering 503 while it restarts: the upstream is unavailable, not the trajectory's fault
    (502, {"detail": {"error": "upstream_error", "engine_status": 503}}, "upstream_unavailable"),
    (502, {"detail": {"error": "upstream_error", "engine_status": 400}}, "upstream_error"),
    (404, {"detail": "no such session"}, "session_not_found"),
    (422, {"detail": [{"loc": ["body"]}]}, "proxy_http_422"),
])
def test_error_body_mapping(status: int, body: Any, code: str) -> None:
    assert proxy_error(status, body).code == code
