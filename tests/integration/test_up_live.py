"""One long ``dressage up`` run, shared by the tests that read it while it is live and ended by the last:
every ``/metrics`` endpoint docs/operations.md lists is scraped, then SIGTERM stops every process cleanly.

A scrape must parse with ``prometheus_client``'s text parser and follow the naming conventions: counters
expose ``_total`` samples, durations are ``_seconds`` (never ``_s``), no area is said twice
(``dressage_train_train_...``). The run starts once for the file (a start-up is ~25 s of CPU); run alone,
either test starts it itself. The SIGTERM test must stay last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_up_e2e import CONFIG, REPO, alive, child_pids  # model_dir: tests/integration/conftest.py
from waits import wait_for

from shared.telemetry import local_replica, prometheus_port
from tools.reports.metricslog import load_rows

pytestmark = pytest.mark.slow


def free_base(span: int = 16) -> int:
    """A base port whose next `span` ports are free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + span < 65535 and all(_free(base + i) for i in range(span)):
            return base
    raise AssertionError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def check_scrape(name: str, text: str) -> set[str]:
    """Parse `text`; return the metric family names after checking the conventions."""
    families = list(text_string_to_metric_families(text))
    names = set()
    for fam in families:
        names.add(fam.name)
        assert "_train_train_" not in fam.name, (name, fam.name)
        assert not fam.name.endswith("_s"), (name, fam.name)
        if fam.type == "counter":
            assert not fam.samples or any(s.name.endswith("_total") for s in fam.samples), (name, fam.name)
        if fam.name.startswith("dressage_") and fam.type == "gauge":
            assert not fam.name.endswith("_total"), (name, fam.name)  # a gauge named like a counter
    return names


@dataclass
class LiveRun:
    proc: subprocess.Popen[str]
    run_dir: Path
    base: int  # the metrics port base


@pytest.fixture(scope="module")
def live(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """Two workers and the window controller, far more steps than the tests need (the run must not end, and
    its endpoints close, while a loaded machine is still scraping), until its first trainer report."""
    base = free_base()
    run_dir = tmp_path_factory.mktemp("live") / "run"
    env = {**os.environ, "DRESSAGE_MODEL_PATH": str(model_dir), "PYTHONUNBUFFERED": "1",
           "DRESSAGE_OPS_METRICS_PORT_BASE": str(base), "DRESSAGE_TRAIN_MAX_STEPS": "1000",
           "DRESSAGE_WINDOW_CONTROLLER_ENABLED": "true", "DRESSAGE_WINDOW_CONTROLLER_INTERVAL_S": "1"}
    env.pop("REDIS_URL", None)  # a private Redis, always
    proc = subprocess.Popen([sys.executable, "-m", "services", "up", "--config", CONFIG, "--run-dir", str(run_dir),
                             "--quiet", "--workers", "2"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: any(r.get("service") == "trainer" for r in load_rows(run_dir / "metrics.jsonl")),
                 240, "a trainer report in metrics.jsonl", process=proc, period=0.5,
                 why=lambda: why_it_stopped(proc, run_dir))
        yield LiveRun(proc, run_dir, base)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)


def why_it_stopped(proc: subprocess.Popen[str], run_dir: Path, lines: int = 15) -> str:
    """What `dressage up` printed so far (read without blocking: its services may hold the pipe) and the tail
    of each service log, for a failure of the fixture (it once exited with code 1 on a loaded machine)."""
    parts = []
    if proc.stdout is not None:
        os.set_blocking(proc.stdout.fileno(), False)
        printed = proc.stdout.read() or ""
        parts.append("--- dressage up\n" + "\n".join(printed.splitlines()[-lines:]))
    for log in sorted((run_dir / "logs").glob("*.log")):
        parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(parts)


def test_every_service_metrics_endpoint_parses_in_an_up_run(live: LiveRun) -> None:
    proc, run_dir, base = live.proc, live.run_dir, live.base
    run = json.loads((run_dir / "run.json").read_text())
    targets = {
        "engine": f"http://127.0.0.1:{run['engine_port']}/metrics",
        "proxy": f"http://127.0.0.1:{run['proxy_port']}/metrics",
        "prompt-buffer": f"http://127.0.0.1:{prometheus_port(base, 'prompt-buffer')}/metrics",
        "group-collector": f"http://127.0.0.1:{prometheus_port(base, 'group-collector')}/metrics",
        "trainer": f"http://127.0.0.1:{prometheus_port(base, 'trainer')}/metrics",
        "eval-worker": f"http://127.0.0.1:{prometheus_port(base, 'eval-worker')}/metrics",
        "window-controller": f"http://127.0.0.1:{prometheus_port(base, 'window-controller')}/metrics",
        "rollout-worker-1": f"http://127.0.0.1:{prometheus_port(base, 'rollout-worker', local_replica(1))}/metrics",
        "rollout-worker-2": f"http://127.0.0.1:{prometheus_port(base, 'rollout-worker', local_replica(2))}/metrics",
    }
    seen: dict[str, set[str]] = {}
    deadline = time.monotonic() + 60
    for name, url in targets.items():
        while True:
            try:
                r = httpx.get(url, timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"{name} serves no /metrics at {url}"
                time.sleep(0.5)
        assert r.status_code == 200, (name, r.status_code)
        seen[name] = check_scrape(name, r.text)
        if name == "trainer":  # cumulative seconds per phase are counters, not gauges
            kinds = {f.name: f.type for f in text_string_to_metric_families(r.text)}
            assert kinds.get("dressage_time_wall_seconds") == kinds.get("dressage_time_wait_seconds") == "counter"
    assert {"dressage_engine_num_running_reqs", "dressage_engine_num_queue_reqs", "dressage_engine_gen_throughput",
            "dressage_engine_token_usage", "dressage_engine_generation_tokens"} <= seen["engine"]
    assert "dressage_proxy_requests" in seen["proxy"]
    assert "dressage_train_rollout_logprob_abs_diff" in seen["trainer"], seen["trainer"]
    assert "dressage_eval_jobs_succeeded" in seen["eval-worker"]
    wait_for(lambda: "dressage_window_controller_keep_versions" in check_scrape(
        "window-controller", httpx.get(targets["window-controller"], timeout=5).text), 60,
             "the window-controller's gauge", process=proc, period=0.5)
    assert any(n.startswith("dressage_rollout_") for n in seen["rollout-worker-1"])


def test_sigterm_stops_every_service_cleanly(live: LiveRun) -> None:
    live.proc.send_signal(signal.SIGTERM)
    output, _ = live.proc.communicate(timeout=90)
    assert live.proc.returncode == 0, output
    assert "run stopped" in output
    pids = child_pids(output)
    assert {"engine", "proxy", "trainer", "window-controller", "rollout-worker-1", "rollout-worker-2"} <= set(pids)
    assert not any(alive(pid) for pid in pids.values())
    for name in ("trainer", "group-collector", "prompt-buffer", "window-controller", "rollout-worker-1",
                 "rollout-worker-2"):
        assert "signal 15 received" in (live.run_dir / "logs" / f"{name}.log").read_text(), name
