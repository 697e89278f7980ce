"""The pre-imported launcher (tools/deploy/prefork.py) with real forked children: a forked service gets what an
exec'd one gets, every exit is reported with Popen's convention, the launcher's death ends its services, and the
supervisor forks ``prefork`` specs from it (and execs them when no launcher can start)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from paths import REPO
from test_deploy_supervisor import alive, run_until
from waits import wait_for

from shared.config import DressageConfig
from tools.deploy.plan import prefork_module
from tools.deploy.prefork import Launcher, LauncherFailed
from tools.deploy.supervisor import ProcessSpec, RestartPolicy, Supervisor

PY = sys.executable

PROBE = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    atexit.register(lambda: print("atexit ran", flush=True))
    def late():
        time.sleep(0.2)
        print("thread joined", flush=True)
    threading.Thread(target=late).start()  # not a daemon: the interpreter's exit waits for it
    fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
    with open(os.environ["PROBE_VALUE"] + ".json", "w") as fh:
        json.dump({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                   "own_group": os.getpgid(0) == os.getpid(), "sid": os.getsid(0), "fds": fds,
                   "stdin": sys.stdin.read(), "nice": os.nice(0), "name": __name__,
                   "threads": __import__("torch").get_num_threads() if "torch" in sys.modules else None}, fh)
    print("probe out", flush=True)
    print("probe err", file=sys.stderr, flush=True)
    code = os.environ.get("PROBE_EXIT", "0")
    if code == "raise":
        raise RuntimeError("probe failed on purpose")
    if code == "sleep":
        while True:
            time.sleep(0.05)
    sys.exit(int(code))
""")


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


@pytest.fixture
def launcher() -> Iterator[Launcher]:
    started = Launcher(PY, ["json"])
    started.start()
    yield started
    started.close()


def spawn(launcher: Launcher, cwd: Path, exit_code: str = "0", **env: str) -> Any:
    return launcher.spawn("probe", ["a", "--b"], {**os.environ, "PROBE_VALUE": "v", "PROBE_EXIT": exit_code, **env},
                          str(cwd), str(cwd / "probe.log"), 0, None)


def test_a_forked_service_gets_argv_env_cwd_group_log_and_an_interpreter_exit(launcher: Launcher,
                                                                               probe_dir: Path) -> None:
    proc = spawn(launcher, probe_dir, "3")
    assert proc.wait(20) == 3 and proc.returncode == 3
    seen = json.loads((probe_dir / "v.json").read_text())
    assert seen["argv"] == [str(probe_dir / "probe.py"), "a", "--b"]  # as ``python -m probe a --b`` sets it
    assert seen["cwd"] == str(probe_dir) and seen["env"] == "v" and seen["name"] == "__main__"
    assert seen["own_group"] and seen["sid"] == os.getsid(0)  # its own group, the supervisor's session
    assert seen["fds"] == [0, 1, 2, 3] and seen["stdin"] == ""  # 3: listdir's own; nothing of the launcher's
    log = (probe_dir / "probe.log").read_text()
    assert "probe out" in log and "probe err" in log
    assert log.index("thread joined") < log.index("atexit ran")  # threads joined, then atexit, as on exit


def test_exits_by_exception_and_by_signal_read_as_popen_reads_them(launcher: Launcher, probe_dir: Path) -> None:
    failed = spawn(launcher, probe_dir, "raise")
    assert failed.wait(20) == 1
    assert "RuntimeError: probe failed on purpose" in (probe_dir / "probe.log").read_text()
    for sig in (signal.SIGKILL, signal.SIGTERM):
        sleeper = spawn(launcher, probe_dir, "sleep")
        wait_for(lambda: (probe_dir / "v.json").exists(), 20, "the probe running")
        sleeper.send_signal(sig)
        assert sleeper.wait(20) == -sig
        sleeper.send_signal(signal.SIGKILL)  # reaped: a no-op, never a signal to a reused pid
        (probe_dir / "v.json").unlink()


def test_the_launchers_death_ends_its_services_and_they_read_as_ended(launcher: Launcher, probe_dir: Path) -> None:
    sleeper = spawn(launcher, probe_dir, "sleep")
    wait_for(lambda: (probe_dir / "v.json").exists(), 20, "the probe running")
    assert launcher.proc is not None
    launcher.proc.kill()
    assert sleeper.wait(20) == -signal.SIGTERM
    wait_for(lambda: not alive(sleeper.pid), 20, "the forked service gone (parent-death signal)")
    with pytest.raises(LauncherFailed):
        spawn(launcher, probe_dir)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("parent_gone", [False, True])
def test_a_child_whose_parent_died_before_the_signal_was_armed_ends_at_once(parent_gone: bool) -> None:
    # The window between a fork and PR_SET_PDEATHSIG: a parent gone by then would leave the child running
    # for ever; die_with_parent compares getppid() with the parent it was forked from. A pid that is not
    # our parent stands for the dead one (our parent is then the reaper).
    code = ("import os, time; from tools.deploy.childsetup import die_with_parent; "
            f"die_with_parent({'os.getppid() + 1_000_000' if parent_gone else 'os.getppid()'}); time.sleep(0.5)")
    proc = subprocess.run([PY, "-c", code], cwd=REPO, timeout=60)
    assert proc.returncode == (-signal.SIGTERM if parent_gone else 0)


def test_a_thread_count_in_the_services_environment_reaches_torch_imported_by_the_launcher(probe_dir: Path) -> None:
    launcher = Launcher(PY, ["torch"])
    launcher.start()
    try:
        proc = spawn(launcher, probe_dir, OMP_NUM_THREADS="1")
        assert proc.wait(60) == 0
        assert json.loads((probe_dir / "v.json").read_text())["threads"] == 1
    finally:
        launcher.close()


def probe_spec(probe_dir: Path, name: str, prefork: str | None, **kw: Any) -> ProcessSpec:
    return ProcessSpec(name=name, argv=[PY, "-m", "probe"], cwd=str(probe_dir), log_path=probe_dir / f"{name}.log",
                       env={"PROBE_VALUE": name, **kw.pop("env", {})}, prefork=prefork, **kw)


def test_the_supervisor_forks_prefork_specs_restarts_them_forked_and_stops_the_launcher(probe_dir: Path) -> None:
    crashing = probe_spec(probe_dir, "crasher", "json", env={"PROBE_EXIT": "5"}, nice=3)
    steady = probe_spec(probe_dir, "steady", "json", env={"PROBE_EXIT": "sleep"})
    sup = Supervisor([steady, crashing], restart=True, grace_s=5, policy=RestartPolicy(base_s=0.05, max_restarts=2))
    result = run_until(sup, 30)
    assert (result.outcome, result.name, result.exit_code) == ("failed", "crasher", 5)
    assert (probe_dir / "crasher.log").read_text().count("probe out") == 3  # first start and 2 restarts, forked
    assert json.loads((probe_dir / "crasher.json").read_text())["nice"] == os.nice(0) + 3
    launcher = sup._launcher
    assert launcher is not None and launcher.proc is not None and launcher.proc.poll() is not None  # stopped
    assert not any(alive(pid) for pid in sup.pids().values())


def test_without_a_launcher_the_supervisor_execs_the_service(probe_dir: Path) -> None:
    spec = probe_spec(probe_dir, "alone", "no_such_module_to_preload", ends_run=True)
    result = run_until(Supervisor([spec], grace_s=5), 60)
    assert result.outcome == "finished"  # the launcher failed to import; the service ran as its own process
    assert json.loads((probe_dir / "alone.json").read_text())["env"] == "alone"


def test_only_cpu_services_that_load_torch_are_preforked_and_only_with_prefork_on() -> None:
    cfg = DressageConfig()
    assert prefork_module(cfg, "trainer") == "services.trainer.main"
    assert prefork_module(cfg, "engine") == "services.engine.main"
    assert prefork_module(cfg, "eval-worker") == "services.eval_worker.main"
    assert prefork_module(cfg, "proxy") is None and prefork_module(cfg, "rollout-worker") is None
    gpu = DressageConfig.model_validate({"train": {"device": "cuda"}, "engine": {"device": "cuda:1"}})
    assert prefork_module(gpu, "trainer") is None and prefork_module(gpu, "engine") is None
    off = DressageConfig.model_validate({"ops": {"prefork": False}})
    assert prefork_module(off, "trainer") is None
