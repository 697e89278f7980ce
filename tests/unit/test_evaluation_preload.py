"""The eval worker preloads what a job imports, so rq's forked work horses inherit it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainer_factory import tiny_model

HEAVY = ("torch", "transformers", "transformers.models.qwen3.modeling_qwen3", "shared.modeling", "shared.tasks")
PROBE = f"""
import json, sys, threading
from shared.evaluation import preload
heavy = {HEAVY!r}
before = [m for m in heavy if m in sys.modules]
missing = preload(sys.argv[2])  # a model not built yet: the libraries only, no error
got = preload(sys.argv[1])
print(json.dumps({{"before": before, "after": [m for m in heavy if m in sys.modules], "reported": "torch" in missing,
                  "threads": threading.active_count()}}))
"""


def test_preload_imports_torch_transformers_and_the_architecture_without_starting_threads(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", PROBE, str(model), str(tmp_path / "not-built-yet")],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == []  # importing shared.evaluation alone pulls in none of the job's heavy modules
    assert got["after"] == list(HEAVY)
    assert got["reported"] is True
    assert got["threads"] == 1  # no thread that a fork would leave behind in the work horse
    assert "not imported" in out.stderr  # the unreadable model is logged, not raised


WARM = """
import json, os, sys, threading
import fakeredis, torch
from shared import evaluation
evaluation.preload(sys.argv[1])
cold = evaluation.warm_up(sys.argv[2], "data/reverse/test.jsonl")  # no model there yet: skipped
warm = evaluation.warm_up(sys.argv[1], "data/reverse/test.jsonl")
parent = torch.get_num_threads()
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # what an rq work horse does: run the job in the forked child
    out = evaluation.run_eval_job(sys.argv[1], "7", 7, "data/reverse/test.jsonl", 8, "p", r=fakeredis.FakeRedis())
    os.write(write, json.dumps({"n": out["eval/n"], "threads": torch.get_num_threads()}).encode())
    os._exit(0)
os.waitpid(pid, 0)
child = json.loads(os.read(read, 4096))
print(json.dumps({"cold": cold, "warm": warm, "parent": parent, "child": child, "job_threads": evaluation._job_threads}))
"""


def test_warm_up_runs_single_threaded_and_the_forked_job_gets_the_threads_back(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "m")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", WARM, str(model), str(tmp_path / "not-built-yet")], env=env,
                         capture_output=True, text=True, check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cold"] is False and "warm-up skipped" in out.stderr
    assert got["warm"] is True
    assert got["parent"] == 1  # no OpenMP team started before the fork
    assert got["job_threads"] == 2 and got["child"] == {"n": 8.0, "threads": 2}  # the job ran, on its threads


def test_warm_up_leaves_accelerator_evaluation_cold() -> None:
    """Nothing is loaded for a CUDA evaluation: a CUDA context created before rq's fork breaks the horse."""
    from shared import evaluation

    assert evaluation.warm_up("models/does-not-matter", "data/reverse/test.jsonl", device="cuda") is False
    assert evaluation._job_threads is None
