"""Stop strings, stop regexes and SGLang's trimming of the returned text (pure; the tokenizer is passed in).

Contract (SGLang 0.5's ``check_finished`` / ``trim_matched_stop``):

* `StopChecker` is called with a request's output ids after every token and returns the first
  stop string (or regex pattern) found in the decoded output, else None. Stop strings are looked
  for in the decoded tail of the output (enough tokens to hold the longest stop string, plus
  one), so the cost per token does not grow with the output; regexes search the whole output.
* `trim_text` is what the response's ``text`` holds: with ``no_stop_trim`` false, a matched stop
  string is cut together with everything after it, a matched regex from its match on, a matched
  stop token (``stop_token_ids`` / EOS) is left out of the decoded text. ``output_ids`` always
  keep every generated token (the matched stop token included), as in SGLang.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[list[int]], str]


class StopChecker:
    def __init__(self, decode: Decode, encode: Callable[[str], list[int]], strings: Sequence[str],
                 regexes: Sequence[str]) -> None:
        self.decode = decode
        self.strings = list(strings)
        self.regexes = [(r, re.compile(r)) for r in regexes]
        self.tail = max((len(encode(s)) for s in self.strings), default=0) + 2

    def __call__(self, output_ids: list[int]) -> str | None:
        if self.strings:
            tail = self.decode(output_ids[-self.tail:])
            for s in self.strings:
                if s in tail:
                    return s
        if self.regexes:
            text = self.decode(output_ids)
            for pattern, rx in self.regexes:
                if rx.search(text):
                    return pattern
        return None


def compile_regexes(patterns: Sequence[str]) -> str | None:
    """The first pattern that does not compile (None if all do): refused before the request runs."""
    for p in patterns:
        try:
            re.compile(p)
        except re.error:
            return p
    return None


def trim_text(output_ids: list[int], finish: dict[str, Any], decode: Decode, no_stop_trim: bool,
              regexes: Sequence[str] = ()) -> str:
    """The response text of `output_ids` that finished with `finish` (see the module doc)."""
    matched = finish.get("matched") if finish.get("type") == "stop" else None
    if no_stop_trim or matched is None:
        return decode(output_ids)
    if isinstance(matched, int):
        return decode(output_ids[:-1])
    text = decode(output_ids)
    if matched in regexes:
        m = re.search(matched, text)
        return text[:m.start()] if m else text
    pos = text.find(matched)
    return text[:pos] if pos >= 0 else text
