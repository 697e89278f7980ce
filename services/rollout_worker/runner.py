"""Group runner: one attempt of a prompt group = ``n_samples`` concurrent trajectories, all or nothing.

Invariants:
* each trajectory has its own proxy session ``{group_id}-a{attempt}-s{i}-{uuid}``;
* the first trajectory failure cancels its siblings and fails the group (``GroupFailed``) with
  that failure — never a half group;
* every session the attempt opened is deleted on the way out (success, failure or cancellation),
  so the proxy never keeps an orphan until its TTL;
* a trajectory that runs longer than ``trajectory_timeout_s`` fails with ``trajectory_timeout``.
No Redis here; the worker shell decides what a result or a failure means for the streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from services.rollout_worker.agents import run_blackbox, run_whitebox
from services.rollout_worker.assembly import TrajectoryResult, completed_group, finalize_samples, session_id
from services.rollout_worker.errors import TrajectoryFailed
from services.rollout_worker.proxy_client import ProxyClient
from shared.codes import INVALID_PROMPT_GROUP, TRAJECTORY_TIMEOUT
from shared.config import RolloutConfig
from shared.errors import UnknownTask
from shared.schemas import PromptGroup, RolloutGroup
from shared.tasks import InvalidReference, Task, get_task

log = logging.getLogger(__name__)


class GroupFailed(Exception):
    """An attempt failed; ``failure`` is the trajectory failure that decided it."""

    def __init__(self, failure: TrajectoryFailed, started_at: float) -> None:
        super().__init__(failure.text)
        self.failure = failure
        self.started_at = started_at


class GroupRunner:
    """Runs attempts of prompt groups through a ``ProxyClient``."""

    def __init__(self, proxy: ProxyClient, cfg: RolloutConfig, consumer: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.proxy, self.cfg, self.consumer, self.clock = proxy, cfg, consumer, clock

    def agent_for(self, task: str) -> list[str] | None:
        """The black-box command for ``task``, or None for the white-box runner."""
        cmd = self.cfg.agent_command
        if cmd and (self.cfg.agent_tasks is None or task in self.cfg.agent_tasks):
            return list(cmd)
        return None

    def _task(self, group: PromptGroup) -> Task:
        try:
            task = get_task(group.task)
            task.validate_reference(group.reference)
        except (UnknownTask, InvalidReference) as exc:
            raise TrajectoryFailed(INVALID_PROMPT_GROUP, str(exc), retryable=False) from exc
        return task

    async def _trajectory(self, group: PromptGroup, task: Task, sid: str) -> TrajectoryResult:
        try:
            episode = task.start(group.prompt, group.reference)
        except InvalidReference as exc:
            raise TrajectoryFailed(INVALID_PROMPT_GROUP, str(exc), retryable=False, session_id=sid) from exc
        max_new = self.cfg.max_new_tokens or task.max_new_tokens
        command = self.agent_for(group.task)
        try:
            async with asyncio.timeout(self.cfg.trajectory_timeout_s):
                if command is None:
                    await run_whitebox(self.proxy, sid, episode, max_new, self.cfg.temperature)
                else:
                    await run_blackbox(command, self.proxy, sid, group.task, episode, max_new, self.cfg.temperature,
                                       self.cfg.agent_env, self.cfg.agent_uid)
                record = await self.proxy.finalize(sid)
        except TimeoutError as exc:
            raise TrajectoryFailed(TRAJECTORY_TIMEOUT, f"not done after {self.cfg.trajectory_timeout_s}s",
                                   session_id=sid) from exc
        except TrajectoryFailed as exc:
            raise exc.at(sid) from None
        reward = float(episode.reward())
        samples = finalize_samples(sid, record.get("samples"), reward)
        return TrajectoryResult(sid, reward, bool(episode.correct()), episode.turns, samples)

    async def run(self, group: PromptGroup) -> RolloutGroup:
        """Roll out every trajectory of ``group``; returns the completed group or raises ``GroupFailed``."""
        started = self.clock()
        try:
            task = self._task(group)
        except TrajectoryFailed as exc:
            raise GroupFailed(exc, started) from None
        sids = [session_id(group, i) for i in range(group.n_samples)]
        jobs = [asyncio.create_task(self._trajectory(group, task, sid), name=sid) for sid in sids]
        try:
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
            results = [j.result() for j in jobs]
        finally:
            for j in jobs:
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)  # no request may outlive its session
            await self._cleanup(group, sids)
        agent = "blackbox" if self.agent_for(group.task) else "whitebox"
        return completed_group(group, results, self.consumer, started, self.clock(), agent)

    async def _cleanup(self, group: PromptGroup, sids: list[str]) -> None:
        """Delete every session of the attempt (best effort, bounded in time)."""
        outcomes = asyncio.gather(*(self.proxy.delete_session(s) for s in sids), return_exceptions=True)
        try:
            results = await asyncio.wait_for(outcomes, self.cfg.session_cleanup_timeout_s)
        except TimeoutError:
            log.warning("session cleanup timed out group_id=%s attempt=%d", group.group_id, group.attempt)
            return
        for sid, res in zip(sids, results, strict=True):
            if isinstance(res, BaseException):
                log.warning("session delete failed group_id=%s attempt=%d session_id=%s: %s",
                            group.group_id, group.attempt, sid, res)
