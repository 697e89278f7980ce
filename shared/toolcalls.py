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
  string of an object) ``arguments`` is a tool call. Its ``arguments`` are the object's JSON text
  as the model wrote it when it follows the name (``{"name": ..., "arguments": {...}}``, the form
  the chat template renders, so a call sent back re-renders as written); otherwise (a string of
  JSON, arguments before the name) ``json.dumps`` of the object;
* a call is streamed as the model writes it, as SGLang's streaming parser does: ``CallStart``
  (id, name) once ``{"name": "X", "arguments": `` is written, then ``ArgsDelta`` pieces of the
  arguments object's text as far as it is a valid JSON prefix (never the outer ``}`` or the
  closing tag, nor a tail that could be the start of ``</tool_call>``), then ``ToolCall`` when the
  block closes and parses. The deltas of a call concatenated are exactly its ``arguments``, also
  for a call that is only recognised when it closes (one delta then);
* anything else -- a block with bad JSON, an unterminated block at the end, text between or
  after blocks that is not whitespace -- is content, verbatim: a malformed call stays visible to
  the agent instead of vanishing, and is counted as ``malformed`` (the well-formed share is a
  training metric of the tool agent). A call already started that turns out malformed ends with
  ``CallDropped`` before its text: it never becomes a ``ToolCall``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "qwen25", "qwen3")
_WS = r"[ \t\n\r]*"  # JSON's whitespace
# The start of a Hermes call up to its arguments value: '{"name": "X", "arguments":'.
_HEADER = re.compile(rf'{_WS}\{{{_WS}"name"{_WS}:{_WS}("(?:[^"\\\x00-\x1f]|\\.)*"){_WS},{_WS}"(?:arguments|parameters)"{_WS}:')
_SPACE = re.compile(_WS)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_JSON = json.JSONDecoder(parse_constant=_no_constant)  # RFC 8259: NaN / Infinity are not arguments


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


@dataclass(frozen=True)
class CallStart:
    """A call is being written: its id and name are known, its arguments follow."""

    id: str
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    """The next piece of the started call's arguments text."""

    id: str
    text: str


@dataclass(frozen=True)
class CallDropped:
    """The started call turned out malformed: it ends here, and its block follows as text."""

    id: str


Event = TextPiece | CallStart | ArgsDelta | ToolCall | CallDropped


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _header(text: str, at: int) -> tuple[str, int] | None:
    """(name, where the header ends) once ``text[at:]`` starts with a whole call header."""
    m = _HEADER.match(text, at)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return None
    return (name, m.end()) if name else None


def _value_start(text: str, at: int) -> int | None:
    """Where the value after ``at`` starts (JSON whitespace skipped), None while it has not."""
    start = _SPACE.match(text, at)
    return start.end() if start is not None and start.end() < len(text) else None


def parse_block(body: str) -> tuple[str, str] | None:
    """(name, arguments) of one block's body, or None when it is not a well-formed call.
    When the body starts with a call header whose value is an object, ``arguments`` is that text."""
    try:
        data = _JSON.decode(body.strip())
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    header = _header(body, 0)
    at = _value_start(body, header[1]) if header is not None else None
    if header is not None and at is not None and body[at] == "{":
        value, end = _JSON.raw_decode(body, at)
        # The text streamed is the call's (a name or arguments written twice would mean another).
        return (data["name"], body[at:end]) if (header[0], value) == (data["name"], args) else None
    if isinstance(args, str):
        try:
            args = _JSON.decode(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return data["name"], json.dumps(args, ensure_ascii=False)


class JsonPrefix:
    """How much of a text is a valid prefix of one JSON value (RFC 8259), read incrementally:
    ``pos`` characters are; ``done`` once the value is complete; ``failed`` at the first character
    that cannot continue it. What a streamed call's arguments are sent up to."""

    _NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
    _NUMBER_START = re.compile(r"-|-?(?:0|[1-9]\d*)(?:\.\d*)?|-?(?:0|[1-9]\d*)(?:\.\d+)?[eE][+-]?\d*")
    _LITERALS = {"t": "rue", "f": "alse", "n": "ull"}

    def __init__(self) -> None:
        self.pos = 0
        self.done = self.failed = False
        self._closers: list[str] = []  # "}" / "]" of the containers open
        self._state = "value"  # value, value_or_close, key, key_or_close, colon, after, string, escape, unicode,
        #                        number, literal
        self._key = False  # the string being read is an object key
        self._token = ""  # the number so far, the rest of a literal, or a \u escape's digits

    def feed(self, text: str, start: int) -> int:
        """Read ``text[start + pos:]`` (``text[start:]`` is the value so far); returns ``pos``."""
        i = start + self.pos
        while i < len(text) and not (self.done or self.failed):
            if self._step(text[i]):
                self.pos, i = self.pos + 1, i + 1
            elif not self.done:
                self.failed = True
        return self.pos

    def _step(self, c: str) -> bool:
        s = self._state
        if s == "string":
            if c == '"':
                self._state = "colon" if self._key else self._after()
            elif c == "\\":
                self._state = "escape"
            return c >= " "
        if s == "escape":
            self._state, self._token = ("unicode", "") if c == "u" else ("string", "")
            return c in '"\\/bfnrtu'
        if s == "unicode":
            self._token += c
            self._state = "string" if len(self._token) == 4 else s
            return c in "0123456789abcdefABCDEF"
        if s == "number":
            if c in "0123456789+-.eE":
                self._token += c
                return self._NUMBER_START.fullmatch(self._token) is not None
            if self._NUMBER.fullmatch(self._token) is None:
                return False
            self._state = self._after()
            return not self.done and self._step(c)  # the character after a number is the container's
        if s == "literal":
            ok, self._token = self._token[:1] == c, self._token[1:]
            if ok and not self._token:
                self._state = self._after()
            return ok
        if c in " \t\n\r":
            return True
        if s == "value_or_close" and c == "]" or s == "key_or_close" and c == "}" or s == "after" and c in "]}":
            return self._close(c)
        if s in ("value", "value_or_close"):
            return self._value(c)
        if s in ("key", "key_or_close"):
            self._state, self._key = "string", True
            return c == '"'
        if s == "colon":
            self._state = "value"
            return c == ":"
        self._state = "key" if self._closers[-1] == "}" else "value"  # after a value in a container
        return c == ","

    def _value(self, c: str) -> bool:
        if c in "{[":
            self._closers.append("}" if c == "{" else "]")
            self._state = "key_or_close" if c == "{" else "value_or_close"
        elif c == '"':
            self._state, self._key = "string", False
        elif c == "-" or "0" <= c <= "9":
            self._state, self._token = "number", c
        elif c in self._LITERALS:
            self._state, self._token = "literal", self._LITERALS[c]
        else:
            return False
        return True

    def _close(self, c: str) -> bool:
        if not self._closers or self._closers.pop() != c:
            return False
        self._state = self._after()
        return True

    def _after(self) -> str:
        self.done = not self._closers
        return "after"


@dataclass
class HermesSplitter:
    """Incremental splitter: ``feed`` text deltas, ``finish`` at the end; events in text order."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    well_formed: int = 0  # blocks parsed into tool calls
    malformed: int = 0  # blocks that were not (bad JSON, unterminated)
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""  # text not emitted yet; while a block is open, from its start tag on
    _gap: bool = False  # right after a block: whitespace is formatting unless text follows before the next
    _call: CallStart | None = None  # the open block's call, once its header is written
    _head_end: int = 0  # where that header ends in ``_buf``
    _args: JsonPrefix | None = None  # its arguments object, once it has started with "{"
    _at: int = 0  # where the arguments start in ``_buf``
    _sent: int = 0  # characters of them streamed

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            i = self._buf.find(self.start)
            if i < 0:  # no block open: emit everything except a tail that could be the start of one
                n = len(self._buf) - _partial_suffix(self._buf, self.start)
                if self._gap and not self._buf[:n].strip():
                    return out  # held: dropped if a block or the end comes next, content if text does
                out += self._text(self._buf[:n])
                self._buf = self._buf[n:]
                return out
            out += self._text(self._buf[:i])
            self._buf = self._buf[i:]
            j = self._buf.find(self.end, len(self.start))
            if j < 0:  # a block has started but not ended: stream what is known of its call
                return out + self._stream()
            out += self._block(self._buf[len(self.start):j], self._buf[:j + len(self.end)])
            self._buf = self._buf[j + len(self.end):]
            self._gap = True

    def finish(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        out: list[Event] = []
        if rest.startswith(self.start):  # unterminated
            self.malformed += 1
            out += [CallDropped(self._call.id)] if self._call is not None else []
        self._reset()
        return out + self._text(rest)

    def _stream(self) -> list[Event]:
        out: list[Event] = []
        if self._call is None:
            header = _header(self._buf, len(self.start))
            if header is None:
                return out
            self._call, self._head_end = CallStart(_call_id(), header[0]), header[1]
            out.append(self._call)
        if self._args is None:
            at = _value_start(self._buf, self._head_end)
            if at is None or self._buf[at] != "{":
                return out  # not started, or not an object: the arguments come whole with the call
            self._args, self._at = JsonPrefix(), at
        valid = self._at + self._args.feed(self._buf, self._at)
        if valid == len(self._buf):  # inside a string, "</tool_c" could be the block's end
            valid -= _partial_suffix(self._buf, self.end)
        if valid > self._at + self._sent:
            out.append(ArgsDelta(self._call.id, self._buf[self._at + self._sent:valid]))
            self._sent = valid - self._at
        return out

    def _block(self, body: str, raw: str) -> list[Event]:
        call, sent = self._call, self._sent
        self._reset()
        found = parse_block(body)
        if found is None:
            self.malformed += 1
            return [*([CallDropped(call.id)] if call is not None else []), TextPiece(raw)]
        name, arguments = found
        out: list[Event] = []
        if call is None:  # the block was read whole: its call starts and ends here
            call = CallStart(_call_id(), name)
            out.append(call)
        if len(arguments) > sent:
            out.append(ArgsDelta(call.id, arguments[sent:]))
        done = ToolCall(call.id, name, arguments)
        self.well_formed += 1
        self.calls.append(done)
        return [*out, done]

    def _reset(self) -> None:
        self._call, self._args, self._head_end, self._at, self._sent = None, None, 0, 0, 0

    def _text(self, text: str) -> list[Event]:
        if not text or (self._gap and not text.strip()):
            return []  # whitespace between and after blocks is formatting, not content
        self._gap = False
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
