"""An eval-worker killed by SIGKILL comes back (issue 14): its dead registration never blocks the restart;
and one whose Redis dies while a job ends keeps working once Redis is back (the chaos soak's fault)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import redis
from rq import Worker
from rq.job import JobStatus
from rq.queue import Queue

from services.eval_worker.admission import JobPolicy
from services.eval_worker.worker import build_worker, run_worker
from shared.evaluation import JOB_FUNCTION, SERIALIZER
from shared.keys import Keys
from shared.redisproc import RedisProcess

ROOT = Path(__file__).resolve().parents[2]


def test_restart_after_sigkill_is_not_refused_for_the_dead_workers_name(redis_client: redis.Redis, keys: Keys,
                                                                       tmp_path: Path) -> None:
    policy = JobPolicy(checkpoint_root=str(tmp_path / "ckpt"), data_root=str(tmp_path / "data"))
    queue = f"{keys.prefix}-eval"
    dead = build_worker(redis_client, keys, queue, "eval-worker", 15.0, policy=policy)
    dead.register_birth()  # ... and then SIGKILL: no register_death, the registration outlives the process
    assert dead.name in {w.name for w in Worker.all(connection=redis_client)}
    restarted = build_worker(redis_client, keys, queue, "eval-worker", 15.0, policy=policy)
    assert restarted.name != dead.name and restarted.name.startswith(f"{keys.prefix}-eval-worker-")
    assert run_worker(restarted, burst=True) == 0  # registers (no "There exists an active worker named ...")


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []


def test_redis_down_while_a_job_ends_does_not_end_the_worker(tmp_path: Path) -> None:
    """The chaos soak's death: the job's work horse ends while Redis is down, so rq's loop meets the fault
    outside its dequeue retry and quits. Made deterministic: the job's dataset is a named pipe nobody writes,
    so the horse blocks opening it until it is killed (a job that failed at once could end before the test saw
    its horse, on a busy machine); Redis is SIGKILLed, the horse killed (its end is what the parent then
    reports to Redis), the pipe removed and Redis restarted on its AOF."""
    server = RedisProcess(directory=tmp_path / "redis", appendonly=True).start()
    keys = Keys("evalcrash")
    queue = f"{keys.prefix}-eval"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "data").mkdir()
    pipe = tmp_path / "data" / "d.jsonl"
    os.mkfifo(pipe)  # opening it blocks the first job's horse until the horse is killed
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"redis: {{url: '{server.url}', prefix: '{keys.prefix}', reconnect_backoff_max_s: 0.5}}\n"
                   f"eval: {{queue: '{queue}', data_root: '{tmp_path / 'data'}'}}\n"
                   f"train: {{checkpoint_dir: '{tmp_path / 'ckpt'}'}}\n")
    cmd = [sys.executable, "-m", "services.eval_worker", "--config", str(cfg)]
    log_path = tmp_path / "worker.log"
    r = redis.Redis(port=server.port, socket_timeout=5)
    job_kwargs = {"checkpoint_path": str(tmp_path / "ckpt" / "missing"), "dataset": str(pipe),
                  "version": "1", "step": 1, "n_examples": 1, "prefix": keys.prefix, "batch_size": 1, "device": "cpu"}
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "DRESSAGE_CONSUMER": "ev"}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        first = Queue(queue, connection=r, serializer=SERIALIZER).enqueue_call(JOB_FUNCTION, kwargs=job_kwargs)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (horses := _children(proc.pid)):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.005)
        assert horses, f"job {first.id} never got a work horse\n{log_path.read_text()[-3000:]}"
        server.kill()
        horses[0].kill()
        pipe.unlink()  # the second job finds no dataset and fails at once
        time.sleep(2.0)  # the parent reaps the horse and reports it to an absent Redis: rq's loop quits
        server.start()
        second = Queue(queue, connection=r, serializer=SERIALIZER).enqueue_call(JOB_FUNCTION, kwargs=job_kwargs)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and second.get_status(refresh=True) not in (JobStatus.FINISHED,
                                                                                      JobStatus.FAILED):
            assert proc.poll() is None, f"the worker died\n{log_path.read_text()[-3000:]}"
            time.sleep(0.1)
        text = log_path.read_text()
        assert second.get_status(refresh=True) == JobStatus.FAILED, text[-3000:]  # the checkpoint is missing
        assert "FileNotFoundError" in second.latest_result().exc_string or "missing" in second.latest_result().exc_string
        assert "rq's loop quit on a fault" in text, text[-3000:]  # the fault did reach rq's loop, and was ridden out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        server.cleanup()


def _unsubscribe_seconds(worker: Worker, unsubscribe: object) -> tuple[float, bool]:
    """Time ``unsubscribe(worker)`` when the pubsub thread handles the UNSUBSCRIBE reply before anyone stops it."""
    worker.subscribe()
    time.sleep(0.3)  # the thread is polling
    send = worker.pubsub.unsubscribe

    def send_then_let_the_thread_handle_the_reply(*args: object) -> object:
        out = send(*args)
        time.sleep(0.5)  # the reply is handled now: the thread finds itself unsubscribed and polls again
        return out

    worker.pubsub.unsubscribe = send_then_let_the_thread_handle_the_reply
    started = time.monotonic()
    unsubscribe(worker)  # type: ignore[operator]  # a Worker method, called unbound
    return time.monotonic() - started, worker.pubsub_thread.is_alive()


def test_a_stop_never_waits_out_the_pubsub_poll(redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    """rq stops its pubsub thread after the UNSUBSCRIBE; a thread that handled the reply first waited its 60-s
    poll, and redis-py >= 8.2 joins it: SIGTERM took a minute (seen in the suite as a 30-s SIGTERM timeout and a
    60-s burst). The eval worker asks the thread to stop first, so the reply ends it."""
    policy = JobPolicy(checkpoint_root=str(tmp_path), data_root=str(tmp_path))
    ours = build_worker(redis_client, keys, f"{keys.prefix}-eval", "w1", 15.0, policy=policy)
    seconds, alive = _unsubscribe_seconds(ours, type(ours).unsubscribe)
    assert seconds < 2.0 and not alive, (seconds, alive)
