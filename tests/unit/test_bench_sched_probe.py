"""bench/sched_probe.py: the schedstat arithmetic on hand-computed series (no processes sampled)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "sched_probe.py"
_spec = importlib.util.spec_from_file_location("sched_probe", _PATH)
assert _spec is not None and _spec.loader is not None
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_counters_are_interpolated_between_samples():
    series = [(10.0, 0, 0), (11.0, 1_000_000_000, 200_000_000)]
    assert probe._at(series, 10.5) == pytest.approx((0.5, 0.1))
    assert probe._at(series, 11.0) == pytest.approx((1.0, 0.2))


def test_a_thread_adds_nothing_outside_its_life():
    series = [(10.0, 0, 0), (11.0, 1_000_000_000, 200_000_000)]
    assert probe._at(series, 5.0) is None  # born after t: counted from zero
    assert probe._at(series, 20.0) == pytest.approx((1.0, 0.2))  # ended before t: its last values


def _metrics(run: Path, steps: list[tuple[float, float]]) -> None:
    run.mkdir(parents=True)
    rows = [{"service": "ops", "ts": 1.0}] + [
        {"service": "trainer", "ts": ts, "train/step": i + 1, "time/wall_s": wall}
        for i, (ts, wall) in enumerate(steps)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_trainer_window_runs_from_the_first_step_start_to_the_last_step_end(tmp_path):
    _metrics(tmp_path / "v" / "seed0", [(12.0, 2.0), (13.0, 1.0), (14.0, 1.0)])
    assert probe.trainer_window(tmp_path / "v" / "seed0") == (10.0, 14.0)
    _metrics(tmp_path / "v" / "seed1", [(12.0, 2.0)])
    assert probe.trainer_window(tmp_path / "v" / "seed1") is None  # one step is no window


def test_window_rows_cut_each_thread_to_the_trainer_window(tmp_path):
    run = tmp_path / "async" / "seed3"
    _metrics(run, [(12.0, 2.0), (14.0, 2.0)])  # window 10 .. 14 s
    s = probe.Sampler()
    main, commit, redis = (1, 1), (1, 2), (2, 2)
    s.labels = {
        main: (str(run), "trainer", "main", "normal"),
        commit: (str(run), "trainer", "other", "normal"),
        redis: (str(run), "redis-server", "main", "normal"),
    }
    gs = 1_000_000_000
    s.series[main] = [(8.0, 0, 0), (10.0, 1 * gs, 0), (14.0, 4 * gs, 1 * gs)]  # 3 s on a CPU, 1 s waiting
    s.series[commit] = [(12.0, 0, 0), (13.0, gs // 2, 0)]  # born and gone inside the window
    s.series[redis] = [(9.0, 0, 0), (11.0, 2 * gs, 0), (15.0, 2 * gs, 0)]  # 1 s of its 2 inside the window
    rows = {(r["service"], r["thread"]): r for r in probe.window_rows(s)}
    assert rows[("trainer", "main")]["cpu_per_s"] == pytest.approx(0.75)
    assert rows[("trainer", "main")]["wait_per_s"] == pytest.approx(0.25)
    assert rows[("trainer", "other")]["cpu_per_s"] == pytest.approx(0.125)
    assert rows[("redis-server", "main")]["cpu_per_s"] == pytest.approx(0.25)
    assert {r["variant"] for r in rows.values()} == {"async"}
    line = probe.headline(list(rows.values()))
    assert "async 0.250 s/s" in line and "0.38 cores" in line


def test_the_run_folder_is_read_from_a_service_command_line():
    cmd = "python -m services trainer --config runs/experiments/x/sync/seed0/config.yaml"
    assert probe.RUN_DIR.search(cmd).group(1) == "runs/experiments/x/sync/seed0"
    up = "python -m services up --run-dir runs/experiments/x/sync/seed0 --config other.yaml"
    assert probe.RUN_DIR.search(up).group(1) == "runs/experiments/x/sync/seed0"
