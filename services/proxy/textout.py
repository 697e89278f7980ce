"""One turn's output, built token by token: incremental text, stop strings, tool-call events (pure).

``TurnOutput.feed`` takes the tokens an engine produced since the last call (streamed or all at
once: the result is the same) and returns True once a stop string matched, so the caller can
abort the engine request. Invariants:
* ``text`` is the detokenised output (``decode`` decides whether special tokens show), grown
  with an offset window so each token is decoded a bounded number of times, and never ending in
  half a UTF-8 character (``\\ufffd`` tails wait for the next token);
* a stop string cuts the output: ``keep`` is the number of tokens whose text ends at or before
  the cut (the cut is the stop string's start, or its end with ``no_stop_trim`` or for a
  ``kept_stops`` entry -- the end of a tool call when only one call is allowed), and the
  returned text is exactly those tokens' text -- the recorded tokens end where the returned
  text ends, even when a stop string starts inside a token;
* events (content pieces and tool calls as they are written, ``toolcalls``) are emitted only for
  text that can no longer be cut: a tail that could still be the start of a stop string is held back;
* text written for the model before it starts (``prefill``: a forced call's start) is read by the
  splitter as the output's beginning but is no output token; its events come first;
* with no stop strings and no listener (a whole response), nothing needs the text before the
  end: the tokens are decoded once in ``finish`` (the proxy's hot path stays one decode).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.toolcalls import Event, Splitter, TextPiece, ToolCall

TopLogprobs = list[tuple[int, float]]  # (token id, logprob) of the most likely tokens at one position


@dataclass
class TurnOutput:
    decode: Callable[[list[int]], str]
    splitter: Splitter
    stops: tuple[str, ...] = ()
    no_stop_trim: bool = False
    kept_stops: tuple[str, ...] = ()  # stops (also in ``stops``) whose text stays, as with no_stop_trim
    stream: bool = False  # ask the engines to stream (a streamed response, or stop strings to cut early)
    listener: Callable[[list[Event]], None] | None = None  # streaming: called with each batch of events
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)
    text: str = ""  # decoded output so far (before any stop cut)
    ends: list[int] = field(default_factory=list)  # len(text) once token i was decoded
    matched_stop: str | None = None
    keep: int | None = None  # tokens kept after a stop-string cut (None: all)
    events: list[Event] = field(default_factory=list)
    _prefix: int = 0  # decode window [prefix:] (context for tokenizers that merge across tokens)
    _read: int = 0  # tokens whose text is already in ``text``
    _emitted: int = 0  # chars of ``text`` handed to the splitter
    _searched: int = 0  # chars of ``text`` already searched for stop strings

    @property
    def stopped(self) -> bool:
        return self.keep is not None

    def feed(self, ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[TopLogprobs] | None = None) -> bool:
        """Append tokens; True once a stop string matched (later tokens are ignored)."""
        if self.stopped:
            return True
        if not self.stops and self.listener is None:  # nothing needs the text before the end: decode once then
            self.ids += ids
            self.logprobs += logprobs
            self.tops += [list(t) for t in tops] if tops is not None else [[] for _ in ids]
            return False
        for i, tok in enumerate(ids):
            self.ids.append(int(tok))
            self.logprobs.append(float(logprobs[i]))
            self.tops.append(list(tops[i]) if tops is not None and i < len(tops) else [])
            self._decode_new()
            self.ends.append(len(self.text))
            if self.stops and self._match_stop():
                break
        self._emit(final=False)
        return self.stopped

    def prefill(self, text: str) -> None:
        """Text the proxy wrote for the model after the prompt (a forced call's start)."""
        self._publish(self.splitter.feed(text))

    def finish(self) -> list[Event]:
        """End of generation: flush held-back text and open tool-call blocks; returns every event."""
        if self._read < len(self.ids) and not self.stops and self.listener is None:  # the one-decode path
            self.text, self._read = self.decode(self.ids), len(self.ids)
        self._emit(final=True)
        self._publish(self.splitter.finish())
        return self.events

    # --- results ---------------------------------------------------------------------------

    @property
    def kept(self) -> int:
        return len(self.ids) if self.keep is None else self.keep

    @property
    def final_text(self) -> str:
        """The returned text: exactly the kept tokens' text."""
        if self.keep is None:
            return self.text
        return self.text[:self.ends[self.keep - 1]] if self.keep else ""

    def settled(self) -> int:
        """Output tokens whose text has been handed to the splitter (streaming; never past a stop cut):
        the events published so far cover them, except text a splitter still holds (an open tool call)."""
        return min(bisect_right(self.ends, self._emitted), self.kept)

    def content(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextPiece))

    def tool_calls(self) -> list[ToolCall]:
        return [e for e in self.events if isinstance(e, ToolCall)]

    # --- internals -------------------------------------------------------------------------

    def _decode_new(self) -> None:
        before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def _match_stop(self) -> bool:
        longest = max(len(s) for s in self.stops)
        start = max(0, self._searched - longest + 1)
        hits = [(p, s) for s in self.stops if (p := self.text.find(s, start)) >= 0]
        self._searched = len(self.text)
        if not hits:
            return False
        pos, stop = min(hits)
        keep = self.no_stop_trim or stop in self.kept_stops
        cut = pos + len(stop) if keep else pos
        self.matched_stop = stop
        if keep:  # the fewest tokens that cover the whole stop string
            self.keep = next(i + 1 for i, e in enumerate(self.ends) if e >= cut)
        else:  # every token that ends before the stop string starts
            self.keep = bisect_right(self.ends, cut)
        return True

    def _emit(self, final: bool) -> None:
        if self.stopped:
            limit = len(self.final_text)
        elif final or not self.stops:
            limit = len(self.text)
        else:  # hold back what could still grow into a stop string, up to a token boundary
            n = bisect_right(self.ends, len(self.text) - max(len(s) for s in self.stops) + 1)
            limit = self.ends[n - 1] if n else 0
        if limit > self._emitted:
            piece, self._emitted = self.text[self._emitted:limit], limit
            self._publish(self.splitter.feed(piece))

    def _publish(self, events: list[Event]) -> None:
        if events:
            self.events += events
            if self.listener is not None:
                self.listener(events)
