"""Multi-turn ``guess`` task: find a hidden number using the environment's feedback.

Prompt ``"guess 23-37"`` (a range of 7–15 numbers inside 0..99); the reference is
``{"low": 23, "high": 37, "secret": 30}``. Each assistant reply is read as its first integer
(first non-empty line); the environment answers with a ``user`` message ``"higher"`` (the secret is
larger), ``"lower"`` or, for a reply without a usable number, ``"invalid"`` (a wasted turn). The
episode ends when the secret is named or after ``max_turns`` replies.

Reward: 1.0 when found within ``par`` turns — the worst case of binary search over the range,
``width.bit_length()`` (≤ 4 here) — then falling linearly by turn down to ``1/(max_turns-par+1)``
for a find on the last turn; 0.0 if never found.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from shared.tasks.base import (
    ChatMessage,
    DemoTurn,
    Episode,
    InvalidReference,
    first_line,
    make_row,
    prompt_messages,
)

MIN_WIDTH, MAX_WIDTH = 7, 15
LOWEST, HIGHEST = 0, 99
_PROMPT = re.compile(r"guess (\d{1,2})-(\d{1,2})")
_NUMBER = re.compile(r"\d+")


def parse_guess(reply: str) -> int | None:
    """The first integer of the reply's first non-empty line, or None (garbage never raises)."""
    m = _NUMBER.search(first_line(reply))
    if m is None or len(m.group()) > 6:
        return None
    return int(m.group())


def _check_reference(reference: Any) -> tuple[int, int, int]:
    if not isinstance(reference, Mapping):
        raise InvalidReference(
            "reference", f"must be an object with low, high, secret; got {type(reference).__name__}"
        )
    values = []
    for key in ("low", "high", "secret"):
        v = reference.get(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidReference(f"reference.{key}", f"must be an integer, got {v!r}")
        values.append(v)
    extra = sorted(set(reference) - {"low", "high", "secret"})
    if extra:
        raise InvalidReference("reference", f"unknown keys {extra}")
    low, high, secret = values
    if not LOWEST <= low <= high <= HIGHEST:
        raise InvalidReference(
            "reference.high", f"need {LOWEST} <= low <= high <= {HIGHEST}, got {low}..{high}"
        )
    if high - low + 1 > MAX_WIDTH:
        raise InvalidReference("reference.high", f"range {low}..{high} is wider than {MAX_WIDTH}")
    if not low <= secret <= high:
        raise InvalidReference("reference.secret", f"{secret} is outside {low}..{high}")
    return low, high, secret


class GuessEpisode(Episode):
    """A guessing game against a fixed secret."""

    def __init__(self, messages: list[ChatMessage], secret: int, par: int, max_turns: int) -> None:
        super().__init__(messages, max_turns=max_turns)
        self.secret = secret
        self.par = par

    def _feedback(self, reply: str) -> str | None:
        guess = parse_guess(reply)
        if guess is None:
            return "invalid"
        if guess == self.secret:
            self.solved = True
            return "correct"
        return "higher" if self.secret > guess else "lower"

    def reward(self) -> float:
        if not self.solved:
            return 0.0
        if self.turns <= self.par:
            return 1.0
        return 1.0 - (self.turns - self.par) / (self.max_turns - self.par + 1)


class GuessTask:
    """Find a hidden number in a small range with higher/lower feedback."""

    name = "guess"
    multi_turn = True
    max_turns = 6
    max_new_tokens = 4
    capacity = sum((HIGHEST - LOWEST + 2 - w) * w for w in range(MIN_WIDTH, MAX_WIDTH + 1))

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` distinct (range, secret) rows, a pure function of ``(n, seed)``."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"n must be in [0, {self.capacity}] for task 'guess', got {n}")
        rng = random.Random(f"{self.name}:{seed}")
        seen: set[tuple[int, int, int]] = set()
        rows: list[dict[str, Any]] = []
        while len(rows) < n:
            width = rng.randint(MIN_WIDTH, MAX_WIDTH)
            low = rng.randint(LOWEST, HIGHEST + 1 - width)
            high = low + width - 1
            secret = rng.randint(low, high)
            if (low, high, secret) not in seen:
                seen.add((low, high, secret))
                ref = {"low": low, "high": high, "secret": secret}
                rows.append(make_row(self.name, len(rows), seed, f"guess {low}-{high}", ref))
        return rows

    def validate_reference(self, reference: Any) -> None:
        _check_reference(reference)

    def _validated(
        self, prompt: str | Sequence[Any], reference: Any
    ) -> tuple[list[ChatMessage], int, int, int]:
        messages = prompt_messages(prompt)
        low, high, secret = _check_reference(reference)
        m = _PROMPT.fullmatch(prompt) if isinstance(prompt, str) else None
        if m is not None and (int(m.group(1)), int(m.group(2))) != (low, high):
            raise InvalidReference("reference", f"range {low}..{high} does not match prompt {prompt!r}")
        return messages, low, high, secret

    def start(self, prompt: str | Sequence[Any], reference: Any) -> GuessEpisode:
        messages, low, high, secret = self._validated(prompt, reference)
        return GuessEpisode(messages, secret, par=(high - low + 1).bit_length(), max_turns=self.max_turns)

    def demonstration(self, prompt: str | Sequence[Any], reference: Any) -> list[DemoTurn]:
        """Binary search (guess the lower midpoint), which finds the secret within ``par`` turns."""
        messages, low, high, secret = self._validated(prompt, reference)
        turns: list[DemoTurn] = []
        while True:
            guess = (low + high) // 2
            turns.append(([dict(m) for m in messages], str(guess)))
            if guess == secret:
                return turns
            feedback = "higher" if secret > guess else "lower"
            messages = [
                *messages,
                {"role": "assistant", "content": str(guess)},
                {"role": "user", "content": feedback},
            ]
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
