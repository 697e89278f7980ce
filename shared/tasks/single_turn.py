"""Single-turn tasks with per-digit partial credit: ``reverse`` (digit reversal) and ``add``.

Text format (char-level friendly, deterministic):
* ``reverse``: prompt ``"reverse 4821"`` → answer ``"1284"`` (3–6 digits, leading zeros allowed).
* ``add``: prompt ``"12+7="`` → answer ``"19"`` (both operands in 0..99).

The reference is the answer string. Reward is 1.0 only for the exact answer (first non-empty
line of the reply, stripped); otherwise 0.9 × matching digit positions / longer length
(``reverse`` compares left-aligned, ``add`` right-aligned, ones digit first).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from shared.tasks.base import (
    ChatMessage,
    DemoTurn,
    Episode,
    InvalidReference,
    digit_credit,
    make_row,
    prompt_messages,
)

MAX_ANSWER_CHARS = 11


class AnswerEpisode(Episode):
    """One prompt, one reply, scored against a known answer; never any feedback."""

    def __init__(self, messages: list[ChatMessage], answer: str, align: str) -> None:
        super().__init__(messages, max_turns=1)
        self.answer = answer
        self.align = align

    def _feedback(self, reply: str) -> str | None:
        self.solved = digit_credit(reply, self.answer, self.align) == 1.0
        return None

    def reward(self) -> float:
        return digit_credit(self.replies[-1], self.answer, self.align) if self.replies else 0.0


def _check_answer(reference: Any) -> str:
    if not isinstance(reference, str) or not reference.isdigit() or not reference.isascii():
        raise InvalidReference("reference", f"must be a string of digits, got {reference!r}")
    if len(reference) > MAX_ANSWER_CHARS:
        raise InvalidReference("reference", f"longer than {MAX_ANSWER_CHARS} characters")
    return reference


class _SingleTurnTask:
    """Shared plumbing of the single-turn tasks; subclasses define the prompt language."""

    name = ""
    multi_turn = False
    max_turns = 1
    max_new_tokens = 8
    align = "left"
    capacity = 0  # number of distinct rows the generator can produce

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def expected(self, prompt: str) -> str | None:
        """The answer a canonical string prompt implies, or None when the prompt is free-form."""
        raise NotImplementedError

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` distinct rows, a pure function of ``(n, seed)``."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"n must be in [0, {self.capacity}] for task {self.name!r}, got {n}")
        rng = random.Random(f"{self.name}:{seed}")
        seen: set[str] = set()
        rows: list[dict[str, Any]] = []
        while len(rows) < n:
            prompt, answer = self._draw(rng)
            if prompt not in seen:
                seen.add(prompt)
                rows.append(make_row(self.name, len(rows), seed, prompt, answer))
        return rows

    def validate_reference(self, reference: Any) -> None:
        _check_answer(reference)

    def _validated(self, prompt: str | Sequence[Any], reference: Any) -> tuple[list[ChatMessage], str]:
        messages = prompt_messages(prompt)
        answer = _check_answer(reference)
        if isinstance(prompt, str):
            implied = self.expected(prompt)
            if implied is not None and implied != answer:
                raise InvalidReference(
                    "reference", f"{answer!r} is not the answer to {prompt!r} ({implied!r})"
                )
        return messages, answer

    def start(self, prompt: str | Sequence[Any], reference: Any) -> AnswerEpisode:
        messages, answer = self._validated(prompt, reference)
        return AnswerEpisode(messages, answer, self.align)

    def demonstration(self, prompt: str | Sequence[Any], reference: Any) -> list[DemoTurn]:
        messages, answer = self._validated(prompt, reference)
        return [(messages, answer)]


class ReverseTask(_SingleTurnTask):
    """Reverse a string of 3–6 digits."""

    name = "reverse"
    max_new_tokens = 8
    align = "left"
    capacity = sum(10**k for k in range(3, 7))
    _PROMPT = re.compile(r"reverse (\d{1,11})")

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
        return f"reverse {digits}", digits[::-1]

    def expected(self, prompt: str) -> str | None:
        m = self._PROMPT.fullmatch(prompt)
        return m.group(1)[::-1] if m else None


class AddTask(_SingleTurnTask):
    """Add two numbers in 0..99."""

    name = "add"
    max_new_tokens = 6
    align = "right"
    capacity = 100 * 100
    _PROMPT = re.compile(r"(\d{1,5})\+(\d{1,5})=")

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"{a}+{b}=", str(a + b)

    def expected(self, prompt: str) -> str | None:
        m = self._PROMPT.fullmatch(prompt)
        return str(int(m.group(1)) + int(m.group(2))) if m else None
