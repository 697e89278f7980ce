"""The time decomposition: phase clock arithmetic and the fractions read back from metric rows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.phases import PhaseClock, PhaseNesting
from tools.monitor.probes import cpu_by_service, cpu_seconds, parent_pid, process_children
from tools.reports.timing import columns, decompose, one_line, summary_pairs


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_and_other_sum_to_the_wall_clock() -> None:
    t = FakeClock()
    clock = PhaseClock(("wait", "train"), clock=t)
    with clock.phase("wait"):
        t.now += 3.0
    t.now += 0.5  # outside every phase: "other"
    with clock.phase("train"):
        t.now += 6.0
    with clock.phase("wait"):
        t.now += 1.0
    snap = clock.snapshot()
    assert snap == {"time/wait_s": 4.0, "time/train_s": 6.0, "time/other_s": 0.5, "time/wall_s": 10.5}


def test_a_phase_inside_a_phase_and_an_unknown_phase_are_refused() -> None:
    clock = PhaseClock(("wait", "train"), clock=FakeClock())
    with pytest.raises(PhaseNesting), clock.phase("wait"), clock.phase("train"):
        pass
    with pytest.raises(KeyError, match="publish"), clock.phase("publish"):
        pass


def test_a_phase_that_raises_still_counts_its_time() -> None:
    t = FakeClock()
    clock = PhaseClock(("train",), clock=t)
    with pytest.raises(RuntimeError), clock.phase("train"):
        t.now += 2.0
        raise RuntimeError("boom")
    assert clock.seconds["train"] == 2.0


def rows() -> list[dict[str, object]]:
    return [
        {"service": "ops", "ts": 1000.0, "engine/busy_s": 10.0, "proxy/weight_update_s": 1.0, "proxy/weight_updates": 2},
        {"service": "trainer", "ts": 1010.0, "train/step": 1, "time/wait_s": 1.0, "time/train_s": 2.0,
         "time/checkpoint_s": 0.5, "time/publish_s": 0.5, "time/other_s": 0.0, "time/wall_s": 4.0},
        {"service": "rollout-worker", "ts": 1020.0, "rollout/group_seconds": 10.0},
        {"service": "rollout-worker", "ts": 1030.0, "rollout/group_seconds": 22.0},
        {"service": "trainer", "ts": 1040.0, "train/step": 2, "time/wait_s": 4.0, "time/train_s": 12.0,
         "time/checkpoint_s": 1.0, "time/publish_s": 2.0, "time/other_s": 1.0, "time/wall_s": 20.0},
        {"service": "ops", "ts": 1050.0, "engine/busy_s": 40.0, "proxy/weight_update_s": 2.0, "proxy/weight_updates": 5},
    ]


def test_fractions_come_from_the_newest_trainer_row_and_the_sampled_clocks() -> None:
    split = decompose(rows(), slots=4)
    assert split.trainer_wall_s == 20.0
    assert split.trainer == {"wait": 0.2, "train": 0.6, "checkpoint": 0.05, "publish": 0.1, "other": 0.05}
    assert split.explained() == pytest.approx(0.95)
    assert split.engine_busy == pytest.approx(30.0 / 50.0)  # (40 - 10) busy seconds over 50 s
    assert split.engine_idle == pytest.approx(0.4)
    assert split.proxy_pause == pytest.approx(1.0 / 50.0)
    assert split.weight_updates == 5
    assert split.publication_pause == pytest.approx(0.05 + 0.1 + 0.02)
    assert split.group_seconds_mean == 16.0
    assert split.worker_slot_busy == pytest.approx(32.0 / (4 * 20.0))  # over the trainer loop, 1020..1040 s


def test_no_data_gives_none_not_zero() -> None:
    split = decompose([{"service": "prompt-buffer", "ts": 1.0}])
    assert split.trainer == {} and split.engine_busy is None and split.publication_pause is None
    cols = columns(split)
    assert cols["trainer_wait_frac"] is None and cols["engine_busy_frac"] is None
    assert one_line(split) == "no timing data yet"
    assert dict(summary_pairs(split))["trainer wall-clock (loop)"] == "-"


def test_summary_lines_show_percentages() -> None:
    pairs = dict(summary_pairs(decompose(rows(), slots=4)))
    assert pairs["trainer wait (waiting for a batch)"] == "20.0 %"
    assert pairs["engine busy / idle"] == "60.0 % / 40.0 %"
    line = one_line(decompose(rows()))  # dressage status: no slots needed for any of it
    assert "trainer wait 20%" in line and "engine busy 60% idle 40%" in line
    assert "workers wait 16.00s per group on the proxy" in line


def test_the_rollout_chain_is_averaged_over_the_loop_only() -> None:
    # the trainer loop ran from 1020 to 1040 s (its last row: wall 20 s at 1040)
    chain = [{"service": "prompt-buffer", "ts": 1025.0, "prompt_buffer/admit_lag_s": 0.004},
             {"service": "prompt-buffer", "ts": 1035.0, "prompt_buffer/admit_lag_s": 0.008},
             {"service": "prompt-buffer", "ts": 1015.0, "prompt_buffer/admit_lag_s": 9.0},  # before the loop
             {"service": "group-collector", "ts": 1035.0, "staleness/time_prompt_queue_s_max": 0.005,
              "staleness/time_rollout_s_max": 0.050}]
    split = decompose(rows() + chain)
    assert split.chain == pytest.approx({"admit_lag": 0.006, "batch_queue_max": 0.005, "batch_rollout_max": 0.050})
    cols = columns(split)
    assert cols["admit_lag_ms"] == pytest.approx(6.0) and cols["batch_rollout_max_ms"] == pytest.approx(50.0)
    assert columns(decompose(rows()))["admit_lag_ms"] is None  # not measured: blank, never 0
    pairs = dict(summary_pairs(split))
    assert pairs["rollout chain per batch: admission after a publication / slowest group's queue / its rollout"] \
        == "6.0 ms / 5.0 ms / 50.0 ms"


def test_engine_fraction_covers_only_the_trainer_loop() -> None:
    # samples long before the trainer started and long after it ended (start-up, final eval) are left out
    extra = [{"service": "ops", "ts": 900.0, "engine/busy_s": 0.0},
             *rows(), {"service": "ops", "ts": 1200.0, "engine/busy_s": 190.0}]
    assert decompose(extra).engine_busy == pytest.approx(30.0 / 50.0)


def test_engine_fraction_interpolates_the_counter_at_the_loop_ends() -> None:
    # loop from 1010 to 1030; engine counter sampled at 1000 (0 s), 1020 (10 s) and 1040 (30 s):
    # interpolated 5 s at 1010 and 20 s at 1030 -> 15 busy seconds over 20 s
    rows = [{"service": "ops", "ts": 1000.0, "engine/busy_s": 0.0},
            {"service": "ops", "ts": 1020.0, "engine/busy_s": 10.0},
            {"service": "trainer", "ts": 1030.0, "train/step": 1, "time/wait_s": 5.0, "time/train_s": 15.0,
             "time/checkpoint_s": 0.0, "time/publish_s": 0.0, "time/other_s": 0.0, "time/wall_s": 20.0},
            {"service": "ops", "ts": 1040.0, "engine/busy_s": 30.0}]
    assert decompose(rows).engine_busy == pytest.approx(15.0 / 20.0)


def test_cpu_seconds_from_proc_stat_and_replicas_summed(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    for pid, (utime, stime) in {11: (3 * ticks, ticks), 12: (ticks, 0), 13: (2 * ticks, 2 * ticks)}.items():
        (tmp_path / str(pid)).mkdir()
        rest = " ".join(["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python -m x) {rest}\n")
    assert cpu_seconds(11, tmp_path) == 4.0 and cpu_seconds(99, tmp_path) is None
    pids = {"engine": 11, "rollout-worker-1": 12, "rollout-worker-2": 13, "gone": 99}
    assert cpu_by_service(pids, tmp_path) == {"cpu/engine_s": 4.0, "cpu/rollout-worker_s": 5.0}


def test_cpu_seconds_count_the_children_a_service_started_live_and_reaped(tmp_path: Path) -> None:
    """An rq eval worker computes in forked work horses: their CPU is the eval worker's."""
    ticks = os.sysconf("SC_CLK_TCK")

    def stat(pid: int, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> None:
        (tmp_path / str(pid)).mkdir()
        rest = " ".join(["S", str(ppid)] + ["0"] * 9 + [str(v * ticks) for v in (utime, stime, cutime, cstime)]
                        + ["0"] * 30)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python -m x) {rest}\n")

    stat(20, 1, 1, 0, cutime=6, cstime=1)  # the worker: 1 s itself, 7 s in horses already reaped
    stat(21, 20, 2, 1)  # the live work horse
    stat(22, 21, 1, 0)  # something the horse started
    stat(30, 1, 5, 0)  # another service: not a child
    (tmp_path / "self").mkdir()  # non-pid entries of /proc are skipped
    assert cpu_seconds(20, tmp_path) == 1 + 7 + 3 + 1
    assert parent_pid(22, tmp_path) == 21 and parent_pid(99, tmp_path) is None
    assert {k: sorted(v) for k, v in process_children(tmp_path).items()} == {1: [20, 30], 20: [21], 21: [22]}
    assert cpu_by_service({"eval-worker": 20, "engine": 30}, tmp_path) == {"cpu/eval-worker_s": 12.0,
                                                                             "cpu/engine_s": 5.0}


def test_cores_used_per_service_over_the_loop() -> None:
    extra = [{**r, "cpu/engine_s": 5.0 + (float(r["ts"]) - 1000.0) * 0.5,  # type: ignore[arg-type]  # ts is a float
              "cpu/trainer_s": 1.0 + (float(r["ts"]) - 1000.0) * 0.8}  # type: ignore[arg-type]  # ts is a float
             if r["service"] == "ops" else r for r in rows()]
    split = decompose(extra)
    assert split.cores == {"engine": pytest.approx(0.5), "trainer": pytest.approx(0.8)}
    cols = columns(split)
    assert cols["cores_engine"] == pytest.approx(0.5) and cols["cores_total"] == pytest.approx(1.3)
    assert cols["cores_rollout_worker"] is None
