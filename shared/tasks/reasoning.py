"""The reasoning split: a thinking model's reply = its reasoning block + the answer that is scored.

Pure, no I/O. Two parsers, named as SGLang's ``--reasoning-parser`` names them (its reasoning parser
returns ``reasoning_content`` and ``content`` in a chat completion; the proxy does the same with
``proxy.reasoning_parser``):

* ``qwen3`` (Qwen3 and most ``<think>`` templates): a reply that does not open with ``<think>``
  and has no ``</think>`` has no reasoning; ``<think>R</think>A`` splits into ``R`` and ``A``; a
  ``</think>`` without its opening tag (a template that wrote ``<think>`` into the prompt) splits
  there too; an opened block that never closes (the model ran out of tokens while thinking) is all
  reasoning and an empty answer -- so a truncated thought scores as no answer, never as one.
* ``deepseek-r1``: the reply starts inside the block (the template opened it): everything before
  ``</think>`` is reasoning; without ``</think>`` all of it is.

Invariant: ``reasoning + answer`` loses only the tags and the whitespace around the answer; a reply
without tags is returned unchanged as the answer (``qwen3``), so the split is safe on every model.
"""

from __future__ import annotations

from typing import Literal

THINK_START, THINK_END = "<think>", "</think>"
ReasoningParser = Literal["qwen3", "deepseek-r1"]
PARSERS: tuple[str, ...] = ("qwen3", "deepseek-r1")


def split_reasoning(text: str, parser: ReasoningParser = "qwen3") -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a reply; ``reasoning`` is None when the reply has no reasoning block."""
    text = text if isinstance(text, str) else str(text)
    head, end, tail = text.partition(THINK_END)
    if end:
        reasoning = head.lstrip()
        if reasoning.startswith(THINK_START):
            reasoning = reasoning[len(THINK_START):]
        return reasoning.strip(), tail.strip()
    stripped = text.lstrip()
    if parser == "deepseek-r1":
        body = stripped[len(THINK_START):] if stripped.startswith(THINK_START) else stripped
        return body.strip(), ""
    if stripped.startswith(THINK_START):
        return stripped[len(THINK_START):].strip(), ""
    return None, text


def answer_text(text: str, parser: ReasoningParser = "qwen3") -> str:
    """The part of a reply a verifier scores: the text after its reasoning block (all of it without one)."""
    return split_reasoning(text, parser)[1]
