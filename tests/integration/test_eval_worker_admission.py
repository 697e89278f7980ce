"""The eval-worker runs only the evaluation function, with confined arguments (real Redis, real rq worker).

The attack of issue 16: anyone with write access to the queue enqueues ``os.system`` (JSON serializer,
no pickle needed) and the worker used to run it. Here every such job lands in rq's failed registry
with ``JobRefused`` and its side effect never happens.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
from rq.job import Job, JobStatus
from rq.queue import Queue

from services.eval_worker.admission import JobPolicy, JobRefused
from services.eval_worker.worker import build_worker, run_worker
from shared.evaluation import JOB_FUNCTION, SERIALIZER
from shared.keys import Keys


def kwargs(ckpt: Path, dataset: Path, **extra: object) -> dict[str, object]:
    return {"checkpoint_path": str(ckpt), "version": "1", "step": 1, "dataset": str(dataset), "n_examples": 1,
            "prefix": "x", "batch_size": 1, "device": "cpu", **extra}


def run_once(r: redis.Redis, keys: Keys, tmp_path: Path, enqueue: dict[str, object]) -> Job:
    queue = f"{keys.prefix}-eval"
    job = Queue(queue, connection=r, serializer=SERIALIZER).enqueue_call(**enqueue)
    policy = JobPolicy(checkpoint_root=str(tmp_path / "ckpt"), data_root=str(tmp_path / "data"))
    assert run_worker(build_worker(r, keys, queue, "w1", 15.0, policy=policy), burst=True) == 0
    job.refresh()
    return job


def refused_with(job: Job, words: str) -> None:
    assert job.get_status() == JobStatus.FAILED
    text = job.latest_result().exc_string
    assert "JobRefused" in text and words in text, text


def test_os_system_job_is_refused_and_never_runs(redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    job = run_once(redis_client, keys, tmp_path, {"func": "os.system", "args": [f"touch {marker}"]})
    refused_with(job, "not the evaluation function")
    assert not marker.exists()


def test_callbacks_are_refused(redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "data").mkdir()
    job = run_once(redis_client, keys, tmp_path, {
        "func": JOB_FUNCTION, "kwargs": kwargs(tmp_path / "ckpt", tmp_path / "data" / "d.jsonl"),
        "on_success": "os.getcwd"})
    refused_with(job, "callbacks")


@pytest.mark.parametrize("case", ["outside", "symlink", "dotdot", "dataset", "extra_kwarg", "type"])
def test_evaluation_arguments_are_confined(redis_client: redis.Redis, keys: Keys, tmp_path: Path, case: str) -> None:
    ckpt_root, data_root = tmp_path / "ckpt", tmp_path / "data"
    ckpt_root.mkdir()
    data_root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, ckpt_root / "link")
    ckpt, dataset = ckpt_root / "step-1", data_root / "test.jsonl"
    args = {
        "outside": kwargs(elsewhere, dataset),
        "symlink": kwargs(ckpt_root / "link", dataset),  # inside by name, outside once resolved
        "dotdot": kwargs(ckpt_root / ".." / "elsewhere", dataset),
        "dataset": kwargs(ckpt, Path("/etc/passwd")),
        "extra_kwarg": kwargs(ckpt, dataset, r="redis://attacker"),
        "type": kwargs(ckpt, dataset, step=["1"]),
    }[case]
    words = {"extra_kwarg": "unexpected ['r']", "type": "step must be int",
             "dataset": "dataset is outside"}.get(case, "checkpoint is outside")
    refused_with(run_once(redis_client, keys, tmp_path, {"func": JOB_FUNCTION, "kwargs": args}), words)


def test_policy_admits_what_enqueue_eval_writes(tmp_path: Path) -> None:
    policy = JobPolicy(checkpoint_root=str(tmp_path), data_root=str(tmp_path))
    policy.check(JOB_FUNCTION, False, [], kwargs(tmp_path / "step-3", tmp_path / "t.jsonl"), (None, None, None))
    with pytest.raises(JobRefused):
        policy.check(JOB_FUNCTION, False, ["x"], kwargs(tmp_path, tmp_path), (None, None, None))
