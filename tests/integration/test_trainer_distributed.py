"""The trainer on torch.distributed with gloo and 2 ranks on CPU: real process groups, real torchrun.

* one step on 2 ranks (DDP and FSDP2, ``torch.multiprocessing`` spawn) gives the weights, gradient
  norm and loss of one process on the same batch — including a split where one rank runs a
  zero-weight micro-batch, and a step of 2 minibatches × 2 epochs under the decoupled loss; under ``bf16-mixed`` (DDP with autocast, FSDP2 with bf16 compute over
  fp32 shards) the step is the one-process autocast step within bf16's precision, and the master
  weights exported are fp32;
* ``torchrun --nproc-per-node 2 -m services.trainer --burst`` against a real Redis trains the stream
  like one process: same versions, same final weights;
* SIGKILL of rank 1 in the middle of a step: nothing acknowledged, nothing published, no checkpoint;
  the restarted run trains the batch and versions stay monotonic, each published once.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from trainer_factory import batch_fields, group, tiny_model, trainer_config, write_config_yaml

from services.trainer.checkpoint import CheckpointStore
from services.trainer.follower import Follower
from services.trainer.learner import Learner
from services.trainer.parallel import Parallel, run_rank, split_rows
from shared.config import TrainConfig
from shared.keys import GROUP_TRAINER, Keys
from shared.modeling import load_model
from shared.precision import Precision
from shared.redisproc import RedisProcess, free_port
from shared.schemas import Batch, Window
from shared.versionbus import published_versions

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
N_BATCHES = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def uneven_batch() -> Batch:
    """7 rows (a group of 4 and one of 3): rank 0 gets 4 rows, rank 1 gets 3."""
    rng = random.Random(7)
    groups = [group("u-g0", rng, n_samples=4), group("u-g1", rng, n_samples=3)]
    return Batch(batch_id="u", groups=groups, trainer_version="0", window=Window(keep_versions=0, current_version="0"))


def train_cfg(micro: int, precision: Precision = "fp32", minibatches: int = 1) -> TrainConfig:
    """``minibatches`` > 1: that many minibatches × 2 epochs under the decoupled loss."""
    cfg = TrainConfig(lr=1e-3, micro_batch_size=micro, max_grad_norm=1.0, precision=precision)
    if minibatches == 1:
        return cfg
    return cfg.model_copy(update={"minibatches_per_batch": minibatches, "epochs_per_batch": 2,
                                  "policy_loss": "decoupled"})


def _rank_main(rank: int, world: int, port: int, mode: str, model: str, micro: int, out: str,
               precision: Precision = "fp32", minibatches: int = 1) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    parallel = Parallel.from_env("cpu", mode, 120)
    learner = Learner(load_model(model), train_cfg(micro, precision, minibatches), 0, parallel=parallel)

    def body() -> int:
        if not parallel.is_leader:
            return Follower(learner).run()
        metrics = learner.train_step([uneven_batch()])
        weights, state = learner.export()
        full = weights if weights is not None else learner.model.state_dict()
        master = {k: v.detach().clone() for k, v in state.get("master_weights", {}).items()}
        torch.save({"metrics": metrics, "weights": {k: v.detach().clone() for k, v in full.items()},
                    "master": master}, out)
        learner.close()
        return 0

    run_rank(body, parallel)  # the trainer's own exit path (os._exit under torch.distributed)


def one_process_step(model: Path, micro: int, precision: Precision = "fp32",
                     minibatches: int = 1) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    learner = Learner(load_model(model), train_cfg(micro, precision, minibatches), 0)
    metrics = learner.train_step([uneven_batch()])
    return metrics, {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def test_split_is_deterministic_and_pads_micro_batches() -> None:
    b = uneven_batch()
    from services.trainer.batching import build_rows

    rows = build_rows([b], True, False).rows
    shards = split_rows(rows, 2, lambda n: min(3, n))
    assert [len(s.rows) for s in shards] == [4, 3]
    assert all(s.n_micro == 2 and s.loss_tokens == sum(sum(r.mask) for r in rows) for s in shards)
    assert [s.micro_rows for s in shards] == [3, 3]  # rank 1: 1 chunk of rows + 1 zero-weight chunk
    again = split_rows(rows, 2, lambda n: min(3, n))
    assert [[r.token_ids for r in s.rows] for s in again] == [[r.token_ids for r in s.rows] for s in shards]
    assert sorted(map(id, (r for s in shards for r in s.rows))) == sorted(map(id, rows))  # a partition


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_one_step_on_two_ranks_equals_one_process(mode: str, model_dir: Path, tmp_path: Path) -> None:
    micro = 3  # rank 0: chunks of 3+1 rows, rank 1: 3 rows + a zero-weight chunk
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, free_port(), mode, str(model_dir), micro, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    metrics, weights = one_process_step(model_dir, micro)
    assert got["metrics"]["train/grad_norm"] == pytest.approx(metrics["train/grad_norm"], rel=1e-5)
    assert got["metrics"]["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-5, abs=1e-7)
    assert got["metrics"]["train/entropy"] == pytest.approx(metrics["train/entropy"], rel=1e-5)
    assert got["metrics"]["train/samples"] == 7
    assert set(got["weights"]) == set(weights)
    moved = max(float((weights[k] - load_model(model_dir).state_dict()[k]).abs().max()) for k in weights)
    assert moved > 1e-4  # the step did change the weights
    for k, v in weights.items():
        torch.testing.assert_close(got["weights"][k], v, rtol=1e-5, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")  # type: ignore[misc]  # k bound per iteration


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_minibatches_and_epochs_on_two_ranks_equal_one_process(mode: str, model_dir: Path, tmp_path: Path) -> None:
    # 2 minibatches x 2 epochs, decoupled loss, 1 row per micro-batch: minibatch 1 has 3 rows, so rank 1 runs a
    # zero-weight micro-batch in each of its optimizer steps and an empty forward in the proximal pass
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, free_port(), mode, str(model_dir), 1, str(out), "fp32", 2), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    metrics, weights = one_process_step(model_dir, 1, minibatches=2)
    assert got["metrics"]["train/optimizer_steps"] == metrics["train/optimizer_steps"] == 4
    for key in ("train/grad_norm", "train/loss", "train/ess", "train/mismatch_kl", "train/clip_frac_minibatch_max"):
        assert got["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    for k, v in weights.items():
        torch.testing.assert_close(got["weights"][k], v, rtol=1e-5, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")  # type: ignore[misc]  # k bound per iteration


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_bf16_mixed_on_two_ranks_computes_in_bf16_over_fp32_weights(mode: str, model_dir: Path,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "rank0.pt"  # DDP: autocast as one process; FSDP2: its MixedPrecisionPolicy on fp32 shards
    mp.spawn(_rank_main, args=(2, free_port(), mode, str(model_dir), 3, str(out), "bf16-mixed"), nprocs=2,
             join=True)
    got = torch.load(out, weights_only=False)
    metrics, weights = one_process_step(model_dir, 3, "bf16-mixed")
    assert got["metrics"]["train/grad_norm"] == pytest.approx(metrics["train/grad_norm"], rel=0.05)
    assert {v.dtype for v in got["weights"].values()} == {torch.bfloat16}  # published for the engines
    assert {v.dtype for v in got["master"].values()} == {torch.float32}  # what the optimizer steps
    for k, v in weights.items():  # AdamW's first step moves every weight by ~lr: only signs may differ
        torch.testing.assert_close(got["master"][k], v, rtol=0, atol=2.5e-3, msg=lambda m, k=k: f"{k}: {m}")  # type: ignore[misc]  # k bound per iteration


# --- torchrun end to end ----------------------------------------------------------------------


def run(cmd: list[str], fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DRESSAGE_LOG_LEVEL": "INFO"}
    env.pop("DRESSAGE_FAULT", None)
    if fault:
        env["DRESSAGE_FAULT"] = fault
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def torchrun(config: Path, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    return run([str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                str(free_port()), "-m", "services.trainer", "--config", str(config), "--burst"], fault)


def one_process(config: Path) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "services.trainer", "--config", str(config), "--burst"])


def setup_run(tmp: Path, model_dir: Path, server: RedisProcess, r: redis.Redis, keys: Keys) -> tuple[Path, list[str]]:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = trainer_config(tmp, model_dir, server.url, keys.prefix)
    ids = [r.xadd(keys.batches, batch_fields(f"b{i}", n_groups=2 + i % 2)).decode()
           for i in range(1, N_BATCHES + 1)]
    return write_config_yaml(tmp / "cfg.yaml", cfg), ids


def final_weights(store: CheckpointStore) -> dict[str, Any]:
    return load_file(str(store.complete()[-1].path / "model.safetensors"))


def pending(r: redis.Redis, keys: Keys) -> list[str]:
    return [p["message_id"].decode() for p in r.xpending_range(keys.batches, GROUP_TRAINER, "-", "+", 100)]


def test_torchrun_two_ranks_trains_the_stream_like_one_process(
        redis_server: RedisProcess, redis_client: redis.Redis, model_dir: Path, tmp_path: Path) -> None:
    r = redis_client
    k2, k1 = Keys(f"dist2-{os.getpid()}"), Keys(f"dist1-{os.getpid()}")
    cfg2, _ = setup_run(tmp_path / "two", model_dir, redis_server, r, k2)
    cfg1, _ = setup_run(tmp_path / "one", model_dir, redis_server, r, k1)
    proc = torchrun(cfg2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "backend=gloo parallel=ddp" in proc.stderr
    assert one_process(cfg1).returncode == 0
    for keys in (k1, k2):
        assert published_versions(r, keys) == [str(v) for v in range(N_BATCHES + 1)]
        assert pending(r, keys) == []
        assert int(r.hget(keys.stats, "batches_trained") or 0) == N_BATCHES
    two, one = final_weights(CheckpointStore(tmp_path / "two" / "ckpt")), final_weights(CheckpointStore(tmp_path / "one" / "ckpt"))
    for name, v in one.items():
        torch.testing.assert_close(two[name], v, rtol=1e-4, atol=1e-5)


def test_sigkill_of_one_rank_mid_step_acknowledges_nothing_and_the_run_resumes(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    r = redis_client
    config, ids = setup_run(tmp_path, model_dir, redis_server, r, keys)
    store = CheckpointStore(tmp_path / "ckpt")

    proc = torchrun(config, fault="follower_mid_step:2")  # rank 1 dies inside the second step
    assert proc.returncode != 0
    assert "fault injection: SIGKILL at follower_mid_step" in proc.stderr
    assert published_versions(r, keys) == ["0", "1"]  # step 2 never published ...
    assert [i.version for i in store.complete()] == [0, 1]  # ... nor checkpointed ...
    assert pending(r, keys) == [ids[1]]  # ... nor acknowledged: b2 is still pending
    assert int(r.hget(keys.stats, "batches_trained") or 0) == 1
    assert "acknowledged batches entry_ids=" + ids[1] not in proc.stderr

    proc = torchrun(config)  # the restart (torchrun --max-restarts or the supervisor)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert published_versions(r, keys) == [str(v) for v in range(N_BATCHES + 1)]  # monotonic, each once
    done = store.complete()
    consumed = [e for i in done for e in store.load_state(i)["consumed_entry_ids"]]
    assert consumed == ids  # b2 trained after the restart, every batch exactly once
    assert store.load_state(done[-1])["step"] == N_BATCHES
    assert pending(r, keys) == []
