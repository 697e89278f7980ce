"""Sessions: what the proxy recorded for each trajectory, as wire ``Sample`` segments (pure, no I/O).

Invariants:
* a session's segments, concatenated per segment, are exactly the tokens the engines saw and
  produced: context tokens (mask 0, logprob 0.0, version ``"-1"``) then response tokens (mask 1,
  the engine's logprob and per-token version), turn after turn;
* a turn whose prompt extends the current segment's tokens token-for-token appends only the new
  context (the delta); any other prompt (history rewritten, a sub-agent, a summary) starts a new
  segment whose context is the whole prompt;
* ``versions`` is the ordered list of distinct *real* versions (``shared.staleness.real_version``,
  stripped) the session's response tokens carry, in observation order: the span check and the
  non-partial check read it, and ``samples()`` normalises labels with the same helpers, so
  ``" v1 "`` and ``"v1"`` are one version everywhere;
* a rejected turn is never recorded (the caller records only after every check passed);
* a session untouched for ``ttl_s`` is expired by ``SessionStore.expire`` unless a turn is running.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

from services.proxy.auth import OPEN, Principal
from services.proxy.errors import InvalidRequest, OverCapacity, SessionConflict, SessionNotFound
from shared.schemas import Sample
from shared.staleness import (
    normalize_token_versions,
    ordered_real_versions,
    sample_version_fields,
)
from shared.versions import CONTEXT_VERSION

SESSION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,255}")  # matched whole (fullmatch)


def check_session_id(value: str, where: str) -> str:
    """Refuse ids that cannot be a ``Sample.traj_id`` (1-256 chars) or would be unsafe in logs/paths."""
    if not SESSION_ID_RE.fullmatch(value):  # whole: a trailing newline is refused, never logged or echoed
        raise InvalidRequest(where, "session id must be 1-256 characters of [A-Za-z0-9._:@+=-], starting "
                                    "with a letter or digit")
    return value


@dataclass
class Segment:
    """One contiguous token sequence of a trajectory (becomes one ``Sample``)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[str] = field(default_factory=list)  # normalised labels, "-1" for context
    finish_reason: str = "stop"  # of the last turn recorded in this segment
    turns: int = 0
    preempts: int = 0  # interruptions (resumed chunks) across this segment's turns
    tool_calls: int = 0  # well-formed tool calls the model wrote in this segment's turns
    malformed_tool_calls: int = 0  # <tool_call> blocks that did not parse (returned as text)

    def extended_by(self, prompt_ids: list[int]) -> bool:
        n = len(self.token_ids)
        return n > 0 and len(prompt_ids) >= n and prompt_ids[:n] == self.token_ids


@dataclass
class Session:
    session_id: str
    partial: bool  # partial-rollout mode for this session (fixed by its first request)
    created: float
    touched: float
    finalized: bool = False
    owner: str | None = None  # the credential owner that created it (services.proxy.auth); None = open mode
    segments: list[Segment] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # distinct real versions, observation order
    turns: int = 0
    agent_reward: dict[str, Any] | None = None  # the agent's last ``POST /s/{id}/v1/reward``: {reward, components}
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # one turn at a time

    def record(self, prompt_ids: list[int], output_ids: list[int], logprobs: list[float],
               versions: list[str], finish_reason: str, preempts: int = 0) -> int:
        """Append one turn; returns the index of the segment it went into."""
        if not (len(output_ids) == len(logprobs) == len(versions)):
            raise ValueError("record: output_ids, logprobs and versions must have equal lengths")
        seg = self.segments[-1] if self.segments else None
        if seg is None or not seg.extended_by(prompt_ids):
            seg = Segment()
            self.segments.append(seg)
        delta = prompt_ids[len(seg.token_ids):]
        seg.token_ids += delta
        seg.loss_mask += [0] * len(delta)
        seg.logprobs += [0.0] * len(delta)
        seg.token_versions += [CONTEXT_VERSION] * len(delta)
        seg.token_ids += output_ids
        seg.loss_mask += [1] * len(output_ids)
        seg.logprobs += [float(x) for x in logprobs]
        labels = dict.fromkeys(versions)  # a few distinct labels: normalise each once
        canonical = dict(zip(labels, normalize_token_versions(labels), strict=True))
        seg.token_versions += [canonical[v] for v in versions]
        seg.finish_reason = finish_reason
        seg.turns += 1
        seg.preempts += preempts
        self.turns += 1
        self.versions = ordered_real_versions([*self.versions, *labels])
        return len(self.segments) - 1

    def samples(self) -> list[dict[str, Any]]:
        """Every segment as a wire ``Sample`` dict (reward 0.0: the worker scores the trajectory)."""
        out: list[dict[str, Any]] = []
        for i, seg in enumerate(self.segments):
            sample = Sample(
                traj_id=self.session_id, segment_index=i, token_ids=list(seg.token_ids),
                loss_mask=list(seg.loss_mask), logprobs=list(seg.logprobs),
                token_versions=list(seg.token_versions), reward=0.0, finish_reason=seg.finish_reason,
                meta={"turns": seg.turns, "preempts": seg.preempts, "partial_mode": self.partial,
                      **({"tool_calls": seg.tool_calls, "malformed_tool_calls": seg.malformed_tool_calls}
                         if seg.tool_calls or seg.malformed_tool_calls else {})},
                **sample_version_fields(seg.loss_mask, seg.token_versions),
            )
            out.append(sample.model_dump(mode="json"))
        return out

    def summary(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "finalized": self.finalized, "partial_rollout": self.partial,
                "turns": self.turns, "num_segments": len(self.segments), "versions": list(self.versions),
                "preempts": sum(s.preempts for s in self.segments), "agent_reward": self.agent_reward}

    def report_reward(self, reward: float, components: dict[str, float]) -> None:
        """Keep the agent's reported reward (the last report wins); a finalized session takes none."""
        if self.finalized:
            raise SessionConflict(f"session {self.session_id!r} is finalized", session_id=self.session_id)
        self.agent_reward = {"reward": float(reward), "components": {k: float(v) for k, v in components.items()}}


class SessionStore:
    """In-process sessions with a TTL and a count limit (memory stays bounded)."""

    def __init__(self, ttl_s: float, max_sessions: int, max_turns: int) -> None:
        self.ttl_s, self.max_sessions, self.max_turns = ttl_s, max_sessions, max_turns
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def _live(self, session_id: str, now: float) -> Session | None:
        s = self._sessions.get(session_id)
        if s is not None and now - s.touched > self.ttl_s and not s.lock.locked():
            del self._sessions[session_id]
            return None
        return s

    def get(self, session_id: str, now: float | None = None, principal: Principal = OPEN) -> Session:
        s = self._live(session_id, time.monotonic() if now is None else now)
        if s is None or not principal.may_use(session_id, s.owner):  # another owner's: as if absent
            raise SessionNotFound(f"unknown or expired session {session_id!r}", session_id=session_id)
        return s

    def open(self, session_id: str, partial: bool, now: float | None = None, principal: Principal = OPEN) -> Session:
        """The live session ``session_id`` (created if new, bound to ``principal``'s owner), ready to take
        one more turn; a session of another owner is ``SessionNotFound``."""
        now = time.monotonic() if now is None else now
        s = self._live(session_id, now)
        if s is not None and not principal.may_use(session_id, s.owner):
            raise SessionNotFound(f"unknown or expired session {session_id!r}", session_id=session_id)
        if s is None and not principal.may_use(session_id, principal.owner):
            raise SessionNotFound(f"unknown or expired session {session_id!r}", session_id=session_id)
        if s is None:
            if len(self._sessions) >= self.max_sessions:
                self.expire(now)
                if len(self._sessions) >= self.max_sessions:
                    raise OverCapacity(f"session limit proxy.max_sessions={self.max_sessions} reached",
                                       retry_after_s=5)
            s = self._sessions[session_id] = Session(session_id, partial, created=now, touched=now,
                                                     owner=principal.owner)
        if s.finalized:
            raise SessionConflict(f"session {session_id!r} is finalized", session_id=session_id)
        if s.partial != partial:
            raise SessionConflict(f"session {session_id!r} was started with partial_rollout={s.partial}",
                                  session_id=session_id)
        if s.turns >= self.max_turns:
            raise SessionConflict(f"session {session_id!r} reached proxy.max_turns_per_session={self.max_turns}",
                                  session_id=session_id)
        s.touched = now
        return s

    def delete(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    async def close(self, session_ids: list[str], principal: Principal = OPEN) -> tuple[list[Session], list[str]]:
        """Finalize and drop each session ``principal`` may see: a running turn is recorded first (its
        lock), and none can start afterwards. Returns the closed sessions (still readable) and the ids
        that were unknown, expired or another owner's -- never told apart."""
        closed: list[Session] = []
        missing: list[str] = []
        for sid in session_ids:
            try:
                s = self.get(sid, principal=principal)
            except SessionNotFound:
                missing.append(sid)
                continue
            async with s.lock:
                s.finalized = True
            self._sessions.pop(sid, None)
            closed.append(s)
        return closed, missing

    def expire(self, now: float | None = None) -> list[str]:
        """Drop sessions idle longer than the TTL (never one with a turn in progress)."""
        now = time.monotonic() if now is None else now
        gone = [sid for sid, s in self._sessions.items() if now - s.touched > self.ttl_s and not s.lock.locked()]
        for sid in gone:
            del self._sessions[sid]
        return gone
