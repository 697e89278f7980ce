"""``dressage up`` end to end: every real service as a process on a private Redis, a few trainer steps.

Checks the run's outputs (metrics.jsonl with increasing versions, report files, logs, exit code 0),
and that ``dressage status`` shows live numbers while the run is going. SIGTERM stopping every process
cleanly, and the services' metrics endpoints, are read off one long run in test_up_live.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from paths import REPO
from waits import wait_for

from tools.monitor import status
from tools.reports.metricslog import load_rows

CONFIG = "configs/test.yaml"


def start_up(run_dir: Path, model: Path, *extra: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "DRESSAGE_MODEL_PATH": str(model), "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env.pop("REDIS_URL", None)  # a private Redis, always
    return subprocess.Popen([sys.executable, "-m", "services", "up", "--config", CONFIG, "--run-dir", str(run_dir),
                             "--quiet", *extra], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "run"




def child_pids(output: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (\S+) pid=(\d+)", output)}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def finished(proc: subprocess.Popen[str], timeout: float) -> str:
    """The output of a bounded run that must end on its own with the trainer done (killed if it does not)."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "run finished: trainer exited 0" in output
    return output


def test_bounded_demo_run_produces_metrics_report_and_live_status(model_dir: Path, run_dir: Path,
                                                                  capsys: Any) -> None:
    proc = start_up(run_dir, model_dir, "--demo")
    try:
        wait_for(lambda: any(r.get("service") == "trainer" for r in load_rows(run_dir / "metrics.jsonl")),
                 150, "a trainer report in metrics.jsonl", process=proc, period=0.5)
        # While it runs, `dressage status --run DIR` shows the live deployment.
        assert status.main(["--run", str(run_dir)]) == 0
        screen = capsys.readouterr().out
        assert re.search(r"VERSION\s+current \d+", screen), screen
        assert re.search(r"trainer\s+\S+\s+alive", screen) and re.search(r"rollout-worker\s+\S+\s+alive", screen)
        assert re.search(r"ENGINES\s+http://127\.0\.0\.1:\d+\s+alive \(dressage-engine, weight_version \d+\)", screen), screen
    except BaseException:
        proc.kill()
        raise
    output = finished(proc, 150)
    rows = load_rows(run_dir / "metrics.jsonl")
    train = [r for r in rows if r.get("service") == "trainer" and "train/step" in r]
    assert [r["train/step"] for r in train] == [1, 2, 3]
    versions = [int(r["train/version"]) for r in train]
    assert versions == sorted(set(versions)) and versions[-1] == 3
    assert any(r.get("service") == "ops" and "stats/groups_trained" in r for r in rows)
    # eval.every_versions is 2: the run waited for the evaluation of the last evaluated version.
    assert any(str(r.get("eval/version")) == "2" and "eval/accuracy" in r for r in rows)
    report = run_dir / "report"
    assert sorted(p.name for p in report.glob("*.png")) == ["learning.png", "logprob_diff.png", "pipeline.png",
                                                            "staleness.png"]
    assert "data:image/png;base64," in (report / "report.html").read_text()
    assert "trainer steps" in output and "3" in (report / "summary.txt").read_text()
    logs = {p.stem for p in (run_dir / "logs").glob("*.log")}
    assert {"engine", "proxy", "trainer", "group-collector", "eval-worker", "prompt-buffer",
            "rollout-worker-1", "rollout-worker-2"} <= logs
    info = json.loads((run_dir / "run.json").read_text())
    assert info["prefix"].startswith("dressage-test-") and "@" not in info["redis_url"]
    # ops.prefork (the default): the services that load torch were forked from one pre-imported launcher
    forked = set(re.findall(r"started (\S+) pid=\d+ \(forked, pre-imported\)", output))
    assert forked == {"engine", "trainer", "eval-worker"}, output
    launcher = re.search(r"prefork launcher ready pid=(\d+)", output)
    assert launcher is not None and not alive(int(launcher.group(1)))
    assert not any(alive(pid) for pid in child_pids(output).values())


def test_deferred_evaluation_runs_every_queued_version_after_the_last_step(model_dir: Path, run_dir: Path) -> None:
    # keep_checkpoints 1: only the queued evaluations keep the older versions on disk until they ran
    # ops.prefork off: every service a fresh interpreter, the path a GPU deployment takes
    proc = start_up(run_dir, model_dir, "--max-steps", "3", "--no-report",
                    env_extra={"DRESSAGE_EVAL_DEFER": "true", "DRESSAGE_EVAL_EVERY_VERSIONS": "1",
                               "DRESSAGE_TRAIN_KEEP_CHECKPOINTS": "1", "DRESSAGE_OPS_PREFORK": "false"})
    output = finished(proc, 300)
    assert "forked" not in output and "prefork launcher" not in output
    # No eval worker ran beside the pipeline: one burst worker started once the trainer was done.
    started = [m.group(1) for m in re.finditer(r"started (\S+) pid=", output)]
    assert started.count("eval-worker") == 1 and started[-1] == "eval-worker", started
    assert output.index("running the deferred evaluations") < output.index("started eval-worker")
    assert re.search(r"eval-worker exited with code 0", output), output
    rows = load_rows(run_dir / "metrics.jsonl")
    evaluated = {str(r["eval/version"]) for r in rows if "eval/accuracy" in r}
    assert evaluated == {"0", "1", "2", "3"}, evaluated  # every published version, none lost to pruning
    published = {str(r.get("train/published_version")) for r in rows if r.get("service") == "trainer"}
    assert {"1", "2", "3"} <= published  # the publication times that time-to-accuracy is read from
    assert not any(alive(pid) for pid in child_pids(output).values())


def test_a_service_dying_stops_the_run_with_its_name_exit_code_and_log(tmp_path: Path) -> None:
    proc = start_up(tmp_path / "run", tmp_path / "no-such-model")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output
    assert re.search(r"run failed: engine exited before it was ready with exit code [1-9]", output), output
    assert "--- last lines of engine" in output and "no-such-model" in output  # the engine's own error
    assert not any(alive(pid) for pid in child_pids(output).values())
    assert "proxy" not in child_pids(output)  # nothing after the engine was started
