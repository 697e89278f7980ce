"""Tool-using ``lookup`` task: the answer is only reachable by calling the ``lookup`` tool.

Prompt ``"code of qzt?"`` (a key of 3 lowercase letters); the answer is ``lookup_value("qzt")``, a
4-digit code derived from a hash of the key, so the model cannot compute or guess it -- it has to
call the tool and copy the result. The reference is the answer string.

An episode is the tool loop an agent runs: the model sees the tool list (``TOOLS``, rendered by the
chat template), replies with a Hermes tool call (``<tool_call>{"name": "lookup", "arguments":
{"key": "qzt"}}</tool_call>``, parsed by ``shared.toolcalls`` as the proxy parses it), the
environment answers with a ``tool`` message, and the model's first reply without a tool call is its
answer. ``max_turns`` bounds the loop. Reward: ``TOOL_CREDIT`` for a well-formed ``lookup`` call
with the prompt's key (using the tool right is the skill) plus ``1 - TOOL_CREDIT`` times the
answer's ``digit_credit`` (exact, or partial per matching digit); 1.0 only for both. ``tool_calls`` / ``malformed``
count the well-formed and malformed calls of the episode (the share of well-formed calls is a
training metric of the tool agent). ``guess`` is the other habit a warm start can teach
(``model.warm_guess_share``): answering from memory with a code that is never the right one, the
way a model that has not learned to use its tools answers; it earns only chance digit credit.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
from collections.abc import Sequence
from typing import Any

from shared.tasks.base import (
    ChatMessage,
    DemoTurn,
    Episode,
    InvalidReference,
    digit_credit,
    first_line,
    make_row,
    prompt_messages,
)
from shared.toolcalls import ToolCall, split

_PROMPT = re.compile(r"code of ([a-z]{3})\?")
TOOL_CREDIT = 0.3  # share of the reward for calling the tool with the right key
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "lookup", "description": "The 4-digit code of a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


def lookup_value(key: str) -> str:
    """The code of ``key``: 4 digits of a keyed hash (deterministic, not guessable from the key)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=b"dressage-lookup").digest()
    return f"{int.from_bytes(digest, 'big') % 10_000:04d}"


def run_tool(call: ToolCall) -> str:
    """The environment's answer to one tool call (errors are answers too, never exceptions)."""
    if call.name != "lookup":
        return f"error: unknown tool {call.name}"
    key = json.loads(call.arguments).get("key")
    if not isinstance(key, str) or not re.fullmatch(r"[a-z]{3}", key):
        return "error: key must be 3 letters"
    return lookup_value(key)


def guessed_value(key: str) -> str:
    """A code written from memory for ``key``: 4 digits of another hash, never ``lookup_value(key)``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=b"dressage-memory").digest()
    code = int.from_bytes(digest, "big") % 10_000
    if f"{code:04d}" == lookup_value(key):
        code = (code + 1) % 10_000
    return f"{code:04d}"


def tool_call_text(key: str) -> str:
    """The Hermes call the chat template writes for ``lookup(key)`` (what a demonstration shows)."""
    return ToolCall("", "lookup", json.dumps({"key": key})).hermes()


class LookupEpisode(Episode):
    def __init__(self, messages: list[ChatMessage], key: str, answer: str, max_turns: int) -> None:
        super().__init__(messages, max_turns=max_turns)
        self.key, self.answer = key, answer
        self.used_tool = False  # a well-formed lookup call with the prompt's key was made
        self.final: str | None = None  # the reply without a tool call (None: never answered)
        self.tool_calls = 0
        self.malformed = 0

    def _feedback(self, reply: str) -> str | None:
        content, calls = split(reply, "hermes")
        self.malformed += reply.count("<tool_call>") - len(calls)
        if not calls:
            self.final = content
            self.solved = first_line(content) == self.answer
            self.done = True  # an answer ends the episode
            return None
        self.tool_calls += len(calls)  # each call is answered by a ``tool`` message
        self.used_tool = self.used_tool or any(
            c.name == "lookup" and json.loads(c.arguments).get("key") == self.key for c in calls)
        results = [run_tool(c) for c in calls]
        if self.turns < self.max_turns:
            self._messages += [{"role": "tool", "content": r} for r in results]
        return None

    def reward(self) -> float:
        answer = digit_credit(self.final, self.answer) if self.final is not None else 0.0
        return TOOL_CREDIT * self.used_tool + (1 - TOOL_CREDIT) * answer


class LookupTask:
    """Answer with the code of a key, which only the ``lookup`` tool knows."""

    name = "lookup"
    multi_turn = True
    max_turns = 3
    max_new_tokens = 96  # a call is ~72 characters
    tools = TOOLS
    capacity = 26 ** 3

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        if not 0 <= n <= self.capacity:
            raise ValueError(f"n must be in [0, {self.capacity}] for task 'lookup', got {n}")
        rng = random.Random(f"{self.name}:{seed}")
        keys: list[str] = []
        seen: set[str] = set()
        while len(keys) < n:
            key = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
            if key not in seen:
                seen.add(key)
                keys.append(key)
        return [make_row(self.name, i, seed, f"code of {k}?", lookup_value(k)) for i, k in enumerate(keys)]

    def validate_reference(self, reference: Any) -> None:
        if not isinstance(reference, str) or not re.fullmatch(r"\d{4}", reference):
            raise InvalidReference("reference", f"must be a 4-digit string, got {reference!r}")

    def _key(self, prompt: str | Sequence[Any], reference: Any) -> tuple[list[ChatMessage], str]:
        messages = prompt_messages(prompt)
        self.validate_reference(reference)
        m = _PROMPT.fullmatch(messages[-1]["content"])
        if m is None:
            raise InvalidReference("prompt", "must read 'code of <3 lowercase letters>?'")
        if lookup_value(m.group(1)) != reference:
            raise InvalidReference("reference", f"is not the code of {m.group(1)!r}")
        return messages, m.group(1)

    def start(self, prompt: str | Sequence[Any], reference: Any) -> LookupEpisode:
        messages, key = self._key(prompt, reference)
        return LookupEpisode(messages, key, reference, self.max_turns)

    def demonstration(self, prompt: str | Sequence[Any], reference: Any) -> list[DemoTurn]:
        """Call the tool with the prompt's key, then answer with its result."""
        messages, key = self._key(prompt, reference)
        call = tool_call_text(key)
        after = [*messages, {"role": "assistant", "content": call}, {"role": "tool", "content": reference}]
        return [(messages, call), (after, reference)]

    def guess(self, prompt: str | Sequence[Any], reference: Any) -> list[DemoTurn]:
        """Answer at once from memory, without the tool: a wrong code (the habit RL should unlearn)."""
        messages, key = self._key(prompt, reference)
        return [(messages, guessed_value(key))]
