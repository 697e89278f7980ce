"""The engine client against every supported SGLang release's recorded behaviour (tests/sglang_emulator.py
replays fixtures/engine/sglang_versions.json over ASGI), and the pure version -> dialect rule."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sglang_emulator import RECORDED, VERSIONS, SGLangEmulator, era_of

from services.proxy.balancer import parse_load
from services.proxy.engine_client import Chunk, EngineClient
from services.proxy.errors import UpstreamError, UpstreamStreamError, UpstreamUnavailable
from shared.http_transport import HttpxTransport
from shared.sglang_compat import (
    OWN_ENGINE,
    dialect_for,
    live_refusal,
    loads_of,
    parse_version,
    sendable,
)
from shared.sglang_fields import OWN_ENGINE_VERSION

URL = "http://sglang:30000"
BODY = {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": -1, "rid": "r-1",
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 3}, "continue_across_weight_updates": True}


def client(emu: SGLangEmulator, **kw: Any) -> EngineClient:
    transport = HttpxTransport(httpx.AsyncClient(transport=httpx.ASGITransport(app=emu.app)))
    return EngineClient([URL], transport=transport, control_timeout_s=kw.pop("control_timeout_s", 5.0), **kw)


def routes_asked(emu: SGLangEmulator, *paths: str) -> list[str]:
    return [p for _, p, _ in emu.requests if p in paths]


def test_versions_map_to_their_routes() -> None:
    """The pure rule: up to 0.5.20 the legacy routes, from 0.5.21 /v1/loads, /model_info and flush_cache: false."""
    assert [v for v in VERSIONS] == [f"0.5.{n}" for n in range(9, 24)]
    for v in VERSIONS:
        d = dialect_for({"version": v})
        assert d.sglang and not d.live_updates and d.name == f"sglang {v}" and d.note is None
        assert d.health_route == "/health" and d.slow_health and not d.extension_fields
        if era_of(v) == "legacy":
            assert (d.load_routes[0], d.weight_version_routes[0]) == ("/get_load", "/get_weight_version")
            assert d.drain_before_load and not d.flush_after_load and dict(d.load_fields) == {}
        else:
            assert d.load_routes == ("/v1/loads?include=core",) and d.weight_version_routes == ("/model_info",)
            assert d.flush_after_load and not d.drain_before_load and dict(d.load_fields) == {"flush_cache": False}


def test_own_engine_unknown_and_unsupported_versions() -> None:
    """This project's engine keeps live updates and its extension; an unreadable or unsupported SGLang gets a note."""
    assert dialect_for({"version": OWN_ENGINE_VERSION}) is OWN_ENGINE and live_refusal(OWN_ENGINE) is None
    unknown = dialect_for(None)
    assert unknown.sglang and unknown.note and unknown.drain_before_load
    assert set(unknown.load_routes) == {"/get_load", "/v1/loads?include=core"}
    assert dialect_for({"version": "0.5.3.post1"}).note and dialect_for({"version": "0.6.0"}).note
    assert dialect_for({"version": "0.6.0"}).weight_version_routes == ("/model_info",)
    assert parse_version("0.5.10rc1") == (0, 5, 10) and parse_version("dev") is None and parse_version(5) is None
    assert "weight_updates: pause" in (live_refusal(dialect_for({"version": "0.5.12"})) or "")


def test_extension_fields_reach_only_this_projects_engine() -> None:
    """continue_across_weight_updates is never sent to SGLang (it does not know it)."""
    assert "continue_across_weight_updates" not in sendable(BODY, dialect_for({"version": "0.5.12"}))
    assert sendable(BODY, OWN_ENGINE) == BODY
    assert loads_of({"version": "0.5.22", "loads": [{"num_running_reqs": 1}]}) == [{"num_running_reqs": 1}]


@pytest.mark.parametrize("version", VERSIONS)
def test_each_release_is_spoken_to_with_its_routes(version: str) -> None:
    """Identify, load, weight version, health, a weight load (with a request still draining), generate."""
    emu = SGLangEmulator(version, health_delay_s=0.0)

    async def go() -> None:
        c = client(emu)
        assert (await c.dialect(URL)).name == f"sglang {version}"
        assert await c.weight_version(URL) == "default"
        assert parse_load(await c.load(URL, 1.0)) == 0
        assert await c.healthy(URL, timeout=0.5)
        emu.busy_flushes = 1  # a just-aborted request still runs (sgl-project/sglang#14062)
        await c.update_weights(URL, "/ckpt/step-2", "2")
        assert await c.weight_version(URL) == "2"
        whole = await c.generate(URL, dict(BODY))
        deltas: list[Chunk] = []
        streamed = await c.generate(URL, {**BODY, "stream": True}, deltas.append)
        assert whole.output_ids == streamed.output_ids == [10, 11, 12] and whole.weight_version == "2"
        assert whole.logprobs == [-0.5] * 3 and whole.finish_type == "length"
        assert [len(d.output_ids) for d in deltas] == [1, 1, 1]  # cumulative events read as deltas
        await c.close()

    asyncio.run(go())
    assert not emu.crashed and not emu.unknown_fields  # no flush assert fired; nothing SGLang does not know
    loads = routes_asked(emu, "/flush_cache", "/update_weights_from_disk")
    if era_of(version) == "legacy":  # drained first: the engine's own flush after the load finds it idle
        assert loads == ["/flush_cache", "/flush_cache", "/update_weights_from_disk"]
    else:  # loaded with flush_cache: false, then flushed until it succeeds
        assert loads == ["/update_weights_from_disk", "/flush_cache", "/flush_cache"]
        assert [b for _, p, b in emu.requests if p == "/update_weights_from_disk"][0]["flush_cache"] is False
    missing = [p for m, p, _ in emu.requests if f"{m} {p.split('?')[0]}" not in emu.routes]
    assert missing == []  # only routes this release has (each release answers /server_info)


def test_a_release_before_server_info_is_identified_from_get_server_info() -> None:
    """0.5.9 - 0.5.20 releases without /server_info: its 404 moves the probe to /get_server_info."""
    emu = SGLangEmulator("0.5.9", health_delay_s=0.0, drop=("GET /server_info",))

    async def go() -> str:
        c = client(emu)
        return (await c.dialect(URL)).name

    assert asyncio.run(go()) == "sglang 0.5.9"
    assert [p for _, p, _ in emu.requests] == ["/server_info", "/get_server_info"]


def test_a_weight_version_route_gone_early_falls_back_to_model_info_once() -> None:
    """A copy between the two sides answers /get_weight_version 404 and /model_info: read there, and first after."""
    emu = SGLangEmulator("0.5.20", health_delay_s=0.0)
    emu.routes["GET /get_weight_version"] = RECORDED["eras"]["current"]["routes"]["GET /get_weight_version"]
    emu.routes["GET /model_info"] = RECORDED["eras"]["current"]["routes"]["GET /model_info"]

    async def go() -> list[str | None]:
        c = client(emu)
        return [await c.weight_version(URL), await c.weight_version(URL)]

    assert asyncio.run(go()) == ["default", "default"]
    assert routes_asked(emu, "/get_weight_version", "/model_info") == ["/get_weight_version", "/model_info",
                                                                       "/model_info"]


@pytest.mark.parametrize("version", ["0.5.9", "0.5.20", "0.5.21", "0.5.23"])
def test_a_streamed_error_is_the_error_the_unstreamed_answer_gives(version: str) -> None:
    """SGLang's data: {"error": ...} in a 200 stream raises what its 400 raises, after the tokens streamed so far."""
    emu = SGLangEmulator(version, health_delay_s=0.0)

    async def go() -> tuple[UpstreamError, UpstreamError, list[Chunk]]:
        c = client(emu)
        emu.fail_generate_after = 0
        with pytest.raises(UpstreamError) as plain:
            await c.generate(URL, dict(BODY))
        emu.fail_generate_after = 2
        deltas: list[Chunk] = []
        with pytest.raises(UpstreamStreamError) as streamed:
            await c.generate(URL, {**BODY, "stream": True}, deltas.append)
        return plain.value, streamed.value, deltas

    plain, streamed, deltas = asyncio.run(go())
    assert not isinstance(plain, UpstreamStreamError)
    assert (streamed.status, streamed.detail_body()) == (plain.status, plain.detail_body())
    assert plain.extra["engine_status"] == 400 and RECORDED["generate"]["error_message"] in plain.message + str(
        plain.extra["engine_detail"])
    assert sum(len(d.output_ids) for d in deltas) == 2


def test_a_legacy_engine_never_idle_is_not_loaded() -> None:
    """Up to 0.5.20 a load while a request runs kills SGLang's scheduler: without an idle flush, no load is sent."""
    emu = SGLangEmulator("0.5.14", health_delay_s=0.0)
    emu.busy_flushes = 10**6

    async def go() -> None:
        c = client(emu, control_timeout_s=0.3)
        with pytest.raises(UpstreamError, match="flush_cache before the load"):
            await c.update_weights(URL, "/ckpt/step-2", "2")

    asyncio.run(go())
    assert routes_asked(emu, "/update_weights_from_disk") == [] and not emu.crashed


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_live_updates_refuse_an_sglang_engine(version: str) -> None:
    """proxy.weight_updates: live cannot run on SGLang: the engine is not used and never counts as healthy."""
    emu = SGLangEmulator(version, health_delay_s=0.0)

    async def go() -> None:
        c = client(emu, live_updates=True)
        with pytest.raises(UpstreamUnavailable, match="weight_updates: live") as err:
            await c.generate(URL, dict(BODY))
        assert err.value.extra["connected"] is False  # nothing sent: the proxy may try another engine
        assert not await c.healthy(URL) and await c.load(URL, 1.0) is None
        with pytest.raises(UpstreamUnavailable):
            await c.update_weights(URL, "/ckpt/step-2", "2")

    asyncio.run(go())
    assert routes_asked(emu, "/generate", "/health", "/update_weights_from_disk") == []
