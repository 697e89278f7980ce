"""Config: YAML + env overrides, bounds that name the key, secrets never echoed."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import REPO

from shared.config import load_config
from shared.errors import ConfigError


def test_defaults_are_valid_and_retry_budget_is_two() -> None:
    cfg = load_config(None, env={})
    assert cfg.rollout.max_retries == 2
    assert cfg.keys().prompts == "dressage:prompts"


def test_yaml_sections_and_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("staleness:\n  keep_versions: 3\nprompt_buffer:\n  n_samples: 4\n")
    cfg = load_config(path, env={"DRESSAGE_ROLLOUT_MAX_RETRIES": "5", "DRESSAGE_PROMPT_BUFFER_N_SAMPLES": "6",
                                 "DRESSAGE_PROXY_ENGINES": "[http://a:1, http://b:2]"})
    assert cfg.staleness.keep_versions == 3
    assert cfg.prompt_buffer.n_samples == 6
    assert cfg.rollout.max_retries == 5
    assert cfg.proxy.engines == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize("env, key, allowed", [
    ({"DRESSAGE_STALENESS_KEEP_VERSIONS": "-1"}, "staleness.keep_versions", ">= 0"),
    ({"DRESSAGE_ROLLOUT_MAX_RETRIES": "1000"}, "rollout.max_retries", "<= 100"),
    ({"DRESSAGE_TRAIN_LR": "0"}, "train.lr", "> 0"),
    ({"DRESSAGE_PROMPT_BUFFER_N_SAMPLES": "x"}, "prompt_buffer.n_samples", ""),
])
def test_bad_values_name_key_and_range(env: dict[str, str], key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env)
    assert key in str(info.value) and allowed in str(info.value)


def test_unknown_yaml_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("staleness:\n  keep_verions: 3\n")
    with pytest.raises(ConfigError, match="staleness.keep_verions"):
        load_config(path, env={})


def test_missing_file_and_bad_yaml_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(bad, env={})


def test_required_password_refuses_defaults_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"DRESSAGE_REDIS_REQUIRE_PASSWORD": "true", "REDIS_PASSWORD": "changeme"})
    assert "changeme" not in str(info.value) and "password" in str(info.value)
    cfg = load_config(None, env={"DRESSAGE_REDIS_REQUIRE_PASSWORD": "true", "REDIS_PASSWORD": "s3cret-long"})
    assert cfg.redis.password is not None and "s3cret" not in repr(cfg.redis)


def test_a_password_in_redis_url_satisfies_the_policy_and_is_the_one_used() -> None:
    env = {"DRESSAGE_REDIS_REQUIRE_PASSWORD": "true", "REDIS_URL": "redis://:s3cret%2Flong@127.0.0.1:6379/0"}
    assert load_config(None, env=env).redis.secret() == "s3cret/long"  # docs/gpu.md's bare-metal recipe
    with pytest.raises(ConfigError, match="password"):
        load_config(None, env={**env, "REDIS_URL": "redis://:changeme@127.0.0.1:6379/0"})
    explicit = load_config(None, env={**env, "REDIS_PASSWORD": "another-long-one"})
    assert explicit.redis.secret() == "another-long-one"  # redis.password / REDIS_PASSWORD first




@pytest.mark.parametrize("path", sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "configs" / "models").glob("*.yaml")]),
                         ids=lambda p: p.stem)
def test_every_shipped_deployment_config_loads(path: Path) -> None:
    cfg = load_config(path, env={"REDIS_PASSWORD": "a-test-only-password"})  # gpu.yaml requires one
    assert Path(cfg.prompt_buffer.dataset).suffix == ".jsonl"


def test_demo_agent_run_is_set_up_for_both_staleness_controls() -> None:
    """`make demo`'s second run: multi-turn episodes, the window on, partial rollout with a span cap,
    rollout allowed ahead of the trainer -- and its own ports and prefix, so it never meets the first run."""
    from shared.tasks import get_task

    agent = load_config(REPO / "configs/cpu-demo-agent.yaml", env={})
    first = load_config(REPO / "configs/cpu-demo.yaml", env={})
    assert get_task(agent.model.task).max_turns > 1
    eta = agent.pacing.max_versions_ahead
    assert agent.staleness.keep_versions >= 1 and eta is not None and eta >= agent.staleness.keep_versions
    assert agent.proxy.partial_rollout and agent.proxy.max_partial_rollout_preempts is not None
    assert (agent.engine.port, agent.proxy.port, agent.redis.prefix) != (first.engine.port, first.proxy.port,
                                                                        first.redis.prefix)
    assert agent.proxy.engines == [f"http://{agent.engine.host}:{agent.engine.port}"]
    assert agent.rollout.proxy_url == f"http://{agent.proxy.host}:{agent.proxy.port}"
