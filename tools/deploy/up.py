"""``dressage up``: the whole pipeline as local processes, supervised, with progress and a report.

Wiring only: config -> (``--demo``: data + tiny model) -> Redis (``REDIS_URL`` or a private one) ->
process plan -> supervisor loop with a progress tick -> metrics.jsonl + report. Everything of a run
lives in ``runs/<name>/``: ``logs/<service>.log``, ``checkpoints/``, ``redis/`` (private Redis data),
``metrics.jsonl``, ``report/``, and ``run.json`` (Redis URL without credentials + prefix, read by
``dressage status``). The run ends when the trainer exits 0 after ``train.max_steps`` (success: the
workers stop first and the last evaluation is awaited, bounded; with ``eval.defer`` a burst eval
worker then runs every queued evaluation, bounded), on
Ctrl-C/SIGTERM (clean stop), or when a service dies (failure naming it, unless ``--restart``).
Exit code: 0 finished or stopped, 1 a service failed, 2 bad configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.config import DressageConfig, load_config
from shared.errors import ConfigError
from shared.keys import Keys
from shared.lifecycle import StopFlag
from shared.logs import setup_logging
from shared.tasks.registry import TASK_NAMES
from shared.versionbus import read_latest
from shared.versions import version_number
from tools.deploy.plan import TIER_SOURCE, RunChoices, build_plan, deferred_evaluation, public_url, run_prefix
from tools.deploy.ports import NoFreePort, PortClaims
from tools.deploy.progress import Progress
from tools.deploy.redisboot import NoRedisAvailable, resolve_redis
from tools.deploy.supervisor import RestartPolicy, RunResult, Supervisor, tail_lines
from tools.monitor.probes import ServiceProbe
from tools.reports.decisionlog import CONTROLLER_FILE, DecisionFile, controller_records, load_records
from tools.reports.decisionlog import FILE as DECISIONS_FILE
from tools.reports.metricslog import MetricsLog

log = logging.getLogger(__name__)
DEMO_MAX_STEPS = 40  # used by --demo when neither --max-steps nor train.max_steps is set
FINAL_EVAL_WAIT_S = 120.0  # after the last step: how long to wait for the last version's evaluation
DEFERRED_EVAL_WAIT_S = 1800.0  # eval.defer: how long the burst eval worker may take for all queued versions
LANDED_WAIT_S = 15.0  # eval.defer: after the burst worker, for its last rows to reach metrics.jsonl


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dressage up", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--config", default="configs/cpu-demo.yaml", help="deployment YAML (all services)")
    p.add_argument("--workers", type=int, help="rollout-worker replicas (default: ops.workers)")
    p.add_argument("--restart", action="store_true", help="restart a dead service with backoff instead of stopping")
    p.add_argument("--demo", action="store_true", help="prepare data + tiny model, bounded run, report at the end")
    p.add_argument("--max-steps", type=int, help="trainer steps before the run ends (train.max_steps)")
    p.add_argument("--run-dir", help="run folder (default: <ops.run_dir>/<timestamp>)")
    p.add_argument("--prefix", help="Redis prefix (default: <redis.prefix>-<run name>)")
    p.add_argument("--no-report", action="store_true", help="skip the report at the end")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    return p.parse_args(argv)


def prepare_demo(cfg: DressageConfig, logs: Path) -> None:
    """Generated datasets and the tiny warm-started model, built only when missing."""
    logs.mkdir(parents=True, exist_ok=True)
    steps: list[tuple[str, list[str]]] = []
    datasets = [Path(cfg.prompt_buffer.dataset), Path(cfg.eval.dataset)]
    if not all(d.exists() for d in datasets):
        out = Path(cfg.prompt_buffer.dataset).parent.parent
        steps.append(("make-data", ["make-data", "--out", str(out), "--tasks", cfg.model.task]))
    # Idempotent: --if-missing returns at once when the directory already holds a complete model.
    steps.append(("init-model", ["init-model", "--task", cfg.model.task, "--out", cfg.model.path, "--if-missing",
                                 "--warm-steps", str(cfg.model.warm_steps), "--seed", str(cfg.model.seed),
                                 "--guess-share", str(cfg.model.warm_guess_share),
                                 *([] if cfg.model.task in TASK_NAMES else ["--dataset", cfg.prompt_buffer.dataset])]))
    for name, args in steps:
        sys.stdout.write(f"preparing: dressage {' '.join(args)} (log: {logs / (name + '.log')})\n")
        sys.stdout.flush()
        with (logs / f"{name}.log").open("ab") as fh:
            code = subprocess.call([sys.executable, "-m", "services", *args], stdout=fh, stderr=subprocess.STDOUT)
        if code != 0:
            raise RuntimeError(f"{name} failed with exit code {code}:\n{tail_lines(logs / (name + '.log'))}")


def wait_final_eval(progress: Progress, every: int, timeout_s: float, stopped: Callable[[], bool]) -> bool:
    """After the trainer's last step, wait (bounded) for the evaluation of the last evaluated version."""
    latest = read_latest(progress.r, progress.keys)
    number = version_number(latest.version) if latest is not None else None
    if number is None or number < 0:
        return False
    target = str(number // every * every)
    deadline = time.monotonic() + timeout_s
    log.info("waiting up to %.0fs for the evaluation of version=%s", timeout_s, target)
    while time.monotonic() < deadline and not stopped():
        progress.tick()
        if any(str(r.get("eval/version")) == target for r in progress.metrics.rows):
            return True
        time.sleep(0.25)
    log.warning("no evaluation of version=%s within %.0fs", target, timeout_s)
    return False


def report_degraded(r: Any, key: str, degraded: dict[str, str]) -> None:
    """Mirror the supervisor's down optional services into ``{p}:ops:degraded`` for ``dressage status``."""
    import redis

    try:
        with r.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if degraded:
                pipe.hset(key, mapping=degraded)
            pipe.execute()
    except redis.RedisError as exc:  # Redis restarting: the next tick writes it again
        log.warning("could not write %s: %s", key, exc)


def write_run_info(run_dir: Path, cfg: DressageConfig, choices: RunChoices, services: list[str]) -> None:
    info = {"redis_url": public_url(choices.redis_url), "prefix": choices.prefix, "config": choices.config_path,
            "run_dir": str(run_dir), "started_at": time.time(), "pid": os.getpid(), "services": services,
            "engine_port": choices.engine_port, "proxy_port": choices.proxy_port,
            "engines": [f"http://{cfg.engine.host}:{choices.engine_port}"]}
    (run_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    runs = Path(cfg.ops.run_dir)
    if run_dir.resolve().parent == runs.resolve():
        tmp = runs / ".latest.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, runs / "latest")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("up")
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        sys.stderr.write(f"dressage up: {exc}\n")
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.ops.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    max_steps = args.max_steps or cfg.train.max_steps or (DEMO_MAX_STEPS if args.demo else None)
    if args.demo:
        try:
            prepare_demo(cfg, run_dir / "logs")
        except RuntimeError as exc:
            sys.stderr.write(f"dressage up: {exc}\n")
            return 1
    stop = StopFlag().install()
    try:
        handle = resolve_redis(os.environ.get("REDIS_URL"), run_dir / "redis")
    except (NoRedisAvailable, RuntimeError) as exc:
        sys.stderr.write(f"dressage up: {exc}\n")
        return 1
    ports = PortClaims()  # held until the run ends: a run started beside this one picks other ports
    try:
        engine_port = ports.claim(cfg.engine.host, cfg.engine.port)
        proxy_port = ports.claim(cfg.proxy.host, cfg.proxy.port)
    except NoFreePort as exc:
        sys.stderr.write(f"dressage up: {exc}\n")
        ports.release()
        handle.stop()
        return 1
    try:
        choices = RunChoices(
            config_path=args.config, run_dir=run_dir, redis_url=handle.url,
            prefix=args.prefix or run_prefix(cfg.redis.prefix, run_dir.name),
            workers=args.workers or cfg.ops.workers, max_steps=max_steps,
            engine_port=engine_port, proxy_port=proxy_port)
        specs = build_plan(cfg, choices)
        write_run_info(run_dir, cfg, choices, sorted({s.argv[3] for s in specs}))  # argv: py -m services <svc>
        sys.stdout.write(f"run {run_dir} | redis {public_url(handle.url)} ({handle.kind}) prefix {choices.prefix}"
                         f" | {len(specs)} processes | logs in {run_dir / 'logs'}\n"
                         f"watch it: dressage status --run {run_dir} --watch\n")
        pw = cfg.redis.secret()
        import redis

        r = redis.Redis.from_url(handle.url, password=pw, socket_connect_timeout=5, socket_timeout=10)
        keys = Keys(choices.prefix)
        # /v1/rollout/state is operator scope (docs/security.md): the agent key alone gets 403 there
        proxy_key = cfg.proxy.operator_key.get_secret_value() if cfg.proxy.operator_key else None
        probe = ServiceProbe([f"http://{cfg.engine.host}:{choices.engine_port}"],
                             f"http://{cfg.proxy.host}:{choices.proxy_port}", proxy_token=proxy_key)
        progress = Progress(r, keys, MetricsLog(run_dir / "metrics.jsonl"), max_steps, show=not args.quiet,
                            probe=probe.sample)
        sup = Supervisor(specs, restart=args.restart, grace_s=cfg.ops.stop_grace_s,
                         policy=RestartPolicy(max_restarts=cfg.ops.restart_max))
        probe.pids = sup.pids  # CPU seconds per service in every stats snapshot
        deferred = deferred_evaluation(cfg, choices)

        def finish_evaluation(res: RunResult) -> None:
            progress.sample_now()  # the engine's and proxy's clocks at the end of the trainer loop
            if res.outcome != "finished" or cfg.eval.every_versions == 0 or stop.is_set:
                return
            sup.stop(min_tier=TIER_SOURCE)  # no new rollouts; a live eval worker keeps going
            if deferred is not None:  # eval.defer: every published version's evaluation runs now
                log.info("running the deferred evaluations (%s --burst)", deferred.name)
                code = sup.run_to_end(deferred, DEFERRED_EVAL_WAIT_S, lambda: stop.is_set, tick=progress.tick)
                if code != 0:
                    log.warning("deferred evaluation ended with %s: see %s", code, deferred.log_path)
                    return
            wait_final_eval(progress, cfg.eval.every_versions,
                            LANDED_WAIT_S if deferred is not None else FINAL_EVAL_WAIT_S, lambda: stop.is_set)

        degraded_key = keys.ops_degraded

        logs_kept = [DecisionFile(run_dir / DECISIONS_FILE)]  # the collector's decisions, for `dressage replay`
        if cfg.window_controller.enabled:  # and the adaptive window's, with their inputs
            logs_kept.append(DecisionFile(run_dir / CONTROLLER_FILE, read=controller_records))

        def tick() -> None:
            progress.tick()
            report_degraded(r, degraded_key, sup.degraded)
            for kept in logs_kept:
                kept.sync(r, keys)

        result = sup.run(lambda: stop.is_set, tick=tick, before_stop=finish_evaluation)
        progress.finish()
        for kept in logs_kept:
            kept.sync(r, keys)
        sys.stdout.write(result.describe() + "\n")
        if not result.ok:
            sys.stderr.write(f"--- last lines of {result.name} ({run_dir / 'logs' / f'{result.name}.log'}):\n"
                             f"{result.tail}\n")
        if not args.no_report and (args.demo or result.outcome == "finished"):
            from tools.reports.report import build_report

            files = build_report(progress.metrics.rows, run_dir / "report", f"Dressage run {run_dir.name}",
                                 slots=choices.workers * cfg.rollout.concurrency,
                                 decisions=load_records(run_dir / DECISIONS_FILE))
            sys.stdout.write(f"\n{files.table}\n\nreport: {files.html}\nmetrics: {run_dir / 'metrics.jsonl'}\n")
        return 0 if result.ok else 1
    finally:
        ports.release()
        handle.stop()


if __name__ == "__main__":
    raise SystemExit(main())
