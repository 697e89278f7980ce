"""Generation controller against an in-process fake engine: preemption, resume, version checks."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
from proxy_fake_engine import FakeEngine, http_client
from waits import async_wait_for

from services.proxy.controller import WEIGHT_UPDATE, GenerationController
from services.proxy.engine_client import EngineClient
from services.proxy.errors import (
    GenerationPreempted,
    ProxyError,
    SpanExceeded,
    TrajectoryVersionChanged,
    UpstreamUnavailable,
)
from services.proxy.metrics import ProxyMetrics
from services.proxy.updater import WeightUpdater
from shared.schemas import WeightVersion

E1, E2 = "http://engine-1", "http://engine-2"
SAMPLING = {"temperature": 1.0, "stop_token_ids": []}


def make(engines: dict[str, FakeEngine | None], max_preempts: int | None = None,
         current: str | None = "a") -> GenerationController:
    client = EngineClient(list(engines), transport=http_client(engines))
    ctl = GenerationController(client, ProxyMetrics(), max_preempts, request_timeout_s=10, pause_timeout_s=5)
    ctl.current_version = current
    return ctl


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), 20))


async def update_midway(ctl: GenerationController, eng: FakeEngine, version: str, after_tokens: int = 5) -> None:
    """Wait until the engine produced a few tokens, then pause, load ``version`` and resume."""
    await async_wait_for(lambda: eng.produced >= after_tokens, what=f"{after_tokens} tokens before the update")
    updater = WeightUpdater(ctl, ctl.client, ctl.metrics)
    await updater.apply(WeightVersion(version=version, path=f"/ckpt/{version}", step=1, published_at=0.0))


def generate_across_update(ctl: GenerationController, eng: FakeEngine, partial: bool, max_new: int = 60) -> Any:
    """Run one generation during which version "b" is published; its result, or the error it raised."""
    async def flow() -> Any:
        task = asyncio.create_task(ctl.generate("s1", [], [1, 2, 3], max_new, SAMPLING, partial=partial))
        await update_midway(ctl, eng, "b")
        try:
            return await task
        except ProxyError as exc:
            return exc
    return run(flow)


def test_uninterrupted_generation_returns_all_tokens_with_engine_versions() -> None:
    eng = FakeEngine("a")
    ctl = make({E1: eng})
    gen = run(lambda: ctl.generate("s1", [], [1, 2, 3], 8, SAMPLING, partial=True))
    assert gen.output_ids == [4, 5, 6, 7, 8, 9, 10, 11]
    assert gen.versions == ["a"] * 8 and gen.logprobs == [-0.25] * 8
    assert gen.finish_reason == "length" and gen.preempts == 0
    assert eng.generate_bodies[0]["sampling_params"]["max_new_tokens"] == 8


def test_preempted_generation_resumes_from_prefix_with_remaining_budget_and_new_version() -> None:
    eng = FakeEngine("a", step_s=0.004)
    ctl = make({E1: eng})
    gen = generate_across_update(ctl, eng, partial=True)
    assert len(gen.output_ids) == 60 and gen.preempts == 1
    n_a = gen.versions.count("a")
    assert 0 < n_a < 60 and gen.versions == ["a"] * n_a + ["b"] * (60 - n_a)
    first, second = eng.generate_bodies
    assert first["rid"] != second["rid"]
    assert second["input_ids"] == [1, 2, 3, *gen.output_ids[:n_a]]  # continues from prompt + partial output
    assert second["sampling_params"]["max_new_tokens"] == 60 - n_a
    assert eng.updates == [{"model_path": "/ckpt/b", "weight_version": "b"}]
    assert first["rid"] in eng.aborts
    assert ctl.current_version == "b"


def test_span_limit_refuses_before_dispatching_the_resume_chunk() -> None:
    eng = FakeEngine("a", step_s=0.004)
    ctl = make({E1: eng}, max_preempts=0)
    err = generate_across_update(ctl, eng, partial=True)
    assert isinstance(err, SpanExceeded)
    assert err.detail() == {
        "error": "partial_rollout_staleness_exceeded",
        "message": "Partial rollout model version span exceeded limit; rejecting the trajectory instead of continuing it.",
        "versions": ["a", "b"], "version_span": 2, "version_switches": 1, "max_preempts": 0,
        "max_version_span": 1, "session_id": "s1"}
    assert len(eng.generate_bodies) == 1  # no compute spent on the refused continuation
    assert ctl.metrics.span_rejections._value.get() == 1


def test_span_limit_counts_earlier_turns_and_refuses_a_new_turn_before_any_compute() -> None:
    eng = FakeEngine("c")
    ctl = make({E1: eng}, max_preempts=1, current="c")
    with pytest.raises(SpanExceeded) as info:
        run(lambda: ctl.generate("s1", ["a", " b "], [1], 4, SAMPLING, partial=True))
    assert info.value.detail()["versions"] == ["a", "b", "c"]  # " b " normalised like everywhere else
    assert eng.generate_bodies == []
    gen = run(lambda: ctl.generate("s1", ["b"], [1], 4, SAMPLING, partial=True))  # span 2 <= 2: fine
    assert gen.versions == ["c"] * 4


def test_span_limit_post_check_catches_an_unannounced_version() -> None:
    eng = FakeEngine("z")  # the engine runs a version the proxy was never told about
    ctl = make({E1: eng}, max_preempts=0, current="a")
    with pytest.raises(SpanExceeded):
        run(lambda: ctl.generate("s1", ["a"], [1], 4, SAMPLING, partial=True))


def test_non_partial_preemption_fails_with_generation_preempted() -> None:
    eng = FakeEngine("a", step_s=0.004)
    ctl = make({E1: eng})
    err = generate_across_update(ctl, eng, partial=False)
    assert isinstance(err, GenerationPreempted)
    assert err.detail()["error"] == "generation_preempted" and err.detail()["partial_tokens"] > 0
    assert len(eng.generate_bodies) == 1


def test_non_partial_later_turn_on_a_new_version_is_rejected_before_dispatch() -> None:
    eng = FakeEngine("b")
    ctl = make({E1: eng}, current="b")
    with pytest.raises(TrajectoryVersionChanged) as info:
        run(lambda: ctl.generate("s1", ["a"], [1], 4, SAMPLING, partial=False))
    assert info.value.detail()["previous_versions"] == ["a"] and info.value.detail()["new_versions"] == ["b"]
    assert eng.generate_bodies == []


def test_operator_pause_suspends_then_resume_continues_keeping_partial_tokens() -> None:
    eng = FakeEngine("a", step_s=0.004)
    ctl = make({E1: eng})

    async def flow() -> Any:
        task = asyncio.create_task(ctl.generate("s1", [], [1], 40, SAMPLING, partial=True))
        await async_wait_for(lambda: eng.produced >= 5, what="tokens before the pause")
        paused = await ctl.pause(reason="test")
        assert paused["quiesced"] and paused["status"] == "paused"
        await async_wait_for(lambda: ctl.state()["suspended_generations"] == 1, what="the generation suspended")
        state = ctl.state()
        assert state["suspended_generations"] == 1 and state["active_generations"] == 0
        assert len(eng.generate_bodies) == 1  # nothing dispatched while paused
        resumed = await ctl.resume()
        assert resumed["status"] == "resumed" and resumed["epoch"] == 1
        return await task

    gen = run(flow)
    assert len(gen.output_ids) == 40 and gen.preempts == 1 and gen.versions == ["a"] * 40
    assert gen.chunks[0]["preempted"] and gen.chunks[0]["num_output_tokens"] > 0


def test_session_pause_only_preempts_that_session() -> None:
    eng = FakeEngine("a", step_s=0.004)
    ctl = make({E1: eng})

    async def flow() -> Any:
        t1 = asyncio.create_task(ctl.generate("s1", [], [1], 30, SAMPLING, partial=True))
        t2 = asyncio.create_task(ctl.generate("s2", [], [1], 30, SAMPLING, partial=True))
        await async_wait_for(lambda: eng.produced >= 4, what="both sessions generating")
        await ctl.pause(session_id="s1")
        g2 = await t2  # the other session is not paused
        assert not ctl.runnable("s1") and ctl.runnable("s2")
        await ctl.resume(session_id="s1")
        return await t1, g2

    g1, g2 = run(flow)
    assert g1.preempts == 1 and g2.preempts == 0 and len(g1.output_ids) == len(g2.output_ids) == 30


def test_weight_update_pause_and_operator_pause_are_independent_holders() -> None:
    ctl = make({E1: FakeEngine("a")})

    async def flow() -> None:
        await ctl.pause()
        await ctl.pause(WEIGHT_UPDATE)
        await ctl.resume(WEIGHT_UPDATE, version="b")
        assert not ctl.runnable("x") and ctl.current_version == "b"  # still held by the operator
        await ctl.resume()
        assert ctl.runnable("x")

    run(flow)


def test_sticky_routing_and_failover_when_the_first_engine_refuses_connections() -> None:
    e2 = FakeEngine("a")
    ctl = make({E1: None, E2: e2})
    sessions = [f"s{i}" for i in range(12)]
    firsts = {s: ctl.client.route(s)[0] for s in sessions}
    assert firsts == {s: ctl.client.route(s)[0] for s in sessions}  # stable
    assert set(firsts.values()) == {E1, E2}  # both engines get sessions
    for s in sessions:
        gen = run(functools.partial(ctl.generate, s, [], [1], 2, SAMPLING, partial=True))
        assert len(gen.output_ids) == 2  # sessions homed on the dead engine moved to the live one
    assert len(e2.generate_bodies) == len(sessions)


def test_all_engines_down_is_upstream_unavailable() -> None:
    ctl = make({E1: None, E2: None})
    with pytest.raises(UpstreamUnavailable) as info:
        run(lambda: ctl.generate("s1", [], [1], 2, SAMPLING, partial=True))
    assert info.value.status == 503 and info.value.detail()["error"] == "upstream_unavailable"
    assert ctl.state()["active_generations"] == 0


def test_failed_engine_load_still_resumes_and_is_reported() -> None:
    eng = FakeEngine("a")
    eng.fail_update = True
    ctl = make({E1: eng})
    updater = WeightUpdater(ctl, ctl.client, ctl.metrics)
    out = run(lambda: updater.apply(WeightVersion(version="b", path="/x", step=1, published_at=0.0)))
    assert out["engines"] == {"engine0": "failed: upstream_error"}
    assert ctl.runnable("s") and ctl.current_version == "a" and updater.applied is None


def test_updater_coalesces_versions_and_skips_engines_already_on_it() -> None:
    eng = FakeEngine("a")
    ctl = make({E1: eng})
    updater = WeightUpdater(ctl, ctl.client, ctl.metrics)

    async def flow() -> None:
        for v in ("1", "2", "3"):
            updater.submit(WeightVersion(version=v, path=f"/c{v}", step=int(v), published_at=0.0))
            await asyncio.sleep(0)  # "1" starts loading; "2" and "3" arrive meanwhile
        await updater.wait_idle()
        updater.submit(WeightVersion(version="3", path="/c3", step=3, published_at=0.0))
        await updater.wait_idle()

    run(flow)
    assert [u["weight_version"] for u in eng.updates] == ["1", "3"]  # "2" superseded while "1" loaded
    assert updater.applied == "3"


def test_operator_resume_without_version_asks_the_engines_what_they_run() -> None:
    eng = FakeEngine("a")
    ctl = make({E1: eng}, current="a")

    async def flow() -> None:
        await ctl.pause()
        eng.version = "c"  # a trainer loaded weights into the engine directly while paused
        await ctl.resume()

    run(flow)
    assert ctl.current_version == "c"


# -- generate_many: a group's first chunks in one engine request ----------------------------------

SIDS = ["g-s0", "g-s1", "g-s2"]


def many(ctl: GenerationController, max_new: int, partial: bool = True) -> Callable[[], Coroutine[Any, Any, Any]]:
    return lambda: ctl.generate_many(SIDS, [[], [], []], [1, 2, 3], max_new, [SAMPLING] * 3, partial, [None] * 3)


def test_generate_many_sends_one_batch_and_returns_each_generation_whole() -> None:
    eng = FakeEngine("a")
    ctl = make({E1: eng})
    gens = run(many(ctl, 8))
    assert eng.batch_sizes == [3] and len(eng.generate_bodies) == 3
    assert len({b["rid"] for b in eng.generate_bodies}) == 3  # a rid each: aborted one by one
    assert all(g.output_ids == [4, 5, 6, 7, 8, 9, 10, 11] and g.versions == ["a"] * 8 for g in gens)
    assert ctl.state()["active_generations"] == 0 and ctl.balancer.snapshot()["engine-0"] == {"in_flight": 0, "engine_load": 0, "sticky_sessions": 3}


def test_generate_many_members_preempted_by_an_update_each_resume_alone() -> None:
    eng = FakeEngine("a", step_s=0.004)
    ctl = make({E1: eng})

    async def flow() -> Any:
        task = asyncio.create_task(many(ctl, 60)())
        await update_midway(ctl, eng, "b", after_tokens=9)
        return await task

    gens = run(flow)
    assert eng.batch_sizes == [3] and len(eng.generate_bodies) == 6  # the batch, then three resumes alone
    for gen in gens:
        n_a = gen.versions.count("a")
        assert len(gen.output_ids) == 60 and gen.preempts == 1 and 0 < n_a < 60
        assert gen.versions == ["a"] * n_a + ["b"] * (60 - n_a)
    resumes = eng.generate_bodies[3:]
    assert all(b["input_ids"][:3] == [1, 2, 3] and not isinstance(b["input_ids"][0], list) for b in resumes)


def test_generate_many_non_partial_members_fail_alone_when_preempted() -> None:
    eng = FakeEngine("a", step_s=0.004)
    ctl = make({E1: eng})

    async def flow() -> Any:
        task = asyncio.create_task(many(ctl, 60, partial=False)())
        await update_midway(ctl, eng, "b", after_tokens=9)
        return await task

    assert all(isinstance(g, GenerationPreempted) for g in run(flow))


def test_generate_many_falls_back_to_one_request_each_when_the_batch_fails() -> None:
    e2 = FakeEngine("a")
    ctl = make({E1: None, E2: e2})
    ctl.balancer.assign(SIDS[0], E1)  # the batch goes to the engine that refuses connections
    gens = run(many(ctl, 4))
    assert all(len(g.output_ids) == 4 for g in gens)
    assert e2.batch_sizes == [] and len(e2.generate_bodies) == 3  # sent again alone, failed over
    assert ctl.state()["active_generations"] == 0


def test_generate_many_refuses_before_any_compute_when_a_member_is_past_its_span() -> None:
    eng = FakeEngine("b")
    ctl = make({E1: eng}, max_preempts=0, current="b")
    with pytest.raises(SpanExceeded):
        run(lambda: ctl.generate_many(SIDS, [[], ["a"], []], [1, 2, 3], 4, [SAMPLING] * 3, True, [None] * 3))
    assert eng.generate_bodies == []
