"""The episode protocol the services drive, and the built-in tasks' own contract.

Every task -- built-in or a plugin (``shared.tasks.plugin``: the small interface a user implements,
adapted to this protocol) -- turns a dataset row into an :class:`Episode` that produces the chat
messages for the next model call, records each assistant reply, optionally answers with environment
feedback, and finally scores the trajectory. ``start_episode(task, row)`` is the one way in.

What every task keeps: a garbage reply is a wrong answer, never an exception; ``reward()`` is a
finite number; a row the task cannot take raises :class:`InvalidReference` naming the field.

The built-in tasks (``reverse``, ``add``, ``guess``, ``lookup``) keep more, because they train the
tiny char-level CPU models this project builds; none of this binds a plugin:
* ``generate(n, seed)`` is a pure function of ``(n, seed)``; its rows are JSON-serialisable and
  pairwise distinct in ``(prompt, reference)``.
* text stays inside the char-level vocabulary: printable ASCII 32..126 and ``"\\n"``; prompts are
  shorter than 40 characters and answers shorter than 12 (a tool call, in the Hermes format of
  ``shared.toolcalls``, is not an answer; tool-using tasks list their tools in a ``tools``
  attribute, in OpenAI's shape).
* ``reward()`` is in ``[0, 1]``; ``correct()`` implies ``reward() == 1.0``.
* a bad ``reference`` raises :class:`InvalidReference` naming the field at the edge
  (``start`` / ``validate_reference``).
* replaying ``demonstration(prompt, reference)`` through ``start(prompt, reference)`` ends with
  ``reward() == 1.0`` and ``correct()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.errors import DressageError
from shared.tasks.reasoning import answer_text

ChatMessage = dict[str, str]
DemoTurn = tuple[list[ChatMessage], str]


class InvalidReference(ValueError, DressageError):
    """A dataset row's ``reference`` (or ``prompt``) does not fit its task; ``field`` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class EpisodeFinished(DressageError):
    """``Episode.step`` was called after the episode was done (a caller bug, not bad model output)."""


def prompt_messages(prompt: str | Sequence[Any]) -> list[ChatMessage]:
    """The initial chat messages for ``prompt``: a bare string becomes one ``user`` message.

    A list may hold ``{"role", "content"}`` mappings or objects with those attributes
    (``shared.schemas.Message``); anything else raises :class:`InvalidReference` for ``prompt``.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidReference("prompt", "must be a non-empty string")
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or not prompt:
        raise InvalidReference(
            "prompt", f"must be a string or a non-empty list of messages, got {type(prompt).__name__}"
        )
    out: list[ChatMessage] = []
    for i, m in enumerate(prompt):
        role = m.get("role") if isinstance(m, Mapping) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, Mapping) else getattr(m, "content", None)
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise InvalidReference(f"prompt[{i}]", "each message needs a string 'role' and 'content'")
        out.append({"role": role, "content": content})
    return out


def first_line(reply: str) -> str:
    """The part of a reply that is scored: the first non-empty line, stripped, of the text after its
    reasoning block (``shared.tasks.reasoning``), so a thinking model is scored on its answer."""
    for line in answer_text(str(reply)).strip().split("\n"):
        if line.strip():
            return line.strip()
    return ""


def digit_credit(reply: str, answer: str, align: str = "left") -> float:
    """1.0 for an exact answer, else ``0.9 * matching positions / max(len)`` (so never 1.0).

    ``align="right"`` compares from the last character (ones digit first), the natural
    alignment for sums; ``"left"`` compares from the first character.
    """
    got = first_line(reply)
    if got == answer:
        return 1.0
    if not got or not answer:
        return 0.0
    a, b = (got, answer) if align == "left" else (got[::-1], answer[::-1])
    matches = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    return 0.9 * matches / max(len(got), len(answer))


class Episode:
    """One trajectory of a task: messages for the next model call, replies, feedback, score.

    Subclasses implement :meth:`_feedback` (environment answer to a reply; ``None`` = no message)
    and :meth:`reward`. ``done`` turns True when the task is solved or ``max_turns`` replies were
    made; feedback is only appended while the episode continues.
    """

    def __init__(self, messages: list[ChatMessage], max_turns: int) -> None:
        self._messages = list(messages)
        self.max_turns = max_turns
        self.replies: list[str] = []
        self.done = False
        self.solved = False

    @property
    def turns(self) -> int:
        """Assistant replies recorded so far."""
        return len(self.replies)

    def messages(self) -> list[ChatMessage]:
        """The conversation so far (a copy); while not done its last message is from the user."""
        return [dict(m) for m in self._messages]

    def step(self, reply: str) -> None:
        """Record an assistant reply and, for multi-turn tasks, the environment's answer."""
        if self.done:
            raise EpisodeFinished(f"episode already finished after {self.turns} turns")
        reply = reply if isinstance(reply, str) else str(reply)
        self._messages.append({"role": "assistant", "content": reply})
        self.replies.append(reply)
        feedback = self._feedback(reply)
        if self.solved or self.turns >= self.max_turns:
            self.done = True
        elif feedback is not None:
            self._messages.append({"role": "user", "content": feedback})

    def _feedback(self, reply: str) -> str | None:
        raise NotImplementedError

    def take_agent_turns(self, turns: list[str]) -> None:
        """Step the assistant turns a black-box agent reported, in order, until the episode is done."""
        for turn in turns:
            if self.done:
                break
            self.step(turn)

    def offer_agent_reward(self, report: AgentReward) -> bool:
        """An agent reported its own reward; True if the task takes it into account. Built-in tasks
        score with their own verifier only: refused."""
        return False

    def reward(self) -> float:
        """Trajectory reward in [0, 1]."""
        raise NotImplementedError

    def components(self) -> dict[str, float]:
        """Named parts of the reward, logged as metrics (none for the built-ins)."""
        return {}

    def correct(self) -> bool:
        """The task was solved (implies ``reward() == 1.0``)."""
        return self.solved and self.reward() == 1.0


@dataclass(frozen=True)
class AgentReward:
    """A reward an agent reported for its own trajectory (the task decides what it counts for)."""

    reward: float  # finite
    components: dict[str, float] = field(default_factory=dict)  # named parts, each finite
    source: str = "proxy"  # "proxy" (POST /s/{session}/v1/reward) or "stdout" (the agent's last line)


class Task(Protocol):
    """What rollout workers and evaluation jobs need from a task (a plugin is adapted: ``shared.tasks.plugin``).
    ``generate(n, seed)`` makes the built-ins' datasets; a plugin brings a dataset file instead."""

    name: str
    multi_turn: bool
    max_turns: int
    max_new_tokens: int  # per model call

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]: ...

    def validate_reference(self, reference: Any) -> None: ...

    def start(self, prompt: str | Sequence[Any], reference: Any) -> Episode: ...

    def demonstration(self, prompt: str | Sequence[Any], reference: Any) -> list[DemoTurn]: ...


def start_episode(task: Task, row: Mapping[str, Any]) -> Episode:
    """The episode of dataset ``row``: a plugin reads the whole row, a built-in its prompt and reference."""
    start_row = getattr(task, "start_row", None)
    if start_row is not None:
        episode: Episode = start_row(row)
        return episode
    if "prompt" not in row:
        raise InvalidReference("prompt", "missing")
    return task.start(row["prompt"], row.get("reference"))


def make_row(task: str, index: int, seed: int, prompt: str, reference: Any) -> dict[str, Any]:
    """A dataset row in the shape every task's ``generate`` returns."""
    return {"prompt_id": f"{task}-{seed}-{index:05d}", "task": task, "prompt": prompt, "reference": reference}
