"""The pure and small parts of ``dressage up``: plan, prefixes, URLs, ports, progress line, health,
metric log, and the fakeredis TCP fallback."""

from __future__ import annotations

import io
import json
import os
import socket
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from shared.config import load_config
from shared.errors import ConfigError
from shared.keys import Keys
from shared.telemetry import heartbeat, report_metrics
from tools.deploy import redisboot
from tools.deploy.plan import RunChoices, build_plan, deferred_evaluation, public_url, run_prefix
from tools.deploy.ports import NoFreePort, PortClaims
from tools.deploy.progress import Progress, progress_line
from tools.monitor import health
from tools.reports.metricslog import MetricsLog, load_rows


def choices(tmp_path: Path, **kw: Any) -> RunChoices:
    base: dict[str, Any] = dict(config_path="configs/cpu-demo.yaml", run_dir=tmp_path / "run",
                                redis_url="redis://127.0.0.1:7777/0", prefix="dressage-r1", workers=3,
                                engine_port=31000, proxy_port=8811, max_steps=7, python="/py")
    base.update(kw)
    return RunChoices(**base)


def test_plan_has_every_service_in_tiers_with_run_env(tmp_path: Path) -> None:
    cfg = load_config("configs/cpu-demo.yaml", env={})
    specs = build_plan(cfg, choices(tmp_path))
    names = [s.name for s in specs]
    assert names == ["engine", "proxy", "trainer", "group-collector", "eval-worker", "prompt-buffer",
                     "rollout-worker-1", "rollout-worker-2", "rollout-worker-3"]
    tiers = [s.tier for s in specs]
    assert tiers == sorted(tiers) and tiers[0] < tiers[1] < tiers[2] and tiers[-1] > tiers[5]
    by = {s.name: s for s in specs}
    assert by["trainer"].ends_run and by["prompt-buffer"].may_finish and not by["engine"].ends_run
    assert by["engine"].ready is not None and by["proxy"].ready is not None and by["trainer"].ready is None
    env = by["rollout-worker-2"].env
    assert env["REDIS_URL"] == env["DRESSAGE_REDIS_URL"] == "redis://127.0.0.1:7777/0"
    assert env["DRESSAGE_REDIS_PREFIX"] == "dressage-r1" and env["DRESSAGE_TRAIN_MAX_STEPS"] == "7"
    assert env["DRESSAGE_ROLLOUT_PROXY_URL"] == "http://127.0.0.1:8811"
    assert json.loads(env["DRESSAGE_PROXY_ENGINES"]) == ["http://127.0.0.1:31000"]
    assert env["DRESSAGE_TRAIN_CHECKPOINT_DIR"] == str(tmp_path / "run" / "checkpoints")
    assert env["DRESSAGE_CONSUMER"].endswith("-rollout-worker-2") and env["DRESSAGE_REPLICA"] == "9"  # port base+2+9 = base+11
    assert list(by["trainer"].argv) == ["/py", "-m", "services", "trainer", "--config", "configs/cpu-demo.yaml"]
    assert by["proxy"].log_path == tmp_path / "run" / "logs" / "proxy.log"
    # Every child's env is valid config for the services it overrides.
    merged = load_config("configs/cpu-demo.yaml", env=env)
    assert merged.proxy.port == 8811 and merged.redis.prefix == "dressage-r1" and merged.train.max_steps == 7


def test_service_threads_set_omp_threads_of_those_services_only(tmp_path: Path) -> None:
    cfg = load_config("configs/cpu-demo.yaml", env={}, overrides={"ops": {"service_threads": {"trainer": 1,
                                                                                              "rollout-worker": 2}}})
    by = {s.name: s.env for s in build_plan(cfg, choices(tmp_path))}
    assert by["trainer"]["OMP_NUM_THREADS"] == "1" and by["rollout-worker-3"]["OMP_NUM_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in by["engine"] or by["engine"]["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS")


def test_service_nice_lowers_the_priority_of_those_services_only(tmp_path: Path) -> None:
    cfg = load_config("configs/cpu-demo.yaml", env={}, overrides={"ops": {"service_nice": {"eval-worker": 10,
                                                                                           "rollout-worker": 3}}})
    by = {s.name: s.nice for s in build_plan(cfg, choices(tmp_path))}
    assert by["eval-worker"] == 10 and by["rollout-worker-1"] == by["rollout-worker-2"] == 3
    assert by["trainer"] == by["engine"] == 0


@pytest.mark.parametrize("bad, named", [({"trainer": 20}, "between 0 and 19"), ({"trainer": -1}, "between 0 and 19"),
                                        ({"trainr": 1}, "unknown service 'trainr'")])
def test_service_nice_refuses_unknown_services_and_out_of_range_values(bad: dict[str, int], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config("configs/cpu-demo.yaml", env={}, overrides={"ops": {"service_nice": bad}})


def test_service_sched_sets_the_policy_of_those_services_only(tmp_path: Path) -> None:
    cfg = load_config("configs/cpu-demo.yaml", env={}, overrides={"ops": {"service_sched": {"engine": "idle",
                                                                                            "rollout-worker": "batch"}}})
    by = {s.name: s.sched for s in build_plan(cfg, choices(tmp_path))}
    assert by["engine"] == "idle" and by["rollout-worker-1"] == by["rollout-worker-2"] == "batch"
    assert by["trainer"] is None and by["proxy"] is None


@pytest.mark.parametrize("bad, named", [({"trainer": "fifo"}, "service_sched.trainer"),
                                        ({"trainr": "idle"}, "unknown service 'trainr'")])
def test_service_sched_refuses_unknown_services_and_policies(bad: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config("configs/cpu-demo.yaml", env={}, overrides={"ops": {"service_sched": bad}})


def test_progress_tick_samples_the_probe_into_the_ops_row(tmp_path: Path) -> None:
    r = fakeredis.FakeRedis()
    keys = Keys("p")
    prog = Progress(r, keys, MetricsLog(tmp_path / "metrics.jsonl"), 10, show=False,
                    probe=lambda: {"engine/busy_s": 12.5, "proxy/weight_update_s": 0.75})
    prog.finish()
    ops = [row for row in load_rows(tmp_path / "metrics.jsonl") if row["service"] == "ops"]
    assert ops[-1]["engine/busy_s"] == 12.5 and ops[-1]["proxy/weight_update_s"] == 0.75


def test_plan_without_eval_has_no_eval_worker(tmp_path: Path) -> None:
    cfg = load_config("configs/cpu-demo.yaml", env={"DRESSAGE_EVAL_EVERY_VERSIONS": "0"})
    assert "eval-worker" not in [s.name for s in build_plan(cfg, choices(tmp_path, workers=1))]
    assert deferred_evaluation(cfg, choices(tmp_path)) is None


def test_deferred_evaluation_is_a_burst_eval_worker_after_the_run_in_a_tier_of_its_own(tmp_path: Path) -> None:
    live = load_config("configs/cpu-demo.yaml", env={"DRESSAGE_OPS_SERVICE_NICE": '{"eval-worker": 19}'})
    assert deferred_evaluation(live, choices(tmp_path)) is None
    cfg = load_config("configs/cpu-demo.yaml", env={"DRESSAGE_EVAL_DEFER": "true",
                                                    "DRESSAGE_OPS_SERVICE_NICE": '{"eval-worker": 19}'})
    specs = build_plan(cfg, choices(tmp_path))
    assert "eval-worker" not in [s.name for s in specs]  # nothing evaluates while the run is measured
    after = deferred_evaluation(cfg, choices(tmp_path))
    assert after is not None and after.name == "eval-worker" and after.nice == 19
    assert list(after.argv)[-1] == "--burst" and after.tier > max(s.tier for s in specs)
    assert after.env["DRESSAGE_EVAL_QUEUE"] == "dressage-r1-eval"  # the run's own queue, where its jobs wait
    assert after.env["DRESSAGE_TRAIN_CHECKPOINT_DIR"] == str(tmp_path / "run" / "checkpoints")


def test_status_expects_an_eval_worker_only_when_it_runs_live(monkeypatch: pytest.MonkeyPatch) -> None:
    from tools.monitor.status import parse_args, resolve_target

    monkeypatch.delenv("REDIS_URL", raising=False)
    for defer, expected in (("false", True), ("true", False)):
        monkeypatch.setenv("DRESSAGE_EVAL_DEFER", defer)
        target = resolve_target(parse_args(["--config", "configs/cpu-demo.yaml"]))
        assert ("eval-worker" in target.expected) is expected, defer  # deferred: none runs during the run


def test_run_prefix_is_a_valid_prefix() -> None:
    assert run_prefix("dressage", "20250101-120000") == "dressage-20250101-120000"
    odd = run_prefix("dressage", "my run:1/x")
    assert odd == "dressage-my-run-1-x"
    load_config(None, env={"DRESSAGE_REDIS_PREFIX": odd})  # passes the prefix validator


def test_public_url_drops_credentials() -> None:
    assert public_url("redis://:s3cret@redis:6379/0") == "redis://redis:6379/0"
    assert public_url("redis://user:pw@10.0.0.1/2") == "redis://10.0.0.1/2"


def test_a_port_bound_by_anyone_is_not_used(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        other = PortClaims(tmp_path).claim("127.0.0.1", busy)
        assert other != busy and other > 0


def test_a_port_another_run_claimed_is_not_used_even_while_it_still_binds(tmp_path: Path) -> None:
    """Two runs started together: the first has not bound its port yet, the second must not pick it too."""
    first, second = PortClaims(tmp_path), PortClaims(tmp_path)
    port = first.claim("127.0.0.1", _a_free_port())
    assert second.claim("127.0.0.1", port) != port
    first.release()
    assert PortClaims(tmp_path).claim("127.0.0.1", port) == port  # given back when the run ends


def test_no_usable_claims_directory_is_a_clear_error_naming_it(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a file where the claims directory should be: nothing can be claimed
    with pytest.raises(NoFreePort, match="a-file"):
        PortClaims(blocked / "claims").claim("127.0.0.1", _a_free_port())


def _a_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_progress_line_from_rows_and_stats() -> None:
    rows = [{"service": "trainer", "train/step": 4, "train/reward_mean": 0.5},
            {"service": "eval", "eval/accuracy": 0.25, "eval/version": "0"},
            {"service": "trainer", "train/step": 5, "train/reward_mean": 0.625}]
    stats = {"groups_produced": 30, "groups_trained": 20, "groups_dead_lettered": 1, "groups_dropped_stale": 2,
             "groups_reenqueued": 3, "poison_dead_lettered": 1}
    line = progress_line(rows, stats, "5", 40, 125)
    assert line == ("step 5/40 | v5 | reward 0.625 | eval 0.25 (v0) | in flight 9 | dropped 2 | retried 3 | "
                    "dead 2 | 2m05s")
    assert progress_line([], {}, None, None, 0).startswith("step - | v- | reward - | eval -")


def test_progress_tick_logs_metrics_and_reports_stats(tmp_path: Path) -> None:
    r = fakeredis.FakeRedis()
    keys = Keys("p")
    report_metrics(r, keys, "trainer", {"train/step": 1, "train/reward_mean": 0.5})
    r.hset(keys.stats, mapping={"groups_produced": 8, "groups_trained": 4})
    out = io.StringIO()
    prog = Progress(r, keys, MetricsLog(tmp_path / "metrics.jsonl"), 10, out=out, plain_every_s=0)
    prog.tick()
    assert "step 1/10" in out.getvalue() and "in flight 4" in out.getvalue()
    report_metrics(r, keys, "trainer", {"train/step": 2})
    prog.finish()
    rows = load_rows(tmp_path / "metrics.jsonl")
    assert [r.get("train/step") for r in rows if r["service"] == "trainer"] == [1, 2]
    ops = [r for r in rows if r["service"] == "ops"]
    assert ops and ops[0]["stats/groups_produced"] == 8  # the first snapshot was pulled back by finish()
    # A re-opened log continues after its last id: nothing is written twice.
    again = MetricsLog(tmp_path / "metrics.jsonl")
    assert again.pull(r, keys) == [] and len(load_rows(tmp_path / "metrics.jsonl")) == len(rows)


def test_health_checks_own_consumer_unless_any(monkeypatch: pytest.MonkeyPatch) -> None:
    r = fakeredis.FakeRedis()
    keys = Keys("p")
    monkeypatch.delenv("DRESSAGE_CONSUMER", raising=False)
    heartbeat(r, keys, "rollout-worker", "otherhost-12", ttl_s=10)
    assert not health.is_alive(r, health.patterns(keys, "rollout-worker", any_consumer=False))
    assert health.is_alive(r, health.patterns(keys, "rollout-worker", any_consumer=True))
    heartbeat(r, keys, "rollout-worker", f"{socket.gethostname()}-1", ttl_s=10)
    assert health.is_alive(r, health.patterns(keys, "rollout-worker", any_consumer=False))
    monkeypatch.setenv("DRESSAGE_CONSUMER", "w-9")
    assert health.patterns(keys, "x", False) == "p:health:x:w-9"
    assert not health.is_alive(r, health.patterns(keys, "trainer", any_consumer=True))


def test_health_cli_exit_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    server = fakeredis.FakeServer()
    monkeypatch.setattr("shared.config.RedisConfig.client",
                        lambda self, decode_responses=False: fakeredis.FakeRedis(server=server))
    monkeypatch.delenv("DRESSAGE_REDIS_PREFIX", raising=False)
    assert health.main(["trainer", "--any"]) == 1
    heartbeat(fakeredis.FakeRedis(server=server), Keys("dressage"), "trainer", "trainer", ttl_s=10)
    assert health.main(["trainer", "--any"]) == 0


def test_fakeredis_tcp_fallback_serves_streams(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(redisboot, "find_redis_server", lambda: None)
    handle = redisboot.private_redis(tmp_path)
    try:
        assert handle.kind == "fakeredis"
        r = redis.Redis.from_url(handle.url)
        r.xadd("s", {"a": "1"})
        assert r.xlen("s") == 1
        r.close()
    finally:
        handle.stop()
    with pytest.raises(redisboot.NoRedisAvailable):
        redisboot.private_redis(tmp_path, allow_fake=False)


def test_external_redis_url_is_used_as_is(tmp_path: Path) -> None:
    handle = redisboot.resolve_redis("redis://example:6379/0", tmp_path)
    assert (handle.kind, handle.url) == ("external", "redis://example:6379/0")
    handle.stop()  # nothing to stop, must not fail
