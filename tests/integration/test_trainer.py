"""Trainer against a real redis-server: batches in, checkpoints + published versions out, resume, eval jobs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis
import torch
from rq.job import Job
from trainer_factory import batch, batch_fields, tiny_model, trainer_config
from waits import wait_for

from services.eval_worker.admission import JobPolicy
from services.eval_worker.worker import build_worker, run_worker
from services.trainer.checkpoint import CheckpointStore
from services.trainer.loop import TrainerLoop
from services.trainer.startup import open_trainer
from shared.codec import decode_entry, encode_entry
from shared.evaluation import SERIALIZER
from shared.keys import GROUP_TRAINER, Keys
from shared.redisproc import RedisProcess
from shared.schemas import DeadLetter
from shared.tasks import get_task, write_dataset
from shared.telemetry import read_metrics
from shared.versionbus import VersionWatcher, published_versions, read_latest

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def push(r: redis.Redis, keys: Keys, *batch_ids: str) -> list[bytes]:
    return [r.xadd(keys.batches, batch_fields(b)) for b in batch_ids]


def stats(r: redis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(keys.stats).items()}


def pending(r: redis.Redis, keys: Keys) -> int:
    return int(r.xpending(keys.batches, GROUP_TRAINER)["pending"])


def test_trainer_trains_checkpoints_publishes_and_dead_letters_poison(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix)
    watcher = VersionWatcher(lambda: redis.Redis.from_url(redis_server.url), keys, poll_s=0.1).start()
    ids = push(redis_client, keys, "b1", "b2")
    redis_client.xadd(keys.batches, {"schema": b"1", "kind": b"batch", "body": b"\xc1garbage"})
    bad = batch("b-bad")
    bad.groups[0].samples[0].token_ids[0] = 10_000  # outside the vocabulary
    redis_client.xadd(keys.batches, encode_entry(bad))
    ids += push(redis_client, keys, "b3")
    try:
        assert open_trainer(cfg, redis_client, with_sinks=False).run(burst=True) == 0
        assert watcher.wait_for(lambda wv: wv is not None and wv.version == "3", timeout=10)
    finally:
        watcher.stop()
    assert published_versions(redis_client, keys) == ["0", "1", "2", "3"]
    store = CheckpointStore(cfg.train.checkpoint_dir)
    assert [i.version for i in store.complete()] == [0, 1, 2, 3]
    last = store.load_state(store.complete()[-1])
    assert (last["step"], last["batches_trained"], last["groups_trained"]) == (3, 3, 6)
    assert [store.load_state(i)["consumed_entry_ids"] for i in store.complete()] == [[]] + [[i.decode()] for i in ids]
    assert watcher.latest is not None and Path(watcher.latest.path) == store.complete()[-1].path.resolve()
    assert pending(redis_client, keys) == 0
    assert stats(redis_client, keys) == {"batches_trained": 3, "groups_trained": 6, "poison_dead_lettered": 1,
                                         "groups_dead_lettered": 2, "batches_dead_lettered": 1}
    dead = [decode_entry(f, DeadLetter) for _, f in redis_client.xrange(keys.dead)]
    assert [d.reason for d in dead] == ["malformed", "invalid_batch"]
    assert "token_ids: id 10000" in dead[1].error and dead[0].fields["body"] == b"\xc1garbage"
    rows = read_metrics(redis_client, keys, "trainer")
    assert [m["train/step"] for m in rows] == [1, 2, 3]
    assert [m["train/published_version"] for m in rows] == [1, 2, 3]  # read_metrics parses "1" as JSON
    # batches made by v0 and trained from v0, v1, v2: the histogram counts the same gaps as the mean and max
    assert [(m["train/version_gap_mean"], m["train/version_gap_max"]) for m in rows] == [(0, 0), (1, 1), (2, 2)]
    assert [m["train/version_gap_hist"] for m in rows] == [{"0": 8}, {"1": 8}, {"2": 8}]
    for m in rows:
        assert m["train/batch_groups"] == 2
        assert m["train/train_rollout_logprob_abs_diff"] > 0 and m["train/tokens_per_s"] > 0


def test_restart_resumes_state_and_continues_version_numbers(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix, keep_checkpoints=2)
    push(redis_client, keys, "b1", "b2")
    first = open_trainer(cfg, redis_client, with_sinks=False)
    first.run(burst=True)
    push(redis_client, keys, "b3")
    second = open_trainer(cfg, redis_client, with_sinks=False)
    assert isinstance(second, TrainerLoop)  # one process: rank 0
    assert second.learner.step == 2 and second.version == 2
    # The optimizer state came back: same Adam moments as the first trainer's.
    a, b = first.learner.optimizer.state_dict()["state"], second.learner.optimizer.state_dict()["state"]
    assert all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)
    second.run(burst=True)
    assert published_versions(redis_client, keys) == ["0", "1", "2", "3"]
    assert [i.version for i in CheckpointStore(cfg.train.checkpoint_dir).complete()] == [2, 3]  # pruned to 2
    assert stats(redis_client, keys)["batches_trained"] == 3


def test_bf16_mixed_publishes_bf16_and_resumes_from_the_fp32_master_weights(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix, precision="bf16-mixed")
    push(redis_client, keys, "b1", "b2")
    first = open_trainer(cfg, redis_client, with_sinks=False)
    first.run(burst=True)
    newest = CheckpointStore(cfg.train.checkpoint_dir).complete()[-1].path
    assert {t.dtype for t in load_file(newest / "model.safetensors").values()} == {torch.bfloat16}  # what engines load
    second = open_trainer(cfg, redis_client, with_sinks=False)
    assert isinstance(first, TrainerLoop) and isinstance(second, TrainerLoop)
    master, resumed = first.learner.model.state_dict(), second.learner.model.state_dict()
    assert all(v.dtype == torch.float32 and torch.equal(resumed[k], v) for k, v in master.items())
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in master.values())  # more than the bf16 copy


def test_interval_two_acks_only_at_the_checkpoint_boundary(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix, update_weights_interval=2)
    push(redis_client, keys, "b1", "b2", "b3")
    open_trainer(cfg, redis_client, with_sinks=False).run(burst=True)
    assert published_versions(redis_client, keys) == ["0", "1"]
    assert pending(redis_client, keys) == 1  # b3 trained, but its step is in no checkpoint yet
    push(redis_client, keys, "b4")
    again = open_trainer(cfg, redis_client, with_sinks=False)
    assert again.learner.step == 2  # b3's step was lost with the process: it is trained again
    again.run(burst=True)
    assert published_versions(redis_client, keys) == ["0", "1", "2"]
    assert pending(redis_client, keys) == 0 and stats(redis_client, keys)["batches_trained"] == 4
    assert isinstance(again, TrainerLoop)  # one process: rank 0
    state = CheckpointStore(cfg.train.checkpoint_dir).load_state(again.store.newest())  # type: ignore[arg-type]  # a checkpoint exists
    assert state["step"] == 4 and state["consumed_batch_ids"] == ["b3", "b4"]


def test_between_durable_checkpoints_versions_are_snapshots_and_their_batches_stay_pending(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix, checkpoint_every_versions=3,
                         keep_snapshots=10, max_steps=4)
    ids = [i.decode() for i in push(redis_client, keys, "b1", "b2", "b3", "b4", "b5")]
    trainer = open_trainer(cfg, redis_client, with_sinks=False)
    assert isinstance(trainer, TrainerLoop)
    trainer.run(burst=True)  # max_steps 4: b5 is never read
    store = CheckpointStore(cfg.train.checkpoint_dir)
    assert published_versions(redis_client, keys) == ["0", "1", "2", "3", "4"]
    # v3 is the third version cut: durable; v4 (a snapshot) was promoted when the trainer stopped.
    assert [i.version for i in store.complete()] == [0, 3, 4]
    assert [i.version for i in store.snapshots()] == [1, 2, 4]
    assert [store.load_state(i)["consumed_entry_ids"] for i in store.complete()] == [[], ids[:3], [ids[3]]]
    rows = read_metrics(redis_client, keys, "trainer")
    assert [m["train/durable"] for m in rows] == [0, 0, 1, 0]  # the promotion at the stop is not a step
    latest_wv = read_latest(redis_client, keys)
    assert latest_wv is not None and Path(latest_wv.path) == store.snapshot_path(4).resolve()  # published as a snapshot
    assert pending(redis_client, keys) == 0 and stats(redis_client, keys)["batches_trained"] == 4


def test_a_restart_after_snapshots_retrains_their_batches_and_numbers_on(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix, checkpoint_every_versions=10)
    push(redis_client, keys, "b1", "b2")
    first = open_trainer(cfg, redis_client, with_sinks=False)
    assert isinstance(first, TrainerLoop)
    first.start()
    assert first._iterate(burst=True) and first._iterate(burst=True)  # two snapshots, no stop (as if killed)
    assert published_versions(redis_client, keys) == ["0", "1", "2"] and pending(redis_client, keys) == 2
    push(redis_client, keys, "b3")
    again = open_trainer(cfg, redis_client, with_sinks=False)
    assert isinstance(again, TrainerLoop)
    assert again.learner.step == 0 and again.version == 2  # weights of v0, numbering above the published v2
    again.run(burst=True)
    assert published_versions(redis_client, keys) == ["0", "1", "2", "3", "4", "5"]
    store = CheckpointStore(cfg.train.checkpoint_dir)
    assert [i.version for i in store.complete()] == [0, 5]
    final = store.load_state(store.complete()[-1])
    assert final["step"] == 3 and final["consumed_batch_ids"] == ["b1", "b2", "b3"]  # each trained once
    assert pending(redis_client, keys) == 0 and stats(redis_client, keys)["batches_trained"] == 3


def test_an_idle_trainer_makes_its_newest_snapshot_durable_at_once(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix, checkpoint_every_versions=100)
    trainer = open_trainer(cfg, redis_client, with_sinks=False)
    assert isinstance(trainer, TrainerLoop)
    worker = threading.Thread(target=trainer.run, daemon=True)
    worker.start()
    try:
        push(redis_client, keys, "b1", "b2")
        wait_for(lambda: stats(redis_client, keys).get("batches_trained") == 2, timeout=60, what="promotion")
        assert pending(redis_client, keys) == 0  # acknowledged while the trainer still runs
        store = CheckpointStore(cfg.train.checkpoint_dir)
        assert store.complete()[-1].version == int(published_versions(redis_client, keys)[-1])
    finally:
        trainer.stop.set()
        worker.join(30)
    assert not worker.is_alive()


def test_published_versions_are_evaluated_by_the_rq_worker(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "heldout.jsonl"
    write_dataset(dataset, get_task("reverse").generate(6, seed=99))
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix)
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={
        "every_versions": 2, "dataset": str(dataset), "n_examples": 4, "queue": f"{keys.prefix}-eval"})})
    push(redis_client, keys, "b1", "b2", "b3")
    open_trainer(cfg, redis_client, with_sinks=False).run(burst=True)
    policy = JobPolicy(checkpoint_root=cfg.train.checkpoint_dir, data_root=str(tmp_path))
    worker = build_worker(redis_client, keys, cfg.eval.queue, "w1", 15.0, policy=policy)
    assert run_worker(worker, burst=True) == 0
    rows = read_metrics(redis_client, keys, "eval")
    assert [m["eval/version"] for m in rows] == [0, 2]  # versions 0 and 2 of 0..3
    for m in rows:
        assert m["eval/n"] == 4 and 0.0 <= m["eval/accuracy"] <= m["eval/reward"] <= 1.0
    job = Job.fetch(f"{keys.prefix}-eval-v2", connection=redis_client, serializer=SERIALIZER)
    assert job.func_name == "shared.evaluation.run_eval_job" and not job.args
    assert all(isinstance(v, (str, int)) for v in job.kwargs.values())  # JSON-safe, nothing pickled
    assert job.kwargs["version"] == "2" and "redis_url" not in job.kwargs  # no URL (it may hold a password)


def test_trainer_rides_out_a_redis_restart(model_dir: Path, tmp_path: Path) -> None:
    server = RedisProcess(directory=tmp_path / "redis", appendonly=True).start()
    try:
        r = redis.Redis.from_url(server.url)
        keys = Keys("restart")
        cfg = trainer_config(tmp_path, model_dir, server.url, keys.prefix, max_steps=3)
        cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"reconnect_backoff_max_s": 0.2})})
        push(r, keys, "b1", "b2")
        trainer = open_trainer(cfg, r, with_sinks=False)
        worker = threading.Thread(target=trainer.run, daemon=True)
        worker.start()
        deadline = time.monotonic() + 60
        while published_versions(r, keys)[-1:] != ["2"] and time.monotonic() < deadline:
            time.sleep(0.05)
        server.restart()  # SIGKILL + start on the same AOF directory
        push(r, keys, "b3")
        worker.join(60)
        assert not worker.is_alive()
        assert published_versions(r, keys) == ["0", "1", "2", "3"]
        assert stats(r, keys)["batches_trained"] == 3 and pending(r, keys) == 0
    finally:
        server.cleanup()
