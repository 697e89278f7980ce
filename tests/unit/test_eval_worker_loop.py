"""``run_worker``'s restart rule on scripted rq loops: only a stop or a drained burst ends it; a quit is waited out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from rq.exceptions import StopRequested

from services.eval_worker import worker as worker_module
from services.eval_worker.admission import JobPolicy
from services.eval_worker.worker import build_worker, run_worker
from shared.keys import Keys

Step = Callable[["Scripted"], None]


class Scripted(worker_module.EvalWorker):
    """An ``EvalWorker`` whose rq loop is replaced by scripted steps (each one call of ``work``)."""

    steps: list[Step]
    names: list[str]

    def work(self, burst: bool = False, **kwargs: Any) -> bool:
        assert self.in_loop
        self.names.append(self.name)
        self.steps.pop(0)(self)
        return True


def quits(w: Scripted) -> None:  # rq logged "unhandled exception, quitting" and returned
    pass


def stops(w: Scripted) -> None:
    w.stop_wanted = True


def drains(w: Scripted) -> None:
    w.drained = True


def cannot_register(w: Scripted) -> None:
    raise redis.ConnectionError("Connection refused")


def scripted(tmp_path: Path, *steps: Step) -> Scripted:
    built = build_worker(fakeredis.FakeRedis(), Keys("t"), "q", "ev", 15.0,
                         policy=JobPolicy(checkpoint_root=str(tmp_path), data_root=str(tmp_path)))
    built.__class__ = Scripted
    w: Scripted = built  # type: ignore[assignment]  # reclassed above: same object, scripted loop
    w.steps, w.names = list(steps), []
    return w


class Clock:
    """Stands in for the ``time`` module inside ``worker_module``: records sleeps, scripted ``monotonic``."""

    def __init__(self) -> None:
        self.slept: list[float] = []
        self.now: list[float] = []

    def sleep(self, delay: float) -> None:
        self.slept.append(delay)

    def monotonic(self) -> float:
        return self.now.pop(0) if self.now else 0.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(worker_module, "time", fake)
    return fake


@pytest.fixture
def delays(clock: Clock) -> list[float]:
    return clock.slept


def test_a_stop_ends_it_at_once(tmp_path: Path, delays: list[float]) -> None:
    w = scripted(tmp_path, stops)
    assert run_worker(w, burst=False) == 0
    assert len(w.names) == 1 and delays == [] and not w.in_loop


def test_a_drained_burst_ends_it(tmp_path: Path, delays: list[float]) -> None:
    w = scripted(tmp_path, drains)
    assert run_worker(w, burst=True) == 0 and len(w.names) == 1 and delays == []


def test_a_quit_is_waited_out_and_the_loop_restarts_under_a_fresh_name(tmp_path: Path, delays: list[float]) -> None:
    w = scripted(tmp_path, quits, stops)
    assert run_worker(w, burst=False) == 0
    assert len(w.names) == 2 and w.names[0] != w.names[1] and w.names[1].startswith("t-ev-")
    assert delays == [0.1]


def test_a_burst_that_quit_before_draining_goes_on(tmp_path: Path, delays: list[float]) -> None:
    w = scripted(tmp_path, quits, drains)
    assert run_worker(w, burst=True) == 0 and len(w.names) == 2


def test_repeated_quits_back_off_up_to_the_cap(tmp_path: Path, delays: list[float]) -> None:
    w = scripted(tmp_path, quits, cannot_register, quits, quits, quits, stops)
    assert run_worker(w, burst=False, backoff_max_s=0.5) == 0
    assert delays == [0.1, 0.2, 0.4, 0.5, 0.5]  # a Redis error at registration counts like any quit


def test_a_long_healthy_loop_resets_the_backoff(tmp_path: Path, clock: Clock) -> None:
    clock.now = [0.0, 1.0, 2.0, 3.0, 10.0, 10.0 + worker_module.HEALTHY_RUN_S, 200.0, 201.0]  # loop start, end
    w = scripted(tmp_path, quits, quits, quits, stops)
    assert run_worker(w, burst=False) == 0
    assert clock.slept == [0.1, 0.2, 0.1]  # the third loop ran HEALTHY_RUN_S: its quit is a new fault


def test_a_stop_while_waiting_for_redis_ends_it(tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    w = scripted(tmp_path, quits)

    def signal_arrives(delay: float) -> None:
        w.request_stop(15, None)  # rq's handler is still installed; the loop is not running

    monkeypatch.setattr(clock, "sleep", signal_arrives)
    assert run_worker(w, burst=False) == 0 and w.stop_wanted and len(w.names) == 1


def test_request_stop_between_loops_never_asks_redis(tmp_path: Path) -> None:
    w = scripted(tmp_path)
    w.connection.connection_pool.disconnect()
    w.connection = None  # any Redis call would fail
    with pytest.raises(StopRequested):
        w.request_stop(15, None)
    assert w.stop_wanted
