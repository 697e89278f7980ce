"""The trainer survives a forged ``{p}:weights:latest`` (issue 16), against a real redis-server.

The attack: a writer with access to the weight key SETs version 10**9 pointing at attacker weights.
Before, the trainer died with ``VersionRegression`` at its next publish and, restarted, continued its
numbering from 10**9. Now it refuses the forged value (error line + ``forged_weights_latest``
counter), keeps its own monotonic history and overwrites the key with its own next version.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
import torch
from trainer_factory import batch_fields, tiny_model, trainer_config

from services.trainer.startup import open_trainer
from shared.keys import Keys
from shared.schemas import WeightVersion
from shared.versionbus import published_versions, read_latest

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def forge(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    evil = WeightVersion(version=str(10**9), path=str(tmp_path / "attacker-weights"), step=1, published_at=time.time())
    r.set(keys.weights_latest, evil.model_dump_json())


def test_forged_latest_is_refused_counted_and_overwritten(redis_client: redis.Redis, keys: Keys, model_dir: Path,
                                                           tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = trainer_config(tmp_path, model_dir, f"redis://127.0.0.1:{redis_client.connection_pool.connection_kwargs['port']}/0",
                         keys.prefix)
    redis_client.xadd(keys.batches, batch_fields("b1"))
    open_trainer(cfg, redis_client, with_sinks=False).run(burst=True)
    latest = read_latest(redis_client, keys)
    assert latest is not None and latest.version == "1"
    forge(redis_client, keys, tmp_path)  # mid-run: the next publish meets the forgery
    redis_client.xadd(keys.batches, batch_fields("b2"))
    open_trainer(cfg, redis_client, with_sinks=False).run(burst=True)  # a restart also reads the forgery
    latest = read_latest(redis_client, keys)
    assert latest is not None and latest.version == "2"  # its own next version, not 10**9 + 1
    assert Path(latest.path).name == "v00000002"
    forge(redis_client, keys, tmp_path)
    redis_client.xadd(keys.batches, batch_fields("b3"))
    trainer = open_trainer(cfg, redis_client, with_sinks=False)
    trainer.run(burst=True)  # survives: no VersionRegression
    latest = read_latest(redis_client, keys)
    assert latest is not None and latest.version == "3"
    own = [int(v) for v in published_versions(redis_client, keys) if v != str(10**9)]
    assert own == sorted(own) and sorted(set(own)) == [0, 1, 2, 3]  # re-announcing its newest after a forgery
    assert int(redis_client.hget(keys.stats, "forged_weights_latest") or 0) >= 2
    assert "ALARM refusing" in caplog.text
