"""Group runner: one attempt of a prompt group = ``n_samples`` concurrent trajectories, all or nothing.

Invariants:
* each trajectory has its own proxy session ``{group_id}-a{attempt}-s{i}-{uuid}``;
* white-box episodes of a group start from the same messages, so their first turn is one proxy call
  with a choice per session (``chat_many``); later turns differ and go one call per trajectory;
* the first trajectory failure cancels its siblings and fails the group (``GroupFailed``) with
  that failure — never a half group;
* once every trajectory is done, one ``close_sessions`` call finalizes, reads and drops all of the
  attempt's sessions (not three calls per trajectory); an attempt that fails or is cancelled before
  that drops them in one call on the way out, so the proxy never keeps an orphan until its TTL;
* a trajectory that runs longer than ``trajectory_timeout_s`` fails with ``trajectory_timeout``;
* a task's own code that raises, or scores NaN/inf (``shared.tasks.TaskFailed``), fails the group with
  ``task_error``, not retryable (the collector dead-letters it with that reason): the worker goes on;
* an agent's reported reward (its proxy report, or its final stdout line, which wins) is offered to the
  task, which accepts, combines or refuses it; a refused one is counted, never silently used.
No Redis here; the worker shell decides what a result or a failure means for the streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from services.rollout_worker.agents import resolve_agent_command, run_blackbox, run_whitebox
from services.rollout_worker.assembly import TrajectoryResult, completed_group, finalize_samples, session_id
from services.rollout_worker.errors import TrajectoryFailed
from services.rollout_worker.proxy_client import ClosedSessions, ProxyClient
from shared.codes import INVALID_PROMPT_GROUP, SESSION_NOT_FOUND, TASK_ERROR, TRAJECTORY_TIMEOUT
from shared.config import RolloutConfig
from shared.errors import UnknownTask
from shared.schemas import PromptGroup, RolloutGroup
from shared.tasks import (
    AgentReward,
    Episode,
    InvalidReference,
    Task,
    TaskFailed,
    TaskLoadError,
    get_task,
    start_episode,
)
from shared.tasks.plugin import check_components, check_reward

log = logging.getLogger(__name__)


class GroupFailed(Exception):
    """An attempt failed; ``failure`` is the trajectory failure that decided it."""

    def __init__(self, failure: TrajectoryFailed, started_at: float) -> None:
        super().__init__(failure.text)
        self.failure = failure
        self.started_at = started_at


def group_row(group: PromptGroup) -> dict[str, Any]:
    """The dataset row of a group: as read for a plugin task, else rebuilt from prompt and reference."""
    if group.row is not None:
        return group.row
    return {"prompt_id": group.prompt_id, "task": group.task, "prompt": group.prompt, "reference": group.reference,
            "meta": group.meta}


def task_failure(exc: TaskFailed, sid: str | None = None) -> TrajectoryFailed:
    """A task's own failure: another attempt runs the same code on the same row, so it is not retried."""
    return TrajectoryFailed(TASK_ERROR, str(exc), retryable=False, session_id=sid)


def reported_reward(raw: Any, source: str) -> AgentReward | None:
    """The proxy's record of an agent's report (``{"reward", "components"}``), checked; None without one."""
    if not isinstance(raw, dict):
        return None
    try:
        return AgentReward(check_reward(raw.get("reward")), check_components(raw.get("components")), source)
    except ValueError:
        return None  # the proxy validated it at its edge; a record that drifted is ignored


class GroupRunner:
    """Runs attempts of prompt groups through a ``ProxyClient``."""

    def __init__(self, proxy: ProxyClient, cfg: RolloutConfig, consumer: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.proxy, self.cfg, self.consumer, self.clock = proxy, cfg, consumer, clock

    def agent_for(self, task: str) -> list[str] | None:
        """The black-box command for ``task``, or None for the white-box runner."""
        cmd = self.cfg.agent_command
        if cmd and (self.cfg.agent_tasks is None or task in self.cfg.agent_tasks):
            return resolve_agent_command(list(cmd))
        return None

    def _task(self, group: PromptGroup) -> Task:
        try:
            task = get_task(group.task)
            task.validate_reference(group.reference)
        except TaskLoadError as exc:  # the task's code does not load here: no retry can fix it
            raise TrajectoryFailed(TASK_ERROR, f"{exc} (row {group.prompt_id!r})", retryable=False) from exc
        except (UnknownTask, InvalidReference) as exc:
            raise TrajectoryFailed(INVALID_PROMPT_GROUP, str(exc), retryable=False) from exc
        return task

    def _start(self, group: PromptGroup, task: Task, sid: str) -> Episode:
        try:
            return start_episode(task, group_row(group))
        except InvalidReference as exc:
            raise TrajectoryFailed(INVALID_PROMPT_GROUP, str(exc), retryable=False, session_id=sid) from exc
        except TaskFailed as exc:
            raise task_failure(exc, sid) from exc

    async def _first_turns(self, group: PromptGroup, task: Task, sids: list[str], deadline: float) -> list[Episode]:
        """White-box episodes of a group start from the same messages: their first model call is one
        proxy call with a choice per session (``chat_many``). Each episode has taken that turn on return."""
        episodes = [self._start(group, task, sid) for sid in sids]
        first = episodes[0].messages()
        if any(e.done or e.messages() != first for e in episodes):
            return episodes  # nothing shared to ask for: each trajectory starts on its own
        try:
            async with asyncio.timeout_at(deadline):
                replies = await self.proxy.chat_many(sids, first, self.cfg.max_new_tokens or task.max_new_tokens,
                                                     self.cfg.temperature)
        except TimeoutError as exc:
            raise TrajectoryFailed(TRAJECTORY_TIMEOUT, f"not done after {self.cfg.trajectory_timeout_s}s",
                                   session_id=sids[0]) from exc
        for sid, episode, reply in zip(sids, episodes, replies, strict=True):
            try:
                episode.step(reply)
            except TaskFailed as exc:
                raise task_failure(exc, sid) from exc
        return episodes

    async def _trajectory(self, group: PromptGroup, task: Task, sid: str, deadline: float,
                          episode: Episode | None = None, reports: dict[str, AgentReward] | None = None) -> Episode:
        """Drive one episode (a started one: from where it is) to its end in session ``sid``, by
        ``deadline`` (event-loop time); its record is read when the group closes. A reward a black-box
        agent printed goes into ``reports``."""
        episode = self._start(group, task, sid) if episode is None else episode
        max_new = self.cfg.max_new_tokens or task.max_new_tokens
        command = self.agent_for(group.task)
        try:
            async with asyncio.timeout_at(deadline):
                if command is None:
                    await run_whitebox(self.proxy, sid, episode, max_new, self.cfg.temperature)
                else:
                    report = await run_blackbox(command, self.proxy, sid, group.task, episode, max_new,
                                                self.cfg.temperature, self.cfg.agent_env, self.cfg.agent_uid)
                    if report is not None and reports is not None:
                        reports[sid] = report
        except TaskFailed as exc:
            raise task_failure(exc, sid) from exc
        except TimeoutError as exc:
            raise TrajectoryFailed(TRAJECTORY_TIMEOUT, f"not done after {self.cfg.trajectory_timeout_s}s",
                                   session_id=sid) from exc
        except TrajectoryFailed as exc:
            raise exc.at(sid) from None
        return episode

    @staticmethod
    def _score(sids: list[str], episodes: list[Episode], closed: ClosedSessions,
               reports: dict[str, AgentReward] | None = None) -> list[TrajectoryResult]:
        """Each episode's reward placed on the samples its session recorded (agent reports offered first)."""
        results = []
        for sid, episode in zip(sids, episodes, strict=True):
            record = closed.records.get(sid)
            if record is None:
                raise TrajectoryFailed(SESSION_NOT_FOUND, "the proxy no longer knows this session", session_id=sid)
            report = (reports or {}).get(sid) or reported_reward(record.get("agent_reward"), "proxy")
            try:
                taken = episode.offer_agent_reward(report) if report is not None else None
                reward = check_reward(episode.reward())
                components, correct = episode.components(), bool(episode.correct())
            except TaskFailed as exc:
                raise task_failure(exc, sid) from exc
            except ValueError as exc:  # a built-in's reward that is not a finite number
                raise TrajectoryFailed(TASK_ERROR, f"reward: {exc}", retryable=False, session_id=sid) from exc
            samples = finalize_samples(sid, record.get("samples"), reward)
            agent = None if taken is None else ("accepted" if taken else "refused")
            results.append(TrajectoryResult(sid, reward, correct, episode.turns, samples, components, agent))
        return results

    async def run(self, group: PromptGroup) -> RolloutGroup:
        """Roll out every trajectory of ``group``; returns the completed group or raises ``GroupFailed``."""
        started = self.clock()
        try:
            task = self._task(group)
        except TrajectoryFailed as exc:
            raise GroupFailed(exc, started) from None
        sids = [session_id(group, i) for i in range(group.n_samples)]
        deadline = asyncio.get_running_loop().time() + self.cfg.trajectory_timeout_s
        jobs: list[asyncio.Task[Episode]] = []
        reports: dict[str, AgentReward] = {}  # rewards black-box agents printed, by session
        dropped = False  # the proxy closed every session of this attempt
        try:
            started_episodes: list[Episode | None] = [None] * len(sids)
            if self.agent_for(group.task) is None:
                try:
                    started_episodes = list(await self._first_turns(group, task, sids, deadline))
                except TrajectoryFailed as exc:
                    log.warning("group failed group_id=%s attempt=%d error=%s", group.group_id, group.attempt, exc.text)
                    raise GroupFailed(exc, started) from exc
            jobs = [asyncio.create_task(self._trajectory(group, task, sid, deadline, ep, reports), name=sid)
                    for sid, ep in zip(sids, started_episodes, strict=True)]
            done, pending = await asyncio.wait(jobs, return_when=asyncio.FIRST_EXCEPTION)
            failed = [j for j in jobs if j in done and j.exception() is not None]
            if failed:
                for j in pending:
                    j.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                first = failed[0].exception()
                if isinstance(first, TrajectoryFailed):
                    log.warning("group failed group_id=%s attempt=%d error=%s", group.group_id, group.attempt, first.text)
                    raise GroupFailed(first, started) from first
                assert first is not None
                raise first  # a bug, not a trajectory failure: the worker's guard handles it
            episodes = [j.result() for j in jobs]
            try:
                closed = await self.proxy.close_sessions(sids)  # one call for the group: finalize, read, drop
                dropped = True
                results = self._score(sids, episodes, closed, reports)
            except TrajectoryFailed as exc:
                log.warning("group failed group_id=%s attempt=%d error=%s", group.group_id, group.attempt, exc.text)
                raise GroupFailed(exc, started) from exc
        finally:
            for j in jobs:
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)  # no request may outlive its session
            if not dropped:
                await self._cleanup(group, sids)
        agent = "blackbox" if self.agent_for(group.task) else "whitebox"
        return completed_group(group, results, self.consumer, started, self.clock(), agent)

    async def _cleanup(self, group: PromptGroup, sids: list[str]) -> None:
        """Drop every session of a failed attempt in one call (best effort, bounded in time)."""
        try:
            await asyncio.wait_for(self.proxy.close_sessions(sids, records=False), self.cfg.session_cleanup_timeout_s)
        except TimeoutError:
            log.warning("session cleanup timed out group_id=%s attempt=%d", group.group_id, group.attempt)
        except TrajectoryFailed as exc:
            log.warning("session cleanup failed group_id=%s attempt=%d: %s", group.group_id, group.attempt, exc.text)
