"""Engines serve the published weights (issue 14): catch-up, hold-back, learning versions from answers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from proxy_fake_engine import FakeEngine, http_client
from waits import async_wait_for

from services.proxy.controller import GenerationController
from services.proxy.engine_client import EngineClient
from services.proxy.errors import UpstreamUnavailable
from services.proxy.metrics import ProxyMetrics
from services.proxy.updater import WeightUpdater
from shared.schemas import WeightVersion

E1, E2 = "http://engine-1", "http://engine-2"
SAMPLING = {"temperature": 1.0, "stop_token_ids": []}


def setup(engines: dict[str, FakeEngine | None], max_preempts: int | None = None,
          sync_wait_s: float = 5.0, live: bool = False) -> tuple[GenerationController, WeightUpdater]:
    client = EngineClient(list(engines), transport=http_client(engines))
    ctl = GenerationController(client, ProxyMetrics(), max_preempts, request_timeout_s=10, pause_timeout_s=5,
                               engine_sync_wait_s=sync_wait_s, live_updates=live)
    updater = WeightUpdater(ctl, client, ctl.metrics)
    ctl.on_engine_behind = updater.catch_up
    return ctl, updater


def wv(version: str) -> WeightVersion:
    return WeightVersion(version=version, path=f"/ckpt/{version}", step=int(version), published_at=0.0)


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), 20))


def test_engine_restarted_on_initial_weights_is_caught_up_and_its_stale_answer_never_reaches_the_caller() -> None:
    eng = FakeEngine(version="0", stop_after=4)
    ctl, updater = setup({E1: eng})

    async def flow() -> Any:
        await updater.apply(wv("7"))
        assert eng.version == "7" and ctl.target == "7"
        eng.version = "0"  # the engine was SIGKILLed and came back on models/<initial>
        gen = await ctl.generate("s1", [], [1, 2, 3], 10, SAMPLING, partial=True)
        await updater.wait_idle()
        return gen

    gen = run(flow)
    assert set(gen.versions) == {"7"}, gen.versions  # only tokens of the published weights are delivered
    assert [u["weight_version"] for u in eng.updates] == ["7", "7"]  # the update, then the catch-up
    assert ctl.metrics.stale_chunks._value.get() == 1
    assert len(eng.generate_bodies) == 2 and ctl.behind == set()


def test_health_check_path_holds_back_a_behind_engine_and_routes_to_the_caught_up_one() -> None:
    e1, e2 = FakeEngine(version="0", stop_after=2), FakeEngine(version="0", stop_after=2)
    ctl, updater = setup({E1: e1, E2: e2})

    async def flow() -> list[str]:
        await updater.apply(wv("3"))
        e2.fail_update = True
        e2.version = "1"  # someone loaded an older checkpoint into engine 2; it refuses ours for now
        assert not ctl.learn(E2, "1") and E2 in ctl.behind
        await updater.wait_idle()
        await async_wait_for(lambda: len(e2.updates) == 2, what="the (failing) catch-up ran")
        assert E2 in ctl.behind
        sessions = [f"s{i}" for i in range(12)]
        gens = [await ctl.generate(s, [], [1], 4, SAMPLING, partial=False) for s in sessions]
        assert len(e2.generate_bodies) == 0  # nothing routed to the engine behind
        e2.fail_update = False
        ctl.mark_behind(E2, "health check: still version 1")  # the next check retries the catch-up
        await async_wait_for(lambda: E2 not in ctl.behind, 5, "engine 2 caught up")
        return [v for g in gens for v in g.versions]

    versions = run(flow)
    assert set(versions) == {"3"} and e2.version == "3" and ctl.behind == set()


def test_every_engine_behind_waits_bounded_then_upstream_unavailable() -> None:
    eng = FakeEngine(version="0")
    ctl, updater = setup({E1: eng}, sync_wait_s=0.3)

    async def flow() -> Any:
        await updater.apply(wv("2"))
        eng.fail_update, eng.version = True, "0"  # restarted on its initial weights; the load fails
        ctl.mark_behind(E1, "test: restarted")
        with pytest.raises(UpstreamUnavailable) as err:
            await ctl.generate("s1", [], [1], 4, SAMPLING, partial=True)
        return err.value

    exc = run(flow)
    assert exc.status == 503 and "published version=2" in exc.message
    assert eng.generate_bodies == []  # no generation was started on the old weights


def test_unreachable_engine_is_held_back_until_it_answers_with_the_target() -> None:
    ctl, updater = setup({E1: None, E2: FakeEngine(version="0", stop_after=2)})

    async def flow() -> Any:
        await updater.apply(wv("5"))  # engine 1 is down: only engine 2 loads it
        assert ctl.behind == {E1}
        return await ctl.generate("any", [], [1], 4, SAMPLING, partial=True)

    gen = run(flow)
    assert set(gen.versions) == {"5"}


def test_version_loaded_behind_the_proxys_back_is_learned_from_the_answer() -> None:
    """Not following versions (no target): the next turn of a session is checked against what the engine
    really runs, not a stale ``current_version`` naming a version the session never used."""
    eng = FakeEngine(version="1", stop_after=3)
    ctl, _ = setup({E1: eng}, max_preempts=0)
    ctl.current_version = "1"

    async def flow() -> Any:
        eng.version = "2"  # another proxy or an operator loaded version 2
        first = await ctl.generate("s1", [], [1], 4, SAMPLING, partial=True)
        assert ctl.current_version == "2"
        return await ctl.generate("s1", first.versions, [1, 2], 4, SAMPLING, partial=True)

    second = run(flow)
    assert set(second.versions) == {"2"}


def test_client_disconnect_is_one_counted_log_line_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from services.proxy.guards import Guard

    async def route(request: Request) -> JSONResponse:
        await request.body()  # the client is gone: Starlette raises ClientDisconnect here
        return JSONResponse({})

    metrics = ProxyMetrics()
    app = Guard(Starlette(routes=[Route("/v1/generate", route, methods=["POST"])]), None, 1 << 20, metrics)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/generate", "headers": [(b"x-session-id", b"g1-0")],
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("t", 80), "http_version": "1.1"}
    with caplog.at_level("INFO"):
        run(lambda: app(scope, receive, send))
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None and "session_id=g1-0" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert metrics.client_disconnects._value.get() == 1


def test_every_engine_refusing_waits_for_one_to_come_back_bounded() -> None:
    import time

    ctl, _ = setup({E1: None}, sync_wait_s=0.4)
    ctl.set_target("4")  # following the published weights: a refused connection holds the engine back

    async def flow() -> float:
        start = time.monotonic()
        with pytest.raises(UpstreamUnavailable, match="published version=4"):
            await ctl.generate("s1", [], [1], 4, SAMPLING, partial=True)
        return time.monotonic() - start

    waited = run(flow)
    assert 0.4 <= waited < 5 and ctl.behind == {E1}


def test_versions_published_while_the_engine_was_down_are_the_catch_up_target() -> None:
    """The trainer published 4 and 5 while the engine was restarting: it must come back on 5, not 3."""
    eng = FakeEngine(version="0", stop_after=2)
    ctl, updater = setup({E1: eng})

    async def flow() -> Any:
        await updater.apply(wv("3"))
        eng.fail_update = True  # down: every load fails
        await updater.apply(wv("4"))
        await updater.apply(wv("5"))
        assert ctl.target == "5" and ctl.behind == {E1}
        eng.fail_update, eng.version = False, "0"  # back, on its initial weights
        ctl.mark_behind(E1, "health check: version 0")
        return await ctl.generate("s1", [], [1], 4, SAMPLING, partial=True)

    gen = run(flow)
    assert set(gen.versions) == {"5"} and eng.version == "5"
