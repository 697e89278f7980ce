"""Plain values that cross the scheduler's boundary: what a request asks for and what it gets back.

No torch, no HTTP: the HTTP layer builds `GenRequest` from a validated body and renders
`GenResult` as SGLang's response; unit tests build them directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.engine.sampling import SamplingSpec
from shared.errors import DressageError


class InvalidRequest(DressageError):
    """A request the model cannot run (ids outside the vocabulary, prompt beyond the context)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name  # dotted name of the offending body field


class UnsupportedField(DressageError):
    """A field SGLang accepts that cannot apply on this engine (images, LoRA, ...): answered 400."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class DuplicateRequest(DressageError):
    """A request id that is already in flight."""


class EngineBusy(DressageError):
    """The waiting queue is full; retry later."""


@dataclass(frozen=True)
class GenRequest:
    rid: str  # unique while in flight
    input_ids: list[int]  # prompt token ids, non-empty
    max_new_tokens: int  # >= 0; clamped to the context left after the prompt
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    stop_token_ids: frozenset[int] = frozenset()  # generation stops after producing one of these
    logprob_start_len: int = -1  # >= 0: also return prompt-token logprobs from this index
    top_logprobs_num: int = 0  # > 0: the top-n (logprob, id) per output (and prompt) position
    token_ids_logprob: tuple[int, ...] = ()  # logprobs of these ids at every position
    min_new_tokens: int = 0  # no stop (token, string, regex) ends the request before this many tokens
    # Stop strings / regexes: called with the output ids after each token; the matched
    # string (or regex) ends the request. Built by the HTTP layer, which owns the tokenizer.
    stop_check: Callable[[list[int]], str | None] | None = None
    # False (SGLang's default): a weight update waits until this request finished, so every
    # token has one version. True (extension): the request goes on across a swap, tokens are
    # tagged with the version that produced each.
    continue_across_weight_updates: bool = False


@dataclass
class GenResult:
    rid: str
    prompt_tokens: int
    output_ids: list[int]  # includes the matched stop token, as SGLang does
    output_logprobs: list[float]  # one per output id (see sampling.py for what they are)
    output_versions: list[str]  # weight version that produced each output id
    finish_reason: dict[str, Any]  # {"type": "stop", "matched": id} | {"type": "length", "length": n} | {"type": "abort", "message": ...}
    weight_version: str  # version of the last output token; the engine's version if there is none
    input_logprobs: list[float | None] | None = None  # from logprob_start_len; None for position 0
    # top_logprobs_num / token_ids_logprob: per position a list of (logprob, token id)
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None  # None at position 0
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None


ProgressCallback = Callable[[GenResult], None]  # a streaming request's state after each token


DoneCallback = Callable[[GenResult], None]


def stop_reason(token: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": token}


def length_reason(n: int) -> dict[str, Any]:
    return {"type": "length", "length": n}


def abort_reason(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message}
