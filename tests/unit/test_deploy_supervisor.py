"""The supervisor with real (tiny) child processes: crash, hang, finish, restart, clean stop."""

from __future__ import annotations

import inspect
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from waits import wait_for

from tools.deploy.supervisor import (
    ProcessSpec,
    RestartPolicy,
    RunResult,
    ServiceFailed,
    Supervisor,
    tail_lines,
)

PY = sys.executable
SLEEP = "import time\nwhile True: time.sleep(0.05)"


def spec(name: str, code: str, tmp_path: Path, **kw: Any) -> ProcessSpec:
    return ProcessSpec(name=name, argv=[PY, "-c", code], log_path=tmp_path / f"{name}.log", **kw)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def run_until(sup: Supervisor, timeout: float = 10.0) -> RunResult:
    deadline = time.monotonic() + timeout
    return sup.run(stop_requested=lambda: time.monotonic() > deadline)


def test_crash_stops_the_run_with_name_exit_code_and_log_tail(tmp_path: Path) -> None:
    sup = Supervisor([spec("steady", SLEEP, tmp_path),
                      spec("crasher", "import sys, time\nprint('about to fail', flush=True)\n"
                                      "time.sleep(0.3)\nsys.exit(3)", tmp_path)], grace_s=5)
    result = run_until(sup)
    assert result.outcome == "failed"
    assert (result.name, result.exit_code) == ("crasher", 3)
    assert "about to fail" in result.tail
    assert "crasher" in result.describe() and "3" in result.describe()
    assert not any(alive(pid) for pid in sup.pids().values())  # the steady one was stopped too


def test_ends_run_exit_zero_finishes_and_stops_the_others(tmp_path: Path) -> None:
    sup = Supervisor([spec("server", SLEEP, tmp_path, tier=0),
                      spec("trainer", "import time\ntime.sleep(0.3)", tmp_path, tier=1, ends_run=True)],
                     grace_s=5)
    result = run_until(sup)
    assert result.outcome == "finished" and result.name == "trainer" and result.ok
    assert not alive(sup.pids()["server"])


def test_a_child_runs_at_its_niceness_above_the_supervisors_own(tmp_path: Path) -> None:
    code = "import os, threading\nprint('nice', os.nice(0), flush=True)\n" \
           "t = threading.Thread(target=lambda: print('thread', os.getpriority(os.PRIO_PROCESS, 0), flush=True))\n" \
           "t.start(); t.join()"
    sup = Supervisor([spec("niced", code, tmp_path, ends_run=True, nice=7),
                      spec("plain", SLEEP, tmp_path)], grace_s=5)
    assert run_until(sup).outcome == "finished"
    own = os.nice(0)
    log = (tmp_path / "niced.log").read_text()
    assert f"nice {min(19, own + 7)}" in log and f"thread {min(19, own + 7)}" in log  # threads inherit it


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_child_and_its_threads_run_under_its_scheduling_policy(tmp_path: Path) -> None:
    code = "import os, threading\nprint('policy', os.sched_getscheduler(0), flush=True)\n" \
           "t = threading.Thread(target=lambda: print('thread', os.sched_getscheduler(0), flush=True))\n" \
           "t.start(); t.join()\nimport time\ntime.sleep(1)  # the plain one has printed by then"
    sup = Supervisor([spec("idle", code, tmp_path, ends_run=True, sched="idle"),
                      spec("plain", "import os\nprint('policy', os.sched_getscheduler(0), flush=True)\n"
                           "import time\ntime.sleep(30)", tmp_path)], grace_s=5)
    assert run_until(sup).outcome == "finished"
    log = (tmp_path / "idle.log").read_text()
    assert f"policy {os.SCHED_IDLE}" in log and f"thread {os.SCHED_IDLE}" in log  # threads inherit it
    assert f"policy {os.SCHED_OTHER}" in (tmp_path / "plain.log").read_text()


def _autogroup() -> str | None:
    """This process's scheduler autogroup, or None where none applies (file missing, unreadable or empty)."""
    try:
        return Path("/proc/self/autogroup").read_text().split()[0]
    except (OSError, IndexError):
        return None


def test_a_child_has_its_own_process_group_in_the_supervisors_session(tmp_path: Path) -> None:
    # Outside the root cpu cgroup (CI's containers) /proc/self/autogroup exists but reads empty: no
    # autogroup applies there. The child, running the same _autogroup, reports None then, and the
    # process-group and session checks remain.
    code = ("import os\nfrom pathlib import Path\n" + inspect.getsource(_autogroup)
            + "print('ids', os.getpid(), os.getpgid(0), os.getsid(0), flush=True)\n"
            "print('autogroup', _autogroup(), flush=True)")
    sup = Supervisor([spec("child", code, tmp_path, ends_run=True)], grace_s=5)
    result = run_until(sup)
    assert result.outcome == "finished", result.describe()
    log = (tmp_path / "child.log").read_text()
    pid, pgid, sid = (int(x) for x in log.split("ids ", 1)[1].split()[:3])
    assert pgid == pid  # its own group: Ctrl-C at a terminal reaches the supervisor only, killpg reaches it all
    assert sid == os.getsid(0)  # not its own session: on Linux a new session is a new scheduler autogroup
    child_group, own_group = log.split("autogroup ", 1)[1].split()[0], _autogroup()
    if child_group != "None" and own_group is not None:
        assert child_group == own_group


def test_may_finish_exit_zero_keeps_the_run_going(tmp_path: Path) -> None:
    sup = Supervisor([spec("buffer", "pass", tmp_path, may_finish=True),
                      spec("trainer", "import time\ntime.sleep(0.8)", tmp_path, ends_run=True)], grace_s=5)
    result = run_until(sup)
    assert result.outcome == "finished" and result.name == "trainer"


def test_stop_request_stops_in_reverse_tier_order(tmp_path: Path) -> None:
    order = tmp_path / "order.txt"
    # Each child appends its name to a shared file when it gets SIGTERM.
    code = ("import signal, sys, time\n"
            "def h(*a):\n"
            f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, h)\n"
            f"open({str(tmp_path)!r} + '/up-' + sys.argv[1], 'w').close()\n"  # handler installed
            "while True: time.sleep(0.05)\n")
    names = ("engine", "proxy", "worker-1", "worker-2")
    specs = [ProcessSpec(name=n, argv=[PY, "-c", code, n], log_path=tmp_path / f"{n}.log", tier=t)
             for n, t in zip(names, (0, 1, 2, 2), strict=True)]
    sup = Supervisor(specs, grace_s=5)
    result = sup.run(stop_requested=lambda: all((tmp_path / f"up-{n}").exists() for n in names))
    assert result.outcome == "stopped"
    stopped = order.read_text().split()
    assert sorted(stopped[:2]) == ["worker-1", "worker-2"] and stopped[2:] == ["proxy", "engine"]
    assert all(code == 0 for code in sup.stop().values())




def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ignoring"  # the child's signal: written once SIGTERM is ignored
    code = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"open({str(ready)!r}, 'w').close()\nwhile True: time.sleep(0.05)")
    sup = Supervisor([spec("stubborn", code, tmp_path)], grace_s=0.5)
    sup.start()
    wait_for(ready.exists)
    t0 = time.monotonic()
    codes = sup.stop()
    assert codes["stubborn"] == -signal.SIGKILL
    assert time.monotonic() - t0 < 5
    assert sup.stop() == codes  # idempotent


def test_restart_with_backoff_then_budget_exhausted(tmp_path: Path) -> None:
    counter = tmp_path / "count.txt"
    code = f"open({str(counter)!r}, 'a').write('x')\nraise SystemExit(7)"
    policy = RestartPolicy(base_s=0.05, cap_s=0.2, max_restarts=3)
    sup = Supervisor([spec("flaky", code, tmp_path), spec("steady", SLEEP, tmp_path)], restart=True,
                     policy=policy, grace_s=5)
    result = run_until(sup)
    assert result.outcome == "failed" and result.name == "flaky" and result.exit_code == 7
    assert len(counter.read_text()) == 4  # first run + 3 restarts


def test_restart_recovers_a_process_that_crashes_once(tmp_path: Path) -> None:
    marker = tmp_path / "crashed-once"
    code = (f"import os, sys, time\nm = {str(marker)!r}\n"
            "if not os.path.exists(m):\n    open(m, 'w').close(); sys.exit(5)\n"
            "time.sleep(0.5)\n")
    sup = Supervisor([spec("trainer", code, tmp_path, ends_run=True)], restart=True,
                     policy=RestartPolicy(base_s=0.05), grace_s=5)
    result = run_until(sup)
    assert result.outcome == "finished" and result.name == "trainer"
    log_text = (tmp_path / "trainer.log").read_text()
    assert log_text.count("starting trainer") == 2


def test_readiness_probe_gates_the_next_tier(tmp_path: Path) -> None:
    flag = tmp_path / "ready"
    first = spec("engine", f"import time\ntime.sleep(0.4)\nopen({str(flag)!r}, 'w').close()\n{SLEEP}",
                 tmp_path, tier=0, ready=flag.exists)
    # The second tier checks that the first was ready before it started.
    second = spec("worker", f"import os, sys\nsys.exit(0 if os.path.exists({str(flag)!r}) else 9)",
                  tmp_path, tier=1, ends_run=True)
    result = run_until(Supervisor([first, second], grace_s=5))
    assert result.outcome == "finished" and result.name == "worker"


def test_process_dying_before_ready_is_reported(tmp_path: Path) -> None:
    sup = Supervisor([spec("engine", "import sys\nprint('bad model path', flush=True)\nsys.exit(2)",
                           tmp_path, ready=lambda: False)], grace_s=5)
    with pytest.raises(ServiceFailed) as err:
        sup.start()
    sup.stop()
    assert err.value.name == "engine" and err.value.exit_code == 2 and "bad model path" in err.value.tail


def test_policy_backoff_is_exponential_and_capped() -> None:
    p = RestartPolicy(base_s=1, cap_s=10, max_restarts=3, stable_s=60)
    assert [p.delay(n) for n in range(6)] == [1, 2, 4, 8, 10, 10]
    assert p.count_after(2, uptime_s=5) == 2 and p.count_after(2, uptime_s=61) == 0
    assert not p.exhausted(2) and p.exhausted(3)


def test_tail_lines_reads_only_the_end(tmp_path: Path) -> None:
    log_file = tmp_path / "x.log"
    log_file.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert tail_lines(log_file, 3).splitlines() == ["line 997", "line 998", "line 999"]
    assert tail_lines(tmp_path / "missing.log") == ""


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        Supervisor([spec("a", "pass", tmp_path), spec("a", "pass", tmp_path)])


def test_partial_stop_then_before_stop_hook_then_full_stop(tmp_path: Path) -> None:
    sup = Supervisor([spec("evaluator", SLEEP, tmp_path, tier=0), spec("worker", SLEEP, tmp_path, tier=1),
                      spec("trainer", "import time\ntime.sleep(0.3)", tmp_path, tier=0, ends_run=True)],
                     grace_s=5)
    seen: dict[str, bool] = {}

    def hook(result: RunResult) -> None:
        assert result.outcome == "finished"
        sup.stop(min_tier=1)  # the worker goes, the evaluator stays up for the hook's wait
        seen["worker"] = alive(sup.pids()["worker"])
        seen["evaluator"] = alive(sup.pids()["evaluator"])

    result = run_until_with_hook(sup, hook)
    assert result.outcome == "finished"
    assert seen == {"worker": False, "evaluator": True}
    assert not alive(sup.pids()["evaluator"])  # the full stop after the hook


def test_run_to_end_after_the_run_waits_for_the_job_or_stops_it(tmp_path: Path) -> None:
    sup = Supervisor([spec("server", SLEEP, tmp_path, tier=0),
                      spec("trainer", "import time\ntime.sleep(0.2)", tmp_path, tier=1, ends_run=True)], grace_s=5)
    codes: dict[str, int | None] = {}
    ticks: list[float] = []

    def hook(result: RunResult) -> None:
        assert result.outcome == "finished"
        job = spec("job", "import time, sys\ntime.sleep(0.5)\nsys.exit(3)", tmp_path, tier=5)
        codes["job"] = sup.run_to_end(job, 30, lambda: False, tick=lambda: ticks.append(time.monotonic()),
                                      tick_every_s=0.1)
        assert alive(sup.pids()["server"])  # the run's other processes are still up meanwhile
        hang = spec("hang", SLEEP, tmp_path, tier=6)
        t0 = time.monotonic()
        codes["hang"] = sup.run_to_end(hang, 0.5, lambda: False)
        assert time.monotonic() - t0 < 5 and not alive(sup.pids()["hang"])  # stopped at its timeout
        assert alive(sup.pids()["server"])  # ... alone: its tier only
        with pytest.raises(ValueError, match="duplicate"):
            sup.run_to_end(spec("server", "pass", tmp_path, tier=7), 1, lambda: False)

    run_until_with_hook(sup, hook)
    assert codes == {"job": 3, "hang": None}
    assert len(ticks) >= 2  # the progress tick keeps running while the job does
    assert "job" in sup.pids() and not alive(sup.pids()["server"])


def run_until_with_hook(sup: Supervisor, hook: Callable[[RunResult], None],
                        timeout: float = 10.0) -> RunResult:
    deadline = time.monotonic() + timeout
    return sup.run(stop_requested=lambda: time.monotonic() > deadline, before_stop=hook)


def test_optional_service_that_keeps_failing_is_reported_not_fatal_and_comes_back(tmp_path: Path) -> None:
    gate = tmp_path / "fixed"  # the cause goes away once this file exists
    code = f"import os, sys, time\nif not os.path.exists({str(gate)!r}): sys.exit(3)\ntime.sleep(60)\n"
    policy = RestartPolicy(base_s=0.02, cap_s=0.3, max_restarts=2, stable_s=0.5)
    sup = Supervisor([spec("eval-worker", code, tmp_path, optional=True), spec("trainer", SLEEP, tmp_path)],
                     restart=True, policy=policy, grace_s=5)
    seen: list[dict[str, str]] = []

    def tick() -> None:
        seen.append(dict(sup.degraded))
        if len(seen) == 15:
            gate.touch()

    deadline = time.monotonic() + 6.0
    result = sup.run(lambda: time.monotonic() > deadline, tick=tick, tick_every_s=0.1)
    assert result.outcome == "stopped"  # the run outlived the optional service's failures
    assert any("eval-worker" in d and "exited" in d["eval-worker"] for d in seen[:15]), seen[:15]
    assert sup.degraded == {}, sup.degraded  # healthy for stable_s after the cause went away
    assert (tmp_path / "eval-worker.log").read_text().count("starting eval-worker") >= 4


def test_optional_service_without_restart_is_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    sup = Supervisor([spec("eval-worker", "raise SystemExit(9)", tmp_path, optional=True),
                      spec("trainer", "import time; time.sleep(1.0)", tmp_path, ends_run=True)], grace_s=5)
    result = run_until(sup)
    assert result.outcome == "finished" and result.name == "trainer"
    assert "code 9" in sup.degraded["eval-worker"]


def test_restart_budget_recovers_after_a_healthy_period(tmp_path: Path) -> None:
    """Two quick crashes, a healthy run longer than stable_s, two more crashes: still within a budget of 2."""
    counter = tmp_path / "runs.txt"
    code = (f"import time\nf = open({str(counter)!r}, 'a'); f.write('x'); f.close()\n"
            f"n = len(open({str(counter)!r}).read())\n"
            "time.sleep(0.8 if n == 3 else 0.0)\nraise SystemExit(4)\n")
    policy = RestartPolicy(base_s=0.02, cap_s=0.05, max_restarts=2, stable_s=0.5)
    sup = Supervisor([spec("collector", code, tmp_path)], restart=True, policy=policy, grace_s=5)
    result = run_until(sup)
    assert result.outcome == "failed" and result.exit_code == 4
    # runs 1-3 use the budget (2 restarts), run 3 is healthy (0.8 s > stable_s): 2 more restarts allowed
    assert len(counter.read_text()) == 5
