"""Tool-call parsing: the model's raw text -> visible content + OpenAI ``tool_calls`` (pure, no I/O).

Shared by the proxy (responses to agents) and tasks (scoring replies). The parser is chosen per
model in config (``proxy.tool_call_parser``), the way SGLang's
``--tool-call-parser`` is; ``hermes`` (alias ``qwen25``, ``qwen3``) reads the Hermes/Qwen format::

    some text<tool_call>
    {"name": "lookup", "arguments": {"key": "qzt"}}
    </tool_call>

Rules (one implementation for whole texts and for streams, so both agree token for token):
* text before the first ``<tool_call>`` is content (streamed as it arrives, except a tail that
  could still become ``<tool_call>``);
* a complete block whose body is a JSON object with a string ``name`` and an object (or JSON
  string of an object) ``arguments`` is a tool call; its ``arguments`` are returned as compact
  JSON text, as OpenAI does;
* anything else -- a block with bad JSON, an unterminated block at the end, text between or
  after blocks that is not whitespace -- is content, verbatim: a malformed call stays visible to
  the agent instead of vanishing, and is counted as ``malformed`` (the well-formed share is a
  training metric of the tool agent).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "qwen25", "qwen3")


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_<hex>", unique per call
    name: str
    arguments: str  # JSON text of an object

    def hermes(self) -> str:
        """The call as the model writes it (what a chat template renders for it)."""
        return f'<tool_call>\n{{"name": {json.dumps(self.name)}, "arguments": {self.arguments}}}\n</tool_call>'

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class TextPiece:
    text: str


Event = TextPiece | ToolCall


def parse_call(body: str) -> ToolCall | None:
    """One block's body as a tool call, or None when it is not a well-formed one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class HermesSplitter:
    """Incremental splitter: ``feed`` text deltas, ``finish`` at the end; events in text order."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    well_formed: int = 0  # blocks parsed into tool calls
    malformed: int = 0  # blocks that were not (bad JSON, unterminated)
    _buf: str = ""
    _in_calls: bool = False  # a <tool_call> was seen: content after it is only what cannot parse
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            i = self._buf.find(self.start)
            if i < 0:
                break
            j = self._buf.find(self.end, i + len(self.start))
            if j < 0:  # a block has started but not ended: emit what precedes it, hold the rest
                out += self._text(self._buf[:i])
                self._buf = self._buf[i:]
                return out
            out += self._text(self._buf[:i])
            out.append(self._block(self._buf[i + len(self.start):j], self._buf[i:j + len(self.end)]))
            self._buf = self._buf[j + len(self.end):]
            self._in_calls = True
        # No block open: emit everything except a tail that could be the start of one.
        keep = _partial_suffix(self._buf, self.start)
        out += self._text(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return out

    def finish(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        if rest.startswith(self.start):
            self.malformed += 1
        return self._text(rest, final=True)

    def _block(self, body: str, raw: str) -> Event:
        call = parse_call(body.strip())
        if call is None:
            self.malformed += 1
            return TextPiece(raw)
        self.well_formed += 1
        self.calls.append(call)
        return call

    def _text(self, text: str, final: bool = False) -> list[Event]:
        if not text or (self._in_calls and not text.strip()):
            return []  # whitespace around blocks is formatting, not content
        return [TextPiece(text)]


class PlainSplitter:
    """No parser configured (or ``tool_choice: "none"``): everything is content."""

    well_formed = 0
    malformed = 0
    calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        return [TextPiece(text)] if text else []

    def finish(self) -> list[Event]:
        return []


Splitter = HermesSplitter | PlainSplitter


def make_splitter(parser: str | None) -> Splitter:
    if parser is None:
        return PlainSplitter()
    if parser in PARSERS:
        return HermesSplitter()
    raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")


def call_end(parser: str) -> str:
    """The text that closes one tool call in ``parser``'s format (where a single call ends)."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")
    return HermesSplitter.end


def forced_prefix(parser: str, name: str | None) -> str:
    """The start of a tool call the proxy writes for the model when the client forces one
    (``tool_choice`` ``required`` / a named function): ``<tool_call>\n{"name": "`` and, for a named
    function, its name and ``"arguments": `` too. The model writes the rest; the prefix is context,
    never sampled, so the trainer never learns from it."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")
    head = '<tool_call>\n{"name": '
    return head + (f'{json.dumps(name)}, "arguments": ' if name is not None else '"')


def split(text: str, parser: str | None) -> tuple[str, list[ToolCall]]:
    """A whole text -> (content, tool calls): the non-streamed path of the same rules."""
    sp = make_splitter(parser)
    events = [*sp.feed(text), *sp.finish()]
    return "".join(e.text for e in events if isinstance(e, TextPiece)), [e for e in events if isinstance(e, ToolCall)]


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def tool_call_metrics(sample_metas: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Training metrics of tool use from the proxy's per-sample counts (``meta.tool_calls`` and
    ``meta.malformed_tool_calls``): the share of well-formed calls, calls per sample, and the share
    of samples with at least one well-formed call (how often the policy uses its tools); {} when no
    sample made a call (tasks without tools report nothing)."""
    ok = bad = n = using = 0
    for meta in sample_metas:
        n += 1
        calls = int(meta.get("tool_calls", 0) or 0)
        ok, using = ok + calls, using + (calls > 0)
        bad += int(meta.get("malformed_tool_calls", 0) or 0)
    if ok + bad == 0:
        return {}
    return {"tool_calls/well_formed_frac": ok / (ok + bad), "tool_calls/per_sample": (ok + bad) / max(n, 1),
            "tool_calls/sample_frac": using / max(n, 1)}
