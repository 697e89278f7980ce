"""The task interface a user implements, and its adapter to the episode protocol the services drive.

A task plugin is a class, named by an import path (``model.task: mypkg.tasks:CodeTask``), by an entry
point of the group ``dressage.tasks``, or by a built-in name (``shared.tasks.registry``). Only
``score`` is required; every other member is optional (docs/guides/your-task.md)::

    class MyTask:
        max_turns = 1             # model calls per white-box trajectory (default 1)
        max_new_tokens = 256      # per model call (default 256; rollout.max_new_tokens overrides)
        tools = None              # OpenAI function tools the chat template renders (default none)
        agent_reward = "refuse"   # an agent-reported reward: "refuse" | "accept" | "combine"

        def messages(self, row): ...          # first messages (str = one user message); default row["prompt"]
        def score(self, trajectory, row): ... # float, or Score(reward, components, correct)
        def env_step(self, trajectory, row): ...  # multi-turn: the next message(s) after a reply, None = done
        def validate(self, row): ...          # raise ValueError to refuse a row when the dataset loads
        def demonstration(self, row): ...     # [(messages, reply), ...]: warm start of a tiny CPU model only

``row`` is the dataset row as read (every field of the file). ``trajectory`` is a :class:`Trajectory`:
the messages so far, the replies, the last reply split into ``reasoning`` and ``answer``
(``shared.tasks.reasoning``) and the reward the agent reported, if the task takes it.

Agent-reported rewards (``agent_reward``): ``refuse`` drops a reported reward (``score`` never sees it);
``accept`` makes it the reward when there is one (``score`` runs only when the agent reported none);
``combine`` hands it to ``score`` as ``trajectory.agent_reward``, which decides.

Invariant: user code runs only inside :meth:`PluginTask._call`, so anything a hook raises -- and a
reward that is not a finite number -- becomes :class:`TaskFailed` naming the task, the hook and the
row; the rollout worker fails that group (not retried: dead-lettered with the reason) and goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from shared.errors import DressageError
from shared.tasks.base import AgentReward, ChatMessage, DemoTurn, Episode, InvalidReference, prompt_messages
from shared.tasks.reasoning import split_reasoning

T = TypeVar("T")
AgentRewardPolicy = Literal["refuse", "accept", "combine"]
AGENT_REWARD_POLICIES: tuple[str, ...] = ("refuse", "accept", "combine")
DEFAULT_MAX_NEW_TOKENS = 256
MAX_COMPONENTS = 32  # named reward parts per trajectory


class TaskFailed(DressageError):
    """A task's own code raised, or its score was not a finite number; names the task, hook and row."""

    def __init__(self, task: str, hook: str, row_id: str, reason: str) -> None:
        super().__init__(f"task {task!r} {hook} failed on row {row_id!r}: {reason}")
        self.task, self.hook, self.row_id, self.reason = task, hook, row_id, reason


@dataclass(frozen=True)
class Score:
    """What ``score`` may return instead of a bare float."""

    reward: float  # the trajectory's reward (finite; the GRPO advantage is computed from it)
    components: dict[str, float] = field(default_factory=dict)  # named parts, logged as rollout/reward/<name>
    correct: bool | None = None  # counts toward accuracy; None: reward >= 1.0


@dataclass(frozen=True)
class Trajectory:
    """One finished (or running, for ``env_step``) trajectory as the task sees it."""

    messages: list[ChatMessage]  # the conversation: first messages, replies, environment messages
    replies: list[str]  # every assistant reply, in order (a black-box agent's reported turns)
    reasoning: str | None  # the last reply's reasoning block; None without one
    answer: str  # the last reply after its reasoning block ("" before any reply)
    agent_reward: AgentReward | None = None  # the agent's reported reward, if the task takes it

    @property
    def turns(self) -> int:
        return len(self.replies)


def row_id(row: Mapping[str, Any]) -> str:
    value = row.get("prompt_id") if isinstance(row, Mapping) else None
    return str(value) if value is not None else "?"


def check_reward(value: Any, what: str = "reward") -> float:
    """``value`` as a finite float; ``ValueError`` naming ``what`` otherwise (bools are not rewards)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{what} must be finite, got {out}")
    return out


def check_components(components: Any) -> dict[str, float]:
    if components is None:
        return {}
    if not isinstance(components, Mapping) or len(components) > MAX_COMPONENTS:
        raise ValueError(f"components must be a mapping of at most {MAX_COMPONENTS} names to numbers")
    out: dict[str, float] = {}
    for name, value in components.items():
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum() or len(name) > 64:
            raise ValueError(f"component name {str(name)[:80]!r} must be 1-64 letters, digits, '_' or '-'")
        out[name] = check_reward(value, f"component {name!r}")
    return out


class PluginTask:
    """A user's task object adapted to the services' task protocol (``shared.tasks.base.Task``)."""

    def __init__(self, name: str, impl: Any) -> None:
        self.name = name
        self.impl = impl
        self.max_turns = int(getattr(impl, "max_turns", 1) or 1)
        self.max_new_tokens = int(getattr(impl, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS) or DEFAULT_MAX_NEW_TOKENS)
        self.multi_turn = self.max_turns > 1
        tools = getattr(impl, "tools", None)
        if tools is not None:
            self.tools = tools
        self.agent_reward: AgentRewardPolicy = getattr(impl, "agent_reward", "refuse")
        if self.agent_reward not in AGENT_REWARD_POLICIES:
            raise TaskFailed(name, "agent_reward", "-", f"must be one of {', '.join(AGENT_REWARD_POLICIES)}, "
                                                        f"got {self.agent_reward!r}")
        if not callable(getattr(impl, "score", None)):
            raise TaskFailed(name, "score", "-", "a task must define score(trajectory, row)")

    def _call(self, hook: str, row: Mapping[str, Any], fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except TaskFailed:
            raise
        except Exception as exc:  # the plugin boundary: user code is attributed, never a worker crash
            raise TaskFailed(self.name, hook, row_id(row), f"{type(exc).__name__}: {exc}") from exc

    # -- the row ----------------------------------------------------------------------------------

    def first_messages(self, row: Mapping[str, Any]) -> list[ChatMessage]:
        """The messages of the first model call; ``InvalidReference`` naming the field for a bad row."""
        hook = getattr(self.impl, "messages", None)
        if hook is None:
            if "prompt" not in row:
                raise InvalidReference("prompt", "missing (or give the task a messages(row) method)")
            return prompt_messages(row["prompt"])
        try:
            produced = self._call("messages", row, hook, row)
        except TaskFailed as exc:
            raise InvalidReference("prompt", exc.reason) from exc
        return prompt_messages(produced)

    def check_row(self, row: Mapping[str, Any]) -> list[ChatMessage]:
        """Validate ``row`` at load time (the task's ``validate``); its first messages."""
        messages = self.first_messages(row)
        hook = getattr(self.impl, "validate", None)
        if hook is not None:
            try:
                self._call("validate", row, hook, row)
            except TaskFailed as exc:
                raise InvalidReference("row", exc.reason) from exc
        return messages

    def start_row(self, row: Mapping[str, Any]) -> PluginEpisode:
        return PluginEpisode(self, dict(row), self.first_messages(row))

    # -- the built-in protocol, for callers that hold a prompt and a reference ----------------------

    def validate_reference(self, reference: Any) -> None:
        return None  # a plugin checks its rows in validate(row)

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        raise TaskFailed(self.name, "generate", "-", "a plugin generates no rows: it brings a dataset file "
                                                     "(docs/guides/your-dataset.md)")

    def start(self, prompt: str | Sequence[Any], reference: Any) -> PluginEpisode:
        return self.start_row({"prompt": prompt, "reference": reference})

    def demonstration_row(self, row: Mapping[str, Any]) -> list[DemoTurn]:
        hook = getattr(self.impl, "demonstration", None)
        if hook is None:
            raise TaskFailed(self.name, "demonstration", row_id(row), "this task has no demonstrations (a warm start "
                                                                      "of a tiny model needs them; real models do not)")
        turns = self._call("demonstration", row, hook, row)
        return [(prompt_messages(messages), str(reply)) for messages, reply in turns]

    def demonstration(self, prompt: str | Sequence[Any], reference: Any) -> list[DemoTurn]:
        return self.demonstration_row({"prompt": prompt, "reference": reference})

    # -- scoring ----------------------------------------------------------------------------------

    def env_step(self, trajectory: Trajectory, row: Mapping[str, Any]) -> list[ChatMessage] | None:
        hook = getattr(self.impl, "env_step", None)
        if hook is None:
            return None
        produced = self._call("env_step", row, hook, trajectory, row)
        if produced is None:
            return None
        try:
            return prompt_messages(produced)
        except InvalidReference as exc:
            raise TaskFailed(self.name, "env_step", row_id(row), f"returned {exc}") from None

    def score(self, trajectory: Trajectory, row: Mapping[str, Any]) -> Score:
        raw = self._call("score", row, self.impl.score, trajectory, row)
        try:
            if isinstance(raw, Score):
                return Score(check_reward(raw.reward), check_components(raw.components), raw.correct)
            return Score(check_reward(raw))
        except ValueError as exc:
            raise TaskFailed(self.name, "score", row_id(row), str(exc)) from None


class PluginEpisode(Episode):
    """A plugin's trajectory: replies, the task's environment messages, one score (computed once)."""

    def __init__(self, task: PluginTask, row: dict[str, Any], messages: list[ChatMessage]) -> None:
        super().__init__(messages, max_turns=task.max_turns)
        self.task, self.row = task, row
        self.agent_report: AgentReward | None = None
        self._score: Score | None = None

    def trajectory(self) -> Trajectory:
        reasoning, answer = split_reasoning(self.replies[-1]) if self.replies else (None, "")
        return Trajectory(self.messages(), list(self.replies), reasoning, answer, self.agent_report)

    def _feedback(self, reply: str) -> str | None:
        if self.turns >= self.max_turns:
            return None
        follow = self.task.env_step(self.trajectory(), self.row)
        if follow is None:
            self.done = True  # the environment ended the episode
            return None
        self._messages += follow[:-1]
        return None if not follow else self._last(follow[-1])

    def _last(self, message: ChatMessage) -> str | None:
        if message["role"] == "user":
            return message["content"]  # Episode.step appends it as the user's answer
        self._messages.append(message)  # e.g. a tool result
        return None

    def take_agent_turns(self, turns: list[str]) -> None:
        """A black-box agent ran its own loop (it is the environment): record its turns, score them."""
        for turn in turns:
            self._messages.append({"role": "assistant", "content": turn})
            self.replies.append(turn)
        self.done = True

    def offer_agent_reward(self, report: AgentReward) -> bool:
        if self.task.agent_reward == "refuse":
            return False
        self.agent_report = report
        self._score = None
        return True

    def _scored(self) -> Score:
        if self._score is None:
            report = self.agent_report
            if self.task.agent_reward == "accept" and report is not None:
                self._score = Score(report.reward, dict(report.components))
            else:
                self._score = self.task.score(self.trajectory(), self.row)
        return self._score

    def reward(self) -> float:
        return self._scored().reward

    def components(self) -> dict[str, float]:
        return dict(self._scored().components)

    def correct(self) -> bool:
        score = self._scored()
        return score.correct if score.correct is not None else score.reward >= 1.0
