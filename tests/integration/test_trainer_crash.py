"""Trainer subprocesses killed with SIGKILL at each point of the step → checkpoint → ack → publish protocol.

One history, five processes: ``python -m services.trainer --burst`` is run with
``DRESSAGE_FAULT=<point>:<n>`` (the process SIGKILLs itself the n-th time it reaches the point) for
each point of the protocol in turn, the state each crash leaves is checked, and a last clean run
must end with: versions 0..N published once each in increasing order, no half-written checkpoint
loaded, every batch trained exactly once (the checkpoints' consumed ids partition the batch ids
and the final step count equals the batch count), nothing pending. With 4 minibatches per batch, a
kill between two of a batch's optimizer steps leaves that batch untouched on disk and in Redis, and
the resumed run ends on the weights of a run never killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import launching
import pytest
import redis
import torch
from launching import Finished
from safetensors.torch import load_file
from trainer_factory import batch_fields, tiny_model, trainer_config, write_config_yaml

from services.trainer.checkpoint import CheckpointStore
from shared.keys import GROUP_TRAINER, Keys
from shared.redisproc import RedisProcess
from shared.versionbus import published_versions

ROOT = Path(__file__).resolve().parents[2]
N_BATCHES = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def run_trainer(config: Path, fault: str | None = None) -> Finished:
    """``python -m services.trainer --burst`` (forked, torch imported once for the file: tests/launching.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DRESSAGE_LOG_LEVEL": "INFO"}
    env.pop("DRESSAGE_FAULT", None)
    if fault:
        env["DRESSAGE_FAULT"] = fault
    return launching.run("services.trainer", ["--config", str(config), "--burst"], env, ROOT,
                         config.parent / "trainer.log", timeout=120)


def setup_run(tmp_path: Path, model_dir: Path, server: RedisProcess, r: redis.Redis, keys: Keys,
              background: bool = False, durable_every: int = 1, n_batches: int = N_BATCHES,
              **train: Any) -> tuple[Path, list[str]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = trainer_config(tmp_path, model_dir, server.url, keys.prefix, background_commit=background,
                         checkpoint_every_versions=durable_every, **train)
    ids = [r.xadd(keys.batches, batch_fields(f"b{i}")).decode() for i in range(1, n_batches + 1)]
    return write_config_yaml(tmp_path / "cfg.yaml", cfg), ids


def check_history(r: redis.Redis, keys: Keys, store: CheckpointStore, ids: list[str]) -> None:
    assert published_versions(r, keys) == [str(v) for v in range(N_BATCHES + 1)]  # each once, in order
    done = store.complete()
    assert [i.version for i in done] == list(range(N_BATCHES + 1))
    consumed = [e for i in done for e in store.load_state(i)["consumed_entry_ids"]]
    assert consumed == ids  # every batch in exactly one checkpoint, none twice
    final = store.load_state(done[-1])
    assert final["step"] == N_BATCHES and final["batches_trained"] == N_BATCHES  # trained once each
    assert int(r.xpending(keys.batches, GROUP_TRAINER)["pending"]) == 0
    assert int(r.hget(keys.stats, "batches_trained") or 0) == N_BATCHES
    assert not [p for p in store.root.iterdir() if p.name.startswith(".")]  # temp dirs cleaned up


def pending_ids(r: redis.Redis, keys: Keys) -> list[str]:
    return [p["message_id"].decode() for p in r.xpending_range(keys.batches, GROUP_TRAINER, "-", "+", 100)]


def crash(config: Path, fault: str) -> str:
    """Run the trainer until the fault kills it; what it printed."""
    proc = run_trainer(config, fault)
    assert proc.returncode == -signal.SIGKILL, proc.output[-3000:]
    return proc.output


def test_kill_at_every_protocol_point_loses_nothing_and_trains_nothing_twice(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    r = redis_client  # the exact trace of one process doing every step of the protocol in turn
    config, ids = setup_run(tmp_path, model_dir, redis_server, r, keys, background=False)
    store = CheckpointStore(tmp_path / "ckpt")

    # 1. Between stepping and checkpointing: b2's step dies with the process, b2 stays pending.
    crash(config, "after_step:2")
    assert [i.version for i in store.complete()] == [0, 1] and published_versions(r, keys) == ["0", "1"]
    assert pending_ids(r, keys) == [ids[1]]

    # 2. Mid-checkpoint (files written, not renamed): a temp dir is left; it is never loaded.
    crash(config, "mid_checkpoint:1")
    leftovers = [p.name for p in store.root.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-v00000002-")
    assert [i.version for i in store.complete()] == [0, 1] and pending_ids(r, keys) == [ids[1]]

    # 3. Between the rename and the XACK: v2 is complete on disk, unannounced, b2 still pending.
    err = crash(config, "after_checkpoint:1")
    assert "removed leftover checkpoint directory" in err
    assert [i.version for i in store.complete()] == [0, 1, 2] and published_versions(r, keys) == ["0", "1"]
    assert pending_ids(r, keys) == [ids[1]]

    # 4. Restart: v2 is announced, b2 acknowledged WITHOUT retraining; then b3 → v3, killed after
    #    its XACK but before publishing v3.
    err = crash(config, "after_ack:1")
    assert "announcing complete checkpoint version=2" in err
    assert f"entry_id={ids[1]} is already in a checkpoint: acknowledging without training" in err
    assert published_versions(r, keys) == ["0", "1", "2"] and pending_ids(r, keys) == []
    assert [i.version for i in store.complete()] == [0, 1, 2, 3]

    # 5. Clean restart: v3 is announced, the remaining batches train, versions keep increasing.
    proc = run_trainer(config)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "announcing complete checkpoint version=3" in proc.output
    check_history(r, keys, store, ids)


def test_kill_between_minibatches_acknowledges_nothing_and_retrains_the_batch_whole(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    # 4 minibatches per batch under the decoupled loss: the trainer dies after b2's second optimizer step, its
    # weights holding half of b2. Nothing of b2 may be checkpointed, acknowledged or published, and the restart
    # retrains b2 whole from v1: the final weights are those of a run that was never killed.
    r = redis_client
    config, ids = setup_run(tmp_path / "killed", model_dir, redis_server, r, keys, minibatches_per_batch=4,
                            policy_loss="decoupled")
    store = CheckpointStore(tmp_path / "killed" / "ckpt")
    err = crash(config, "between_minibatches:5")  # b1 reaches the point 3 times, b2 twice
    assert "fault injection: SIGKILL at between_minibatches" in err
    assert published_versions(r, keys) == ["0", "1"] and [i.version for i in store.complete()] == [0, 1]
    assert pending_ids(r, keys) == [ids[1]] and int(r.hget(keys.stats, "batches_trained") or 0) == 1
    proc = run_trainer(config)
    assert proc.returncode == 0, proc.output[-3000:]
    check_history(r, keys, store, ids)
    assert store.load_state(store.complete()[-1])["learner"]["optimizer_steps"] == 4 * N_BATCHES

    clean_keys = Keys(f"{keys.prefix}-clean")
    clean_config, _ = setup_run(tmp_path / "clean", model_dir, redis_server, r, clean_keys, minibatches_per_batch=4,
                                policy_loss="decoupled")
    assert run_trainer(clean_config).returncode == 0
    clean = CheckpointStore(tmp_path / "clean" / "ckpt")
    killed_w, clean_w = (load_file(str(s.complete()[-1].path / "model.safetensors")) for s in (store, clean))
    assert killed_w.keys() == clean_w.keys() and all(torch.equal(killed_w[k], clean_w[k]) for k in clean_w)


def assert_safe(r: redis.Redis, keys: Keys, store: CheckpointStore, ids: list[str]) -> None:
    """Whatever a crash interrupted: no batch is in two checkpoints, and every acknowledged batch is in one."""
    consumed = [e for i in store.complete() for e in store.load_state(i)["consumed_entry_ids"]]
    assert len(consumed) == len(set(consumed)), consumed
    group = next(g for g in r.xinfo_groups(keys.batches) if g["name"].decode() == GROUP_TRAINER)
    last = tuple(int(x) for x in group["last-delivered-id"].decode().split("-"))
    delivered = {i for i in ids if tuple(int(x) for x in i.split("-")) <= last}
    acknowledged = delivered - set(pending_ids(r, keys))
    assert acknowledged <= set(consumed), (acknowledged, consumed)
    published = [int(v) for v in published_versions(r, keys)]
    assert published == sorted(set(published))
    latest = published[-1]  # the newest announced version's files are complete: a checkpoint or a snapshot
    assert latest in {i.version for i in store.complete()} | {i.version for i in store.snapshots()}


def test_kill_at_every_protocol_point_with_the_commit_thread_loses_nothing_and_trains_nothing_twice(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    # train.background_commit: the next batch is read and trained while the commit thread writes,
    # acknowledges and publishes; a kill at any of its points leaves that batch pending too.
    r = redis_client
    config, ids = setup_run(tmp_path, model_dir, redis_server, r, keys, background=True)
    store = CheckpointStore(tmp_path / "ckpt")
    for fault in ("after_step:2", "mid_checkpoint:1", "after_checkpoint:1", "after_ack:1"):
        crash(config, fault)
        assert_safe(r, keys, store, ids)
    proc = run_trainer(config)
    assert proc.returncode == 0, proc.output[-3000:]
    check_history(r, keys, store, ids)


SNAPSHOT_FAULTS = ("mid_snapshot:1", "after_snapshot:1", "after_step:2", "mid_checkpoint:1", "after_checkpoint:1",
                   "after_ack:1")


@pytest.mark.parametrize(("background", "faults"), [(False, SNAPSHOT_FAULTS),
                                                    (True, ("after_snapshot:1", "after_step:2", "after_ack:1"))],
                         ids=["loop", "commit-thread"])
def test_kill_at_every_point_between_durable_checkpoints_loses_nothing_and_trains_nothing_twice(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path,
        background: bool, faults: tuple[str, ...]) -> None:
    # train.checkpoint_every_versions = 2: every other version is a weights-only snapshot whose batch
    # stays pending; a kill anywhere loses only what snapshots held (retrained from the last durable
    # checkpoint, numbered above the published version).
    r, n = redis_client, 8
    config, ids = setup_run(tmp_path, model_dir, redis_server, r, keys, background=background, durable_every=2,
                            n_batches=n)
    store = CheckpointStore(tmp_path / "ckpt")
    for fault in faults:
        crash(config, fault)
        assert_safe(r, keys, store, ids)
    proc = run_trainer(config)
    assert proc.returncode == 0, proc.output[-3000:]
    published = [int(v) for v in published_versions(r, keys)]
    assert published == sorted(set(published)) and published[0] == 0  # each once, increasing
    done = store.complete()
    consumed = [e for i in done for e in store.load_state(i)["consumed_entry_ids"]]
    assert consumed == ids  # every batch in exactly one durable checkpoint, none twice
    final = store.load_state(done[-1])
    assert final["step"] == n and final["batches_trained"] == n  # trained once each
    assert done[-1].version == published[-1]  # the stop made the newest version durable
    assert int(r.xpending(keys.batches, GROUP_TRAINER)["pending"]) == 0
    assert int(r.hget(keys.stats, "batches_trained") or 0) == n
    assert not [p for p in store.snapshot_root.iterdir() if p.name.startswith(".")]  # temp dirs cleaned up


def test_sigterm_stops_the_trainer_cleanly_with_exit_code_0(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix)
    config = write_config_yaml(tmp_path / "cfg.yaml", cfg)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DRESSAGE_FAULT", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.trainer", "--config", str(config)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while published_versions(redis_client, keys) != ["0"] and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        redis_client.xadd(keys.batches, batch_fields("b1"))
        while published_versions(redis_client, keys) != ["0", "1"] and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert int(redis_client.xpending(keys.batches, GROUP_TRAINER)["pending"]) == 0
