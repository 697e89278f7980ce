"""Agents that drive one trajectory through its proxy session: white-box and black-box.

* White-box (``run_whitebox``): the task episode runs in process; every model call is
  ``POST {proxy}/v1/chat/completions`` with ``X-Session-Id``; multi-turn tasks loop, feeding the
  environment's answer back, until the episode is done.
* Black-box (``run_blackbox``): an external command is the agent (its contract for users:
  docs/guides/your-agent.md). It gets ``OPENAI_BASE_URL`` = ``{proxy}/s/{session}/v1`` (so each of its
  model calls is recorded in the session), ``ANTHROPIC_BASE_URL`` = ``{proxy}/s/{session}`` (the
  Anthropic SDK adds ``/v1/messages``), ``OPENAI_API_KEY`` = ``ANTHROPIC_API_KEY`` (a per-session token
  valid only under that session's URLs, ``shared.edge.session_token``; ``"none"`` without a proxy key),
  ``DRESSAGE_SESSION_ID``, and on stdin the JSON
  ``{"messages", "task", "max_new_tokens", "temperature", "session_id"}``. It answers on stdout
  with ``{"reply": "..."}`` or plain text and exits 0. The reply is scored by the task verifier
  as the episode's one reply. A multi-turn agent (one that ran its own tool loop) may add
  ``"turns": ["<assistant text>", ...]``: every assistant message it got, as the model wrote it
  (tool calls in their Hermes text, ``shared.toolcalls.ToolCall.hermes``); they are given to the
  episode in order (``Episode.take_agent_turns``), so the task scores the whole loop, tool use included.
  Its own reward: ``"reward"`` (and ``"components"``) in that JSON object, or a last stdout line
  ``{"reward": 0.5, "components": {...}}`` after plain text (``POST /s/{session}/v1/reward`` on the proxy
  is the other way; a stdout report wins). The task decides what it counts for (``shared.tasks.plugin``);
  a reward that is not a finite number fails the trajectory with ``agent_reward_invalid``.
  A non-zero exit fails the trajectory; if the agent printed a proxy error code of THIS run
  (``{"error": "<code>"}`` on stdout, or the code in stderr), that code is the failure's code,
  so a relayed staleness rejection is classified as one. The agent is killed with its process group
  on timeout or cancellation.

Agent code is untrusted (it runs model-written commands). What it is guaranteed NOT to get:
* any environment variable but the names in ``rollout.agent_env`` (an allow-list: no Redis password,
  no cloud or Hugging Face token, no proxy key) plus the three above;
* the worker's environment or memory: ``deny_inspection()`` (called at worker start, Linux) marks the
  worker non-dumpable, so a same-uid process gets EACCES on ``/proc/<worker>/environ``, ``mem``,
  ``maps`` and cannot ptrace it; with ``rollout.agent_uid`` (worker started as root) the agent runs
  as that uid/gid with no supplementary groups, so not even its own files overlap with the worker's;
* any session but its own: the token authorises ``/s/{session}/v1/*`` of its session only.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.rollout_worker.errors import TrajectoryFailed
from services.rollout_worker.proxy_client import ProxyClient
from shared.codes import AGENT_REWARD_INVALID, PROXY_502_CODES, UPSTREAM_UNAVAILABLE
from shared.config import RolloutConfig
from shared.edge import session_token
from shared.errors import ConfigError
from shared.tasks import AgentReward, Episode
from shared.tasks.plugin import check_components, check_reward

MAX_AGENT_OUTPUT = 1 << 20  # bytes of stdout read as the reply
_RELAYED_CODES = (*sorted(PROXY_502_CODES), UPSTREAM_UNAVAILABLE)
DEFAULT_AGENT_ENV = tuple(RolloutConfig().agent_env)  # the config's default allow-list
_PR_SET_DUMPABLE = 4


async def run_whitebox(proxy: ProxyClient, session_id: str, episode: Episode, max_new_tokens: int,
                       temperature: float) -> None:
    """Drive ``episode`` to its end, one proxy call per turn."""
    while not episode.done:
        reply = await proxy.chat(session_id, episode.messages(), max_new_tokens, temperature)
        episode.step(reply)


def agent_env(base: Mapping[str, str], base_url: str, api_key: str | None, session_id: str,
              allow: tuple[str, ...] | list[str] = DEFAULT_AGENT_ENV) -> dict[str, str]:
    """The agent's environment: only the ``allow``-listed names of ``base``, plus its session endpoint
    and its per-session token (never ``api_key`` itself)."""
    env = {k: base[k] for k in allow if k in base}
    token = session_token(api_key, session_id) if api_key else "none"
    env.update({"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": token, "DRESSAGE_SESSION_ID": session_id,
                "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": token})
    return env


def deny_inspection() -> bool:
    """Make this process non-dumpable (Linux ``prctl(PR_SET_DUMPABLE, 0)``): other processes of the
    same uid -- the agents it starts -- can no longer read its ``/proc`` environ/mem or ptrace it.
    Returns False where the platform has no such switch (then only ``agent_uid`` isolates)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)


def agent_input(task: str, messages: list[dict[str, str]], max_new_tokens: int, temperature: float,
                session_id: str) -> bytes:
    return json.dumps({"messages": messages, "task": task, "max_new_tokens": max_new_tokens,
                       "temperature": temperature, "session_id": session_id}).encode()


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def split_stdout(stdout: bytes) -> tuple[Any, str, dict[str, Any] | None]:
    """``(JSON answer or None, plain text, reward object or None)`` of an agent's stdout: a JSON object
    answer, or plain text whose last line may be a ``{"reward": ...}`` object (then not part of the text)."""
    text = stdout[:MAX_AGENT_OUTPUT].decode("utf-8", errors="replace").strip()
    data = _json(text)
    if isinstance(data, dict):
        return data, text, data if "reward" in data else None
    head, _, last = text.rpartition("\n")
    tail = _json(last.strip())
    if isinstance(tail, dict) and "reward" in tail and "reply" not in tail:
        return None, head.strip(), tail
    return None, text, None


def agent_turns(stdout: bytes) -> list[str]:
    """The assistant turns to score: ``turns`` when the agent listed them, else its one reply."""
    data, _, _ = split_stdout(stdout)
    turns = data.get("turns") if isinstance(data, dict) else None
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        return turns
    return [parse_agent_output(stdout)]


def parse_agent_output(stdout: bytes) -> str:
    """The agent's final answer: ``{"reply": ...}`` JSON, else the plain text (stripped, reward line cut)."""
    data, text, _ = split_stdout(stdout)
    if isinstance(data, dict) and "reply" in data:
        return str(data["reply"] if data["reply"] is not None else "")
    return text


def stdout_reward(stdout: bytes, session_id: str) -> AgentReward | None:
    """The reward an agent printed (module docstring); ``agent_reward_invalid`` if it is not usable."""
    _, _, raw = split_stdout(stdout)
    if raw is None:
        return None
    try:
        return AgentReward(check_reward(raw.get("reward")), check_components(raw.get("components")), "stdout")
    except ValueError as exc:
        raise TrajectoryFailed(AGENT_REWARD_INVALID, f"the agent's stdout reward: {exc}", session_id=session_id) \
            from None


def agent_failure(returncode: int, stdout: bytes, stderr: bytes, session_id: str) -> TrajectoryFailed:
    """Classify a failed agent run from this run's own output only (no state across attempts)."""
    out = stdout[:MAX_AGENT_OUTPUT].decode("utf-8", errors="replace").strip()
    err = stderr[-MAX_AGENT_OUTPUT:].decode("utf-8", errors="replace").strip()
    tail = err[-400:]
    try:
        data: Any = json.loads(out)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("error") in _RELAYED_CODES:
        return TrajectoryFailed(str(data["error"]), f"agent exited {returncode}: {str(data.get('message', ''))[:300]}",
                                session_id=session_id)
    for code in _RELAYED_CODES:
        if code in err:
            return TrajectoryFailed(code, f"agent exited {returncode}: {tail}", session_id=session_id)
    return TrajectoryFailed("agent_exit", f"agent exited {returncode}: {tail}", session_id=session_id)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_blackbox(command: list[str], proxy: ProxyClient, session_id: str, task: str, episode: Episode,
                       max_new_tokens: int, temperature: float, allow_env: tuple[str, ...] | list[str] = DEFAULT_AGENT_ENV,
                       agent_uid: int | None = None) -> AgentReward | None:
    """Run the agent command once for this trajectory and give its turns to the episode; the reward it
    printed, if any. Raises ``TrajectoryFailed``."""
    env = agent_env(os.environ, proxy.agent_base_url(session_id), proxy.api_key, session_id, allow_env)
    ids: dict[str, Any] = {"user": agent_uid, "group": agent_uid, "extra_groups": []} if agent_uid is not None else {}
    payload = agent_input(task, episode.messages(), max_new_tokens, temperature, session_id)
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True, **ids)
    except OSError as exc:
        raise TrajectoryFailed("agent_crash", f"cannot start {command[0]!r}: {exc}", session_id=session_id) from exc
    try:
        stdout, stderr = await proc.communicate(payload)
    except BaseException:  # timeout or cancellation: the agent must not outlive its trajectory
        _kill_group(proc)
        await asyncio.shield(proc.wait())
        raise
    finally:
        _kill_group(proc)  # children it left behind
    if proc.returncode != 0:
        raise agent_failure(proc.returncode or -1, stdout, stderr, session_id)
    report = stdout_reward(stdout, session_id)
    episode.take_agent_turns(agent_turns(stdout))
    return report


PYTHON_NAMES = frozenset({"python", "python3"})


def resolve_agent_command(command: list[str], project: Path | None = None) -> list[str]:
    """The argv to run: ``python`` / ``python3`` is this environment's interpreter (``sys.executable``),
    a relative path with a ``/`` is taken from the project directory (the working directory), any other
    name is looked up on ``PATH`` when the agent starts. Never a hard-coded virtualenv path."""
    if not command:
        return command
    program = command[0]
    if program in PYTHON_NAMES:
        return [sys.executable, *command[1:]]
    if "/" in program and not os.path.isabs(program):
        return [str((project or Path.cwd()) / program), *command[1:]]
    return list(command)


def check_agent_command(command: list[str] | None, agent_uid: int | None = None) -> None:
    """Refuse at start an agent command whose program cannot be found, or an ``agent_uid`` this
    process cannot switch to (names the config key)."""
    command = resolve_agent_command(command) if command else command
    if command and shutil.which(command[0]) is None:
        raise ConfigError(f"rollout.agent_command: program {command[0]!r} not found or not executable")
    if command and agent_uid is not None and os.geteuid() != 0:
        raise ConfigError(f"rollout.agent_uid: {agent_uid} needs a worker started as root (it switches the "
                          f"agent's uid); this worker runs as uid {os.geteuid()}")
