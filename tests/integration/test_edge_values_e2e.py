"""A rollout group with a NaN reward or ``attempt = 2**63`` is dead-lettered and never trained (issue 16).

End to end on a real redis-server: the trainer publishes version 0, forged groups are written to the
rollouts stream between valid ones (header fields and body agreeing, as a forger would write them),
the group-collector process dead-letters them as malformed, and the trainer trains every batch the
collector made: only the valid groups, one version per batch. tests/unit/test_wire_edge_values.py
covers the decoding alone.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import redis
import torch
from trainer_factory import group, tiny_model, trainer_config

from services.trainer.checkpoint import CheckpointStore
from services.trainer.startup import open_trainer
from shared.codec import decode_entry, encode_entry
from shared.keys import GROUP_COLLECTOR, Keys
from shared.redisproc import RedisProcess
from shared.schemas import Batch, DeadLetter
from shared.versionbus import published_versions

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def forged(group_id: str, rng: random.Random, *, reward: float = 0.0, attempt: int = 0) -> dict[str, bytes]:
    """A valid group's entry with the reward of its first sample and its attempt overwritten."""
    fields = encode_entry(group(group_id, rng))
    body = msgpack.unpackb(fields["body"], raw=False)
    body["samples"][0]["reward"], body["attempt"] = reward, attempt
    return {**fields, "attempt": str(attempt).encode(), "reward_mean": str(reward).encode(),
            "body": msgpack.packb(body)}


def test_nan_reward_and_absurd_attempt_are_dead_lettered_and_never_trained(
        redis_server: RedisProcess, redis_client: redis.Redis, keys: Keys, model_dir: Path, tmp_path: Path) -> None:
    r = redis_client
    cfg = trainer_config(tmp_path, model_dir, redis_server.url, keys.prefix, groups_per_batch=2)
    assert open_trainer(cfg, r, with_sinks=False).run(burst=True) == 0  # nothing to train: publishes version 0
    assert published_versions(r, keys) == ["0"]

    rng = random.Random(0)
    for i, entry in enumerate([forged("nan-reward", rng, reward=math.nan), forged("huge-attempt", rng, attempt=2**63)]):
        r.xadd(keys.rollouts, encode_entry(group(f"g{2 * i}", rng)))
        r.xadd(keys.rollouts, entry)
        r.xadd(keys.rollouts, encode_entry(group(f"g{2 * i + 1}", rng)))
    config = tmp_path / "collector.yaml"
    config.write_text(f"redis: {{url: '{redis_server.url}', prefix: '{keys.prefix}'}}\n"
                      "train: {groups_per_batch: 2}\nstaleness: {keep_versions: 2}\n"
                      "collector: {block_ms: 50, max_ready_batches: 10, trim_interval_s: 0}\n")
    done = subprocess.run([sys.executable, "-m", "services.group_collector", "--config", str(config), "--burst"],
                          cwd=ROOT, env={**os.environ, "DRESSAGE_CONSUMER": "c1"}, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]

    dead = [decode_entry(f, DeadLetter) for _, f in r.xrange(keys.dead)]
    assert [(d.reason, d.fields["group_id"]) for d in dead] == [("malformed", b"nan-reward"),
                                                                ("malformed", b"huge-attempt")]
    assert "reward" in dead[0].error and "attempt" in dead[1].error, [d.error for d in dead]
    assert int(r.xpending(keys.rollouts, GROUP_COLLECTOR)["pending"]) == 0
    batched = [[g.group_id for g in decode_entry(f, Batch).groups] for _, f in r.xrange(keys.batches)]
    assert sorted(g for b in batched for g in b) == ["g0", "g1", "g2", "g3"]

    assert open_trainer(cfg, r, with_sinks=False).run(burst=True) == 0  # trains every batch there is
    assert published_versions(r, keys) == [str(v) for v in range(len(batched) + 1)]
    store = CheckpointStore(cfg.train.checkpoint_dir)
    last = store.load_state(store.complete()[-1])
    assert (last["batches_trained"], last["groups_trained"]) == (len(batched), 4)
    assert len(list(r.xrange(keys.dead))) == 2  # the trainer refused nothing: no forged value reached it
