"""The adaptive window's Redis shell on fakeredis: what it measures, what it writes, what it logs."""

from __future__ import annotations

import fakeredis
import pytest

from services.window_controller.loop import WindowController
from services.window_controller.signals import SignalReader, wait_fraction
from shared import stats
from shared.config import WindowControllerConfig
from shared.keys import Keys
from shared.telemetry import report_metrics

CFG = WindowControllerConfig(enabled=True, min_keep=1, max_keep=4, target_logprob_diff=0.1, patience=1,
                             cooldown=0, interval_s=0.01)


def trainer_step(r: fakeredis.FakeRedis, keys: Keys, diff: float, wait_s: float, wall_s: float) -> None:
    report_metrics(r, keys, "trainer", {"train/train_rollout_logprob_abs_diff": diff, "time/wait_s": wait_s,
                                        "time/wall_s": wall_s, "train/step": 1})


def counts(r: fakeredis.FakeRedis, keys: Keys, dropped: int, batched: int) -> None:
    r.hset(stats.key(keys), mapping={stats.GROUPS_DROPPED_STALE: dropped, stats.GROUPS_BATCHED: batched})


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def test_signals_cover_only_what_happened_since_the_previous_read(r: fakeredis.FakeRedis) -> None:
    keys = Keys("t")
    trainer_step(r, keys, 9.0, 0.0, 1.0)  # history before the start is never acted on
    reader = SignalReader(r, keys)
    first = reader.read()
    assert (first.steps, first.logprob_diff, first.drop_rate) == (0, None, None)
    trainer_step(r, keys, 0.2, 1.0, 10.0)
    report_metrics(r, keys, "group-collector", {"staleness/keep_versions": 2})  # other services: ignored
    trainer_step(r, keys, 0.4, 4.0, 20.0)
    counts(r, keys, 3, 9)
    s = reader.read()
    assert s.steps == 2 and s.logprob_diff == pytest.approx(0.3)
    assert s.wait_fraction == pytest.approx((4.0 - 1.0) / (20.0 - 10.0))  # history unseen: first new step
    assert s.drop_rate == pytest.approx(3 / 12)
    trainer_step(r, keys, 0.1, 4.5, 30.0)
    counts(r, keys, 3, 13)
    s = reader.read()
    assert s.wait_fraction == pytest.approx(0.5 / 10.0)  # from the last step seen before
    assert s.drop_rate == 0.0 and s.steps == 1


def test_wait_fraction_of_a_restarted_trainer_uses_its_new_steps_only() -> None:
    before = {"time/wait_s": "50", "time/wall_s": "100"}
    rows = [{"time/wait_s": "1", "time/wall_s": "2"}, {"time/wait_s": "2", "time/wall_s": "6"}]
    assert wait_fraction(before, rows) == pytest.approx(0.25)
    assert wait_fraction(before, rows[:1]) is None and wait_fraction(None, []) is None


def test_controller_writes_the_operator_control_key_and_logs_every_decision_with_inputs(
        r: fakeredis.FakeRedis) -> None:
    keys = Keys("t")
    ctl = WindowController(r, keys, CFG, default_keep=3)
    ctl.start()
    assert r.hget(keys.control, "keep_versions") == b"3"
    trainer_step(r, keys, 0.5, 0.1, 10.0)  # diff far above the target, trainer well fed
    counts(r, keys, 0, 8)
    d = ctl.tick()
    assert (d.before, d.after, d.reason) == (3, 2, "logprob_diff_high")
    assert r.hget(keys.control, "keep_versions") == b"2"
    (_, rec), = r.xrange(keys.window_controller_decisions)
    assert rec[b"keep_before"] == b"3" and rec[b"keep_after"] == b"2" and rec[b"reason"] == b"logprob_diff_high"
    assert float(rec[b"logprob_diff"]) == pytest.approx(0.5) and rec[b"trainer_steps"] == b"1"


def test_an_ess_steered_controller_tightens_on_the_ess_and_logs_all_three_measures(
        r: fakeredis.FakeRedis) -> None:
    keys = Keys("t")
    ctl = WindowController(r, keys, CFG.model_copy(update={"signal": "ess", "target_ess": 0.9}), default_keep=3)
    ctl.start()
    for ess_value in (0.5, 0.7):  # mean 0.6: a deficit of 0.4 against a target of 0.1; the diff is in band
        report_metrics(r, keys, "trainer", {"train/train_rollout_logprob_abs_diff": 0.1, "train/ess": ess_value,
                                            "train/mismatch_kl": 0.3, "time/wait_s": 0.1, "time/wall_s": 10.0})
    counts(r, keys, 0, 8)
    d = ctl.tick()
    assert (d.before, d.after, d.reason) == (3, 2, "ess_deficit_high")
    (_, rec), = r.xrange(keys.window_controller_decisions)
    assert rec[b"signal"] == b"ess_deficit" and float(rec[b"drift"]) == pytest.approx(0.4)
    assert float(rec[b"target"]) == pytest.approx(0.1) and float(rec[b"ess"]) == pytest.approx(0.6)
    assert float(rec[b"mismatch_kl"]) == pytest.approx(0.3) and float(rec[b"logprob_diff"]) == pytest.approx(0.1)


def test_controller_follows_an_operator_override_and_restores_a_value_it_cannot_keep(
        r: fakeredis.FakeRedis) -> None:
    keys = Keys("t")
    ctl = WindowController(r, keys, CFG, default_keep=2)
    ctl.start()
    r.hset(keys.control, "keep_versions", "4")
    ctl.tick()  # no trainer step: hold, but at the operator's window
    assert ctl.state.keep == 4 and r.hget(keys.control, "keep_versions") == b"4"
    r.hset(keys.control, "keep_versions", "0")  # off is not a window the controller keeps
    ctl.tick()
    assert r.hget(keys.control, "keep_versions") == b"4"


def test_start_takes_over_a_live_operator_window(r: fakeredis.FakeRedis) -> None:
    keys = Keys("t")
    r.hset(keys.control, "keep_versions", "1")
    ctl = WindowController(r, keys, CFG, default_keep=3)
    ctl.start()
    assert ctl.state.keep == 1


def test_burst_decides_once_on_the_recorded_steps_and_exits(r: fakeredis.FakeRedis) -> None:
    keys = Keys("t")
    trainer_step(r, keys, 0.5, 0.1, 10.0)
    ctl = WindowController(r, keys, CFG, default_keep=3, burst=True)
    assert ctl.run() == 0
    assert r.hget(keys.control, "keep_versions") == b"2" and r.xlen(keys.window_controller_decisions) == 1
