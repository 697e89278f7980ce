"""Live weight updates (``proxy.weight_updates: live``): no pause, no abort, tokens of both versions
in one rid, and a rid sent before an update judged against the version published when it was sent."""

from __future__ import annotations

import asyncio
from typing import Any

from proxy_fake_engine import FakeEngine
from test_proxy_engine_sync import setup, wv

from services.proxy.controller import Generation, GenerationController
from services.proxy.updater import WeightUpdater

E1 = "http://engine-1"
SAMPLING = {"temperature": 1.0, "stop_token_ids": []}


class Sink:
    """Streams, and keeps what it was fed (the caller's view of the stream)."""

    stream: bool = True
    keep: int | None = None

    def __init__(self) -> None:
        self.ids: list[int] = []

    def feed(self, ids: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]] | None) -> bool:
        self.ids += ids
        return False


def update_midway(live: bool, streamed: bool) -> tuple[Generation, FakeEngine, GenerationController, WeightUpdater,
                                                       list[int]]:
    eng = FakeEngine(version="1", step_s=0.003)
    ctl, updater = setup({E1: eng}, live=live)
    sink = Sink() if streamed else None

    async def flow() -> Generation:
        await updater.apply(wv("1"))
        task = asyncio.create_task(ctl.generate("s", [], [1, 2], 60, SAMPLING, partial=True, sink=sink))
        await eng.started.wait()
        await asyncio.sleep(0.03)  # a few tokens of version 1 first
        await updater.apply(wv("2"))
        return await task

    gen = asyncio.run(asyncio.wait_for(flow(), 20))
    return gen, eng, ctl, updater, sink.ids if sink else gen.output_ids


def test_live_update_neither_pauses_nor_aborts_and_one_rid_carries_both_versions() -> None:
    for streamed in (False, True):
        gen, eng, ctl, updater, delivered = update_midway(live=True, streamed=streamed)
        assert eng.aborts == [] and len(eng.generate_bodies) == 1, streamed  # one rid, never aborted
        assert len(gen.output_ids) == 60 and gen.preempts == 0 and delivered == gen.output_ids
        k = gen.versions.count("1")
        assert 0 < k < 60 and gen.versions == ["1"] * k + ["2"] * (60 - k)
        assert ctl.current_version == "2" and ctl.target == "2" and ctl.behind == set()
        assert updater.pause_seconds_total == 0 < updater.load_seconds_total and updater.last["live"]
        assert ctl.metrics.stale_chunks._value.get() == 0


def test_pause_mode_still_aborts_and_resumes_from_the_tokens_held() -> None:
    gen, eng, ctl, updater, _ = update_midway(live=False, streamed=False)
    assert len(eng.aborts) == 1 and len(eng.generate_bodies) == 2 and gen.preempts == 1
    assert len(gen.output_ids) == 60 and updater.pause_seconds_total > 0 and not updater.last["live"]


def test_a_rid_is_stale_only_against_the_version_published_when_it_was_sent() -> None:
    eng = FakeEngine(version="7")
    live, _ = setup({E1: eng}, live=True)
    live.set_target("8")
    live.current_version = "8"
    assert live.learn(E1, "7", floor="7")  # sent under 7, ended before the swap: current for it
    assert live.current_version == "8" and live.behind == set()  # never moved back
    assert not live.learn(E1, "6", floor="7") and live.behind == {E1}  # older than its own floor: stale

    paused, _ = setup({E1: FakeEngine(version="7")}, live=False)
    paused.set_target("8")
    assert not paused.learn(E1, "7", floor="7") and paused.behind == {E1}  # pause mode: the target decides


def test_live_non_partial_chunks_do_not_opt_in_to_running_across_a_swap() -> None:
    bodies: dict[bool, list[dict[str, Any]]] = {}
    for live in (False, True):
        eng = FakeEngine(version="1", stop_after=3)
        ctl, _ = setup({E1: eng}, live=live)
        for partial in (True, False):
            asyncio.run(ctl.generate(f"s-{partial}", [], [1], 5, SAMPLING, partial=partial))
        bodies[live] = eng.generate_bodies
    assert [b["continue_across_weight_updates"] for b in bodies[False]] == [True, True]
    assert [b["continue_across_weight_updates"] for b in bodies[True]] == [True, False]
