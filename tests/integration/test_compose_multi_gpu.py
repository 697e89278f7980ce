"""docker-compose.multi-gpu.yml over docker-compose.yml, rendered by the real Compose v2 binary: four
SGLang engines pinned to GPUs 0-3 and all listed in the proxy's engines, a 4-rank torchrun trainer on 4-7."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import compose
import pytest
from paths import REPO

BINARY = Path(compose.__file__).parent / "docker-compose"
USERS = ("PROMPT_BUFFER", "ROLLOUT_WORKER", "GROUP_COLLECTOR", "TRAINER", "PROXY", "EVAL_WORKER", "OPS")


@pytest.fixture(scope="module")
def multi() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DRESSAGE_", "REDIS_"))}
    env.update({"REDIS_PASSWORD": "test-password-123", "PROXY_API_KEY": "a" * 24, "PROXY_OPERATOR_KEY": "b" * 24,
                "ENGINE_API_KEY": "c" * 24, **{f"REDIS_PASSWORD_{u}": f"pw-{u.lower()}-0123" for u in USERS}})
    out = subprocess.run([str(BINARY), "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"),
                          "-f", str(REPO / "docker-compose.multi-gpu.yml"), "--profile", "gpu", "config",
                          "--format", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["services"]


def gpus(svc: dict[str, Any]) -> list[str]:
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev["capabilities"] == ["gpu"] and "count" not in dev
    return list(dev["device_ids"])


def test_four_engines_on_distinct_gpus_all_behind_the_proxy(multi: dict[str, Any]) -> None:
    engines = {n: s for n, s in multi.items() if n.startswith("engine-sglang")}
    assert len(engines) == 4
    assert sorted(g for s in engines.values() for g in gpus(s)) == ["0", "1", "2", "3"]
    aliases = {a for s in engines.values() for a in s["networks"]["engines"]["aliases"]}
    listed = json.loads(multi["proxy"]["environment"]["DRESSAGE_PROXY_ENGINES"])
    assert sorted(listed) == sorted(f"http://{a}:30000" for a in aliases)
    for s in engines.values():
        assert "--weight-version" in s["command"] and ("checkpoints" in str(s["volumes"]))


def test_the_trainer_runs_four_ranks_under_torchrun_on_the_other_gpus(multi: dict[str, Any]) -> None:
    t = multi["trainer-gpu"]
    assert t["entrypoint"][0] == "torchrun" and t["entrypoint"][-2:] == ["-m", "services.trainer"]
    nproc = t["entrypoint"][t["entrypoint"].index("--nproc-per-node") + 1]
    assert gpus(t) == ["4", "5", "6", "7"] and int(nproc) == len(gpus(t))
    assert t["environment"]["DRESSAGE_TRAIN_DEVICE"] == "cuda" and t["environment"]["DRESSAGE_TRAIN_PARALLEL"] == "ddp"
