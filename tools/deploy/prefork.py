"""The pre-imported launcher of ``dressage up``: torch and transformers imported once, each CPU service forked.

The trainer, the engine and the eval worker each spend seconds of CPU importing torch and transformers'
modelling code before they do anything (about 4 s apiece on two cores). With ``ops.prefork`` the supervisor
starts one launcher that imports them and the services' modules, and forks every such service from it: the
service starts with its imports done, and a restarted service too.

Contract:
* the launcher is a child of the supervisor in its session (one scheduler autogroup with the services), in
  a process group of its own, and dies with the supervisor (parent-death signal); it holds no thread, socket
  or file of its own making beyond two raw pipe ends, so a fork inherits nothing but imports;
* a forked service gets what an exec'd one gets: its own process group, the parent-death signal (it dies
  with the launcher), its niceness and scheduling policy, stdin from /dev/null, stdout and stderr to its log
  (or the supervisor's own), every other descriptor closed, the spec's environment and working directory,
  and ``sys.argv`` as ``python -m`` sets it; it then runs its module as ``__main__`` and exits through the
  interpreter (non-daemon threads joined, atexit run, an uncaught exception printed, exit code 1);
* torch read ``OMP_NUM_THREADS`` when the launcher imported it, so a service whose environment names a
  thread count has it applied with ``torch.set_num_threads``;
* every exit is reported to the supervisor with ``subprocess.Popen``'s convention (minus the signal number
  for a service killed by one), and ``ForkedProcess`` offers the part of Popen the supervisor uses;
* the launcher gone (killed, or a broken pipe) ends its services (parent-death signal); the supervisor then
  reads them as exited with -SIGTERM and its next spawn starts a fresh launcher.
Wire (JSON lines): supervisor -> launcher ``{"module", "args", "env", "cwd", "log", "nice", "sched"}``;
launcher -> supervisor ``{"ready": true}`` once, ``{"pid": n}`` per request, ``{"exit": pid, "code": c}``.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from tools.deploy.childsetup import child_setup, die_with_parent

log = logging.getLogger(__name__)

# The services that load torch and transformers (``dressage <name>``): the ones worth forking pre-imported.
TORCH_SERVICES = ("trainer", "engine", "eval-worker")
READY_TIMEOUT_S = 180.0


class LauncherFailed(RuntimeError):
    """The launcher did not start, or stopped answering; the supervisor starts the service itself."""


# -- the launcher process -------------------------------------------------------------------------------
def _write(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _reap(reply_fd: int) -> None:
    """Report every child that has exited (waitpid until none is left to reap)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write(reply_fd, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become_service(request: dict[str, Any], fds: Iterable[int], launcher: int) -> None:
    """In the forked child of ``launcher`` (its pid): turn into the requested service (everything but running
    its module)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)
    child_setup(int(request.get("nice") or 0), request.get("sched"), parent=launcher)()
    for fd in fds:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    if request.get("log"):
        out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("cwd"):
        os.chdir(request["cwd"])
        sys.path[0] = os.getcwd()  # where ``python -m`` would look first
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:  # else torch, imported later, reads it
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv = [request["module"], *request["args"]]  # runpy puts the module's file first, as -m does


def serve(request_fd: int, reply_fd: int, modules: Sequence[str]) -> dict[str, Any] | None:
    """The launcher's loop: import ``modules``, then fork one service per request until the supervisor closes
    the request pipe. Returns None in the launcher (done) and the request in each forked child."""
    for name in modules:
        __import__(name)
    gc.collect()
    gc.freeze()  # the imports' objects leave the collector's view: a child's collections neither scan nor copy them
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears SIGCHLD
    _write(reply_fd, {"ready": True})
    launcher = os.getpid()  # the parent every forked service checks it still has
    pending = b""
    while True:
        readable, _, _ = select.select([request_fd, wake_r], [], [], 5.0)
        if wake_r in readable:
            os.read(wake_r, 512)
        _reap(reply_fd)
        if request_fd not in readable:
            continue
        chunk = os.read(request_fd, 65536)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request: dict[str, Any] = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become_service(request, (request_fd, reply_fd, wake_r, wake_w), launcher)
                return request
            try:
                os.setpgid(pid, pid)  # as the child does: a group signal sent at once reaches it
            except OSError:
                pass  # it has already done so, or exited
            _write(reply_fd, {"pid": pid})


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.deploy.prefork REQUEST_FD REPLY_FD MODULE...`` (started by ``Launcher``)."""
    args = sys.argv[1:] if argv is None else argv
    request_fd, reply_fd, modules = int(args[0]), int(args[1]), args[2:]
    die_with_parent()  # a supervisor gone before this: the request pipe's end of file stops the loop
    request = serve(request_fd, reply_fd, modules)
    if request is None:
        return 0
    import runpy

    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    return 0


# -- the supervisor's side ------------------------------------------------------------------------------
def ensure_launcher(current: Launcher | None, python: str, modules: Sequence[str]) -> Launcher:
    """``current`` while it runs; else a fresh launcher, started (``LauncherFailed`` if it cannot), after the
    dead one's last exits are taken in and its pipes closed (its services went with it: parent-death signal)."""
    if current is not None and current.alive:
        return current
    if current is not None:
        current.collect()
        current.close()
    launcher = Launcher(python, modules)
    launcher.start()
    return launcher


class Launcher:
    """One launcher process and the exit codes it has reported (``ForkedProcess`` reads them)."""

    def __init__(self, python: str, modules: Sequence[str], ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.python, self.modules, self.ready_timeout_s = python, tuple(modules), ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.exits: dict[int, int] = {}
        self.live: set[int] = set()
        self._request_w = self._reply_r = -1
        self._buffer = b""

    def start(self) -> None:
        """Start the launcher and wait until its imports are done; ``LauncherFailed`` if it cannot."""
        req_r, self._request_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            self.proc = subprocess.Popen(
                [self.python, "-m", "tools.deploy.prefork", str(req_r), str(reply_w), *self.modules],
                stdin=subprocess.DEVNULL, pass_fds=(req_r, reply_w), env=env, process_group=0)
        finally:
            os.close(req_r)
            os.close(reply_w)
        os.set_blocking(self._reply_r, False)
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._read(0.2).get("ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise LauncherFailed("the prefork launcher did not start (see the supervisor's stderr)")
        log.info("prefork launcher ready pid=%d (%s)", self.proc.pid, " ".join(self.modules))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, module: str, args: Sequence[str], env: dict[str, str], cwd: str | None,
              log_path: str | None, nice: int, sched: str | None) -> ForkedProcess:
        """Fork one service from the launcher; ``LauncherFailed`` when it no longer answers."""
        if not self.alive:
            raise LauncherFailed("the prefork launcher is not running")
        request = {"module": module, "args": list(args), "env": env, "cwd": cwd, "log": log_path,
                   "nice": nice, "sched": sched}
        try:
            _write(self._request_w, request)
        except OSError as exc:
            raise LauncherFailed(f"the prefork launcher stopped reading: {exc}") from exc
        deadline = time.monotonic() + 30.0
        while True:
            reply = self._read(0.2)
            if "pid" in reply:
                self.live.add(reply["pid"])
                return ForkedProcess(reply["pid"], self)
            if not self.alive or time.monotonic() > deadline:
                raise LauncherFailed("the prefork launcher did not fork the service")

    def collect(self) -> None:
        """Take in the exits reported so far; with the launcher gone, its services are gone too."""
        self._read(0.0)
        if self.proc is not None and self.proc.poll() is not None:
            self._read(0.0)
            for pid in self.live - set(self.exits):
                self.exits[pid] = -signal.SIGTERM  # the parent-death signal
            self.live.clear()

    def _read(self, timeout_s: float) -> dict[str, Any]:
        """Read what the launcher sent within ``timeout_s``; record exits, return the last other message."""
        other: dict[str, Any] = {}
        if self._reply_r < 0:
            return other
        readable, _, _ = select.select([self._reply_r], [], [], timeout_s)
        if readable:
            try:
                self._buffer += os.read(self._reply_r, 65536)
            except BlockingIOError:
                pass
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.exits[message["exit"]] = message["code"]
                self.live.discard(message["exit"])
            else:
                other = message
        return other

    def close(self) -> None:
        """Stop the launcher (its remaining services receive SIGTERM by the parent-death signal)."""
        for fd in (self._request_w, self._reply_r):
            if fd >= 0:
                os.close(fd)
        self._request_w = self._reply_r = -1
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class ForkedProcess:
    """The part of ``subprocess.Popen`` the supervisor uses, for a service the launcher forked."""

    def __init__(self, pid: int, launcher: Launcher) -> None:
        self.pid, self.launcher = pid, launcher
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.launcher.collect()
            self.returncode = self.launcher.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid the launcher has already reaped
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    raise SystemExit(main())
