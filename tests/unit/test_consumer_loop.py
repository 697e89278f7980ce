"""The consumer-loop shell: burst ends at quiescence, outages back off and recover, a stop ends it."""

from __future__ import annotations

import pytest
import redis

from shared.consumer import ConsumerLoop
from shared.lifecycle import StopFlag


def test_burst_ends_when_the_step_finds_nothing_more() -> None:
    results = iter([True, True, False, True])
    calls: list[int] = []

    def step() -> bool:
        calls.append(1)
        return next(results)

    ConsumerLoop("t", StopFlag(), backoff_max_s=1.0).run(step, burst=True)
    assert len(calls) == 3


def test_without_burst_idle_runs_when_nothing_is_waiting_and_stop_ends_the_loop() -> None:
    stop = StopFlag()
    idles: list[int] = []

    def idle() -> None:
        idles.append(1)
        if len(idles) == 2:
            stop.set()

    ConsumerLoop("t", stop, backoff_max_s=1.0).run(lambda: False, burst=False, idle=idle)
    assert len(idles) == 2


def test_outage_waits_a_growing_capped_delay_recovers_and_resets_after_success() -> None:
    stop = StopFlag()
    loop = ConsumerLoop("t", stop, backoff_max_s=0.4)
    waits: list[float] = []

    def record(timeout: float | None = None) -> bool:  # record the delay instead of sleeping it
        waits.append(timeout or 0.0)
        return False

    stop.wait = record  # type: ignore[method-assign]  # a test double for the wait
    outcomes: list[object] = [redis.ConnectionError("down"), redis.TimeoutError("slow"), redis.ConnectionError("x"),
                              redis.ConnectionError("y"), True, redis.ConnectionError("z"), False]
    recovered: list[int] = []

    def step() -> bool:
        o = outcomes.pop(0)
        if isinstance(o, Exception):
            raise o
        return bool(o)

    loop.run(step, burst=True, recover=lambda: recovered.append(1))
    assert waits == [0.1, 0.2, 0.4, 0.4, 0.1]  # doubling up to backoff_max_s; reset by the success
    assert len(recovered) == 5 and not outcomes


def test_recover_failing_is_waited_out_like_the_step() -> None:
    stop = StopFlag()
    loop = ConsumerLoop("t", stop, backoff_max_s=1.0)
    stop.wait = lambda timeout=None: False  # type: ignore[method-assign]  # no sleeping in a unit test
    steps = iter([redis.ConnectionError("a"), redis.ConnectionError("b"), False])
    recoveries = iter([redis.ConnectionError("still down"), None])

    def step() -> bool:
        o = next(steps)
        if isinstance(o, Exception):
            raise o
        return o

    def recover() -> None:
        o = next(recoveries)
        if o is not None:
            raise o

    loop.run(step, burst=True, recover=recover)
    assert loop.backoff.next() == 0.1  # the final success reset the delay


def test_other_errors_propagate_and_done_ends_the_loop() -> None:
    loop = ConsumerLoop("t", StopFlag(), backoff_max_s=1.0)
    with pytest.raises(ValueError):
        loop.run(lambda: (_ for _ in ()).throw(ValueError("bug")), burst=False)
    count: list[int] = []

    def step() -> bool:
        count.append(1)
        return True

    loop.run(step, burst=False, done=lambda: len(count) >= 3)
    assert len(count) == 3


def test_a_lost_consumer_group_is_re_created_and_the_loop_goes_on() -> None:
    """NOGROUP (Redis back without its data) calls regroup() and keeps the loop alive."""
    outcomes: list[object] = [redis.ResponseError("NOGROUP No such key 'p:batches' or consumer group 'trainer'"),
                              True, False]
    regroups: list[int] = []

    def step() -> bool:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return bool(out)

    ConsumerLoop("t", StopFlag(), backoff_max_s=1.0).run(step, burst=True, regroup=lambda: regroups.append(1))
    assert regroups == [1] and outcomes == []


def test_any_other_response_error_propagates_even_with_regroup() -> None:
    def step() -> bool:
        raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        ConsumerLoop("t", StopFlag(), backoff_max_s=1.0).run(step, burst=True, regroup=lambda: None)
