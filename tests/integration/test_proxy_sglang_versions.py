"""A real proxy in front of each supported SGLang release (tests/sglang_emulator.py: the release's recorded
routes served over HTTP, its health check answering after >= 1 s and 503 while starting): the engine is
stopped, the proxy marks it down, it is restarted on its port, and it rejoins. One proxy holds an engine
of every release (a mixed fleet), so the 1 s health checks of the restarts overlap: the run is one
stop/restart cycle, checked per release."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from proxy_support import AppThread, ProxyThread
from sglang_emulator import VERSIONS, SGLangEmulator, era_of

from services.proxy.engine_client import EngineClient
from services.proxy.runtime import refuse_live_on_sglang
from shared.config import ProxyConfig
from shared.errors import ConfigError


def generate(proxy: str, session: str = "s-1") -> httpx.Response:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}}
    return httpx.post(f"{proxy}/v1/generate", json=body, headers={"X-Session-Id": session}, timeout=30)


def stop(servers: Iterable[AppThread]) -> None:
    """Stop uvicorn servers together (each notices within its 0.1 s tick)."""
    for s in servers:
        s.server.should_exit = True
    for s in servers:
        s.__exit__()


@dataclass
class Fleet:
    """What one proxy saw of an engine per release: down, restarted, rejoined (run once for all releases)."""

    emulators: dict[str, SGLangEmulator]
    restarted_at: dict[str, int]  # index in the emulator's request log where the restart begins
    down: set[str]  # releases whose engine the proxy marked down once stopped
    rejoin_s: float  # seconds from the restarts until no engine was down
    served: int  # requests answered 200 after the rejoin (of one per release)


@pytest.fixture(scope="module")
def fleet(model_dir: Path) -> Iterator[Fleet]:
    emus = {v: SGLangEmulator(v, starting_s=0.3) for v in VERSIONS}  # the recorded health latency (1 s)
    servers = {v: AppThread(e.app).__enter__() for v, e in emus.items()}
    url = {s.url: v for v, s in servers.items()}
    cfg = ProxyConfig(engines=list(url), load_poll_s=0.2, connect_timeout_s=0.5, engine_health_timeout_s=3.0,
                      follow_versions=False, engine_sync_wait_s=0)
    try:
        with ProxyThread(cfg, model_dir) as proxy:
            assert generate(proxy.url).status_code == 200
            stop(servers.values())
            assert generate(proxy.url).status_code == 503  # every engine refused: each is marked down
            down = {url[u] for u in proxy.state()["engines_down"]}
            marks = {v: len(e.requests) for v, e in emus.items()}
            for v, e in emus.items():
                servers[v] = AppThread(e.app, port=servers[v].port).__enter__()
                e.restart()  # starting: /health answers 503 for 0.3 s, then 200 after its generation (1 s)
            t0 = time.monotonic()
            proxy.wait_state(lambda st: not st["engines_down"], timeout=30)
            rejoin_s = time.monotonic() - t0
            served = sum(generate(proxy.url, f"s-{i}").status_code == 200 for i in range(len(VERSIONS)))
    finally:
        stop(servers.values())
    yield Fleet(emus, marks, down, rejoin_s, served)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_restarted_engine_of_each_release_rejoins(fleet: Fleet, version: str) -> None:
    """Stopped: marked down; restarted: asked again what it speaks, polled on its own routes, back once healthy."""
    emu = fleet.emulators[version]
    assert version in fleet.down
    assert fleet.rejoin_s >= 1.0 and fleet.served == len(VERSIONS)  # healthy only after its 1 s generation
    after = [(m, p.split("?")[0]) for m, p, _ in emu.requests[fleet.restarted_at[version]:]]
    asked = [p for _, p in after]
    assert "/health" in asked and any(p in ("/server_info", "/get_server_info") for p in asked)
    assert ("/get_load" if era_of(version) == "legacy" else "/v1/loads") in asked
    assert all(f"{m} {p}" in emu.routes for m, p in after), after  # only routes this release has
    assert not emu.unknown_fields and not emu.crashed


def test_sglang_health_needs_more_than_one_second() -> None:
    """SGLang's /health answers after its one-token generation, checked once a second (every release): a timeout
    under that second never sees it. (At exactly 1 s the two clocks race: a busy event loop can read the answer
    before it fires its own timeout.)"""
    emu = SGLangEmulator(VERSIONS[-1])
    with AppThread(emu.app) as engine:

        async def healthy(timeout_s: float) -> bool:
            c = EngineClient([engine.url], health_timeout_s=timeout_s)
            try:
                return await c.healthy(engine.url, timeout=0.5)
            finally:
                await c.close()

        assert asyncio.run(healthy(0.8)) is False
        assert asyncio.run(healthy(ProxyConfig().engine_health_timeout_s)) is True


def test_live_updates_against_sglang_are_refused_at_start() -> None:
    """proxy.weight_updates: live with an SGLang engine: a ConfigError (exit 2) naming the engine and the fix."""
    emu = SGLangEmulator("0.5.23")
    with AppThread(emu.app) as engine:
        cfg = ProxyConfig(engines=["http://127.0.0.1:9", engine.url], weight_updates="live", connect_timeout_s=0.5)
        with pytest.raises(ConfigError, match=r"proxy.engines\[1\].*sglang 0.5.23.*weight_updates: pause"):
            refuse_live_on_sglang(cfg)
        refuse_live_on_sglang(cfg.model_copy(update={"weight_updates": "pause"}))
