"""``dressage experiment`` end to end on a tiny spec (2 variants × 2 seeds × 2 trainer steps, real services).

The runner is SIGKILLed while its second run is going (its ``dressage up`` keeps running, orphaned),
then started again with ``--jobs 2``: the finished run is skipped, the interrupted one is stopped and
run again from scratch, two runs go at once (own prefixes, Redis servers and ports), and summary.csv
ends with exactly one row per run, each naming the model build it started from. On the recorded runs the trainer's four
phases (waiting for a batch, training, checkpointing, publishing) account for its wall-clock
within 5 % (or 60 ms a step on a loaded machine).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from paths import REPO
from waits import wait_for

from tools.experiments.build import model_build


def tiny_spec(tmp_path: Path, model: Path) -> Path:
    spec = {
        "name": "tiny", "base": str(REPO / "configs/test.yaml"), "baseline": "sync", "seeds": [0, 1],
        "stop": {"steps": 2}, "targets": [0.5],
        "overrides": {"model.path": str(model), "eval.every_versions": 0, "ops.workers": 1},
        "variants": {"sync": {"pacing.max_versions_ahead": 0, "staleness.keep_versions": 0},
                     "async": {"pacing.max_versions_ahead": 1}},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def start(spec: Path, out: Path, log: Path, jobs: int = 1) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "services", "experiment", str(spec), "--out", str(out),
                                 "--quiet", "--jobs", str(jobs)], cwd=REPO, env=env, stdout=fh,
                                stderr=subprocess.STDOUT)




@pytest.mark.timeout(1800)  # five bounded `dressage up` runs: ~5 min at load 12 on 2 cores, far more at 40
def test_killed_experiment_resumes_without_duplicates_and_time_adds_up(tmp_path: Path, model_dir: Path) -> None:
    spec, out, log = tiny_spec(tmp_path, model_dir), tmp_path / "experiments", tmp_path / "runner.log"
    root = out / "tiny"
    first, second = root / "sync" / "seed0", root / "async" / "seed0"  # runs go seed by seed
    proc = start(spec, out, log)
    try:
        wait_for(lambda: (first / "result.json").exists() and (second / "child.json").exists(), 400,
                 "the first run done, the second started", process=proc, why=lambda: log.read_text()[-3000:],
                 period=0.5)
        orphan = json.loads((second / "child.json").read_text())["pid"]
        proc.send_signal(signal.SIGKILL)  # the runner dies; its dressage up of async/seed0 keeps going
        proc.wait(10)
        finished_once = (first / "result.json").read_text()
        assert not (second / "result.json").exists()
        proc = start(spec, out, log, jobs=2)  # the three runs left, two at a time
        assert proc.wait(900) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (first / "result.json").read_text() == finished_once  # skipped, not run again
    spans = []  # (start, end) of each run the resumed runner made
    for run in (second, root / "sync" / "seed1", root / "async" / "seed1"):
        res = json.loads((run / "result.json").read_text())
        spans.append((res["finished_at"] - res["duration_s"], res["finished_at"]))
    spans.sort()
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), spans  # two at a time
    assert not (second / "child.json").exists()  # settled: the re-run finished
    with pytest.raises(ProcessLookupError):
        os.kill(orphan, 0)  # the orphaned run was stopped before its folder was reused
    build = model_build(model_dir)
    assert build is not None
    with (root / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert sorted((r["variant"], r["seed"]) for r in rows) == [("async", "0"), ("async", "1"), ("sync", "0"),
                                                               ("sync", "1")]
    for r in rows:
        assert float(r["steps"]) == 2 and float(r["wall_to_k_s"]) > 0
        phases = sum(float(r[f"trainer_{p}_frac"]) for p in ("wait", "train", "checkpoint", "publish"))
        assert phases <= 1.0 + 1e-6 and abs(phases + float(r["trainer_other_frac"]) - 1.0) < 1e-3, r
        # what falls outside the four phases is the loop's bookkeeping (heartbeat, decoding, one metrics
        # report and one log line a step): at most 5 % of the wall-clock, or 60 ms a step where a loaded
        # machine makes the 2-step run's 1.2 s short (a failed CI run: 80 ms, 6.7 %, beside a compose stack)
        other_s = float(r["trainer_other_frac"]) * float(r["trainer_wall_s"])
        assert other_s <= max(0.05 * float(r["trainer_wall_s"]), 0.06 * float(r["steps"])), r
        assert 0.0 <= float(r["engine_busy_frac"]) <= 1.0
        assert r["model_build"] == build, r  # every run records the weights it started from
    for name in ("report.html", "results.md", "learning_vs_step.png", "learning_vs_wallclock.png",
                 "logprob_diff.png", "version_gap.png", "version_span.png", "time_split.png"):
        assert (root / name).stat().st_size > 0, name
    results = (root / "results.md").read_text()
    assert "dressage experiment" in results and "git commit" in results and "cores" in results
    assert "async/sync wall-clock to 2 steps:" in results
    assert f"- model build: {build}\n" in results
