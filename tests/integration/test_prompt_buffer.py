"""prompt-buffer on a real redis-server: η = 0 pacing against a simulated trainer, wake-up on a new
version, and restarts (incl. SIGKILL of the process) that neither skip nor duplicate a prompt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from services.prompt_buffer.buffer import PromptBuffer
from services.prompt_buffer.pacing import PacingPolicy
from services.prompt_buffer.schedule import Cursor, Schedule
from shared.codec import decode_entry
from shared.config import PromptBufferConfig
from shared.keys import Keys
from shared.lifecycle import StopFlag
from shared.redisproc import RedisProcess
from shared.schemas import PromptGroup, WeightVersion
from shared.tasks.dataset import write_dataset
from shared.versionbus import publish_version

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt_id": f"r{i}", "task": "reverse", "prompt": f"reverse {100 + i}", "reference": str(100 + i)[::-1]}
        for i in range(12)]


def publish(r: redis.Redis, keys: Keys, v: int) -> None:
    publish_version(r, keys, WeightVersion(version=str(v), path="/x", step=v, published_at=time.time()))


def emitted(r: redis.Redis, keys: Keys) -> list[PromptGroup]:
    return [decode_entry(f, PromptGroup) for _, f in r.xrange(keys.prompts)]


def buffer(r: redis.Redis, keys: Keys, eta: int | None, gpv: int, burst: bool = True,
           stop: StopFlag | None = None, poll_s: float = 0.2) -> PromptBuffer:
    return PromptBuffer(r, keys, ROWS, Schedule(len(ROWS), 3, None), PacingPolicy(eta, gpv, 1000),
                        PromptBufferConfig(n_samples=2, poll_s=poll_s), consumer="pb", burst=burst, stop=stop)


def test_eta_zero_never_releases_work_for_v_plus_1_before_v_is_published(redis_client: redis.Redis,
                                                                          keys: Keys) -> None:
    r, gpv = redis_client, 3
    stats = keys.stats
    buffer(r, keys, eta=0, gpv=gpv).run()
    assert r.xlen(keys.prompts) == 0  # nothing before the trainer's first version
    released_under: dict[int, int] = {}
    for v in range(4):
        publish(r, keys, v)
        for _ in range(3):  # the buffer runs repeatedly while v is the newest version
            buffer(r, keys, eta=0, gpv=gpv).run()
        released_under[v] = r.xlen(keys.prompts)
        # the simulated trainer consumes the released groups of this version, then publishes v+1
        r.hincrby(stats, "groups_trained", gpv)
        buffer(r, keys, eta=0, gpv=gpv).run()
        assert r.xlen(keys.prompts) == (v + 1) * gpv  # trained, but v+1 is not published: still waits
    assert released_under == {0: 3, 1: 6, 2: 9, 3: 12}


def test_a_new_version_wakes_the_buffer_at_once(redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    stop = StopFlag()
    pb = buffer(r, keys, eta=0, gpv=2, burst=False, stop=stop, poll_s=30.0)  # the timer alone would take 30 s
    thread = threading.Thread(target=pb.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not r.exists(keys.health("prompt-buffer", "pb")):  # its first step ran (and found no version)
            assert time.monotonic() < deadline, "the buffer never beat"
            time.sleep(0.01)
        assert r.xlen(keys.prompts) == 0
        publish(r, keys, 0)
        deadline = time.monotonic() + 5
        while r.xlen(keys.prompts) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.xlen(keys.prompts) == 2
    finally:
        stop.set()
        pb._wake.set()
        thread.join(10)
    assert not thread.is_alive()


def _config(tmp_path: Path, server: RedisProcess, keys: Keys) -> Path:
    data = tmp_path / "data.jsonl"
    write_dataset(data, ROWS)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"redis: {{url: '{server.url}', prefix: '{keys.prefix}'}}\n"
                   f"prompt_buffer: {{dataset: '{data}', n_samples: 2, shuffle_seed: 5, epochs: 3, poll_s: 0.05}}\n"
                   "pacing: {max_versions_ahead: null, max_in_flight_groups: 5}\n")
    return cfg


def test_restarts_and_sigkill_neither_skip_nor_duplicate(tmp_path: Path, redis_server: RedisProcess,
                                                          redis_client: redis.Redis, keys: Keys) -> None:
    r = redis_client
    publish(r, keys, 0)
    cmd = [sys.executable, "-m", "services.prompt_buffer", "--config", str(_config(tmp_path, redis_server, keys))]
    # Pacing lets 5 groups be in flight: each process emits them, waits for room, and is killed
    # with SIGKILL; the "trainer" then makes room and the next process takes over.
    for _ in range(3):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        before = r.xlen(keys.prompts)
        deadline = time.monotonic() + 20
        while r.xlen(keys.prompts) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        r.hincrby(keys.stats, "groups_trained", 5)
    assert r.xlen(keys.prompts) == 15
    env = {**os.environ, "DRESSAGE_PACING_MAX_IN_FLIGHT_GROUPS": "1000"}
    done = subprocess.run([*cmd, "--burst"], cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = [(g.meta["epoch"], g.meta["dataset_index"]) for g in emitted(r, keys)]
    expected, _ = Schedule(len(ROWS), 5, 3).take(Cursor(), 10_000)
    assert got == expected  # the whole schedule, in order: nothing skipped, nothing doubled
    assert int(r.hget(keys.stats, "groups_produced")) == 36


def test_sigterm_exits_0(tmp_path: Path, redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys) -> None:
    cmd = [sys.executable, "-m", "services.prompt_buffer", "--config", str(_config(tmp_path, redis_server, keys))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not list(redis_client.scan_iter(f"{keys.prefix}:health:*")):
        time.sleep(0.05)  # alive and waiting for the first version
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert redis_client.xlen(keys.prompts) == 0
