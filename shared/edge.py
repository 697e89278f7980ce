"""What every HTTP edge of the project applies to untrusted input: credentials, JSON, log text.

Invariants:
* a bearer token is compared in constant time (``hmac.compare_digest``) and never logged;
* ``session_token(key, sid)`` is the only credential an agent holds: an HMAC of its session id
  under the agent key, so it names exactly one session and is checked statelessly by any proxy
  replica that knows the key; it cannot be turned back into the key;
* ``loads_json`` parses a request body or raises ``BadJson`` with a reason (invalid UTF-8, not
  JSON, nested deeper than ``MAX_JSON_DEPTH``, a lone UTF-16 surrogate) -- never a
  ``RecursionError`` or a later ``UnicodeEncodeError`` that would surface as a 500;
* ``within(path, roots)`` resolves ``path`` (symlinks followed, ``..`` collapsed) and returns it only
  if it lies inside one of ``roots`` (resolved the same way): a caller-named path never escapes;
* ``printable(text)`` is safe to put in one log line: control characters (newlines included) are
  escaped, so a request path or id cannot forge a second log line, and it is bounded in length.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64
SESSION_TOKEN_PREFIX = "dss1-"
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class BadJson(ValueError):
    """A request body that is not acceptable JSON; the message is the reason (no body content)."""


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header in ASGI ``headers``, else of an
    ``x-api-key`` header (how the Anthropic SDK sends its key), else None."""
    api_key: bytes | None = None
    for k, v in headers:
        if k == b"authorization":
            scheme, _, token = v.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
        if k == b"x-api-key" and v.strip():
            api_key = v.strip()
    return api_key


def same_secret(given: bytes | None, expected: str | None) -> bool:
    return given is not None and expected is not None and hmac.compare_digest(given, expected.encode())


def session_token(agent_key: str, session_id: str) -> str:
    """The per-session credential handed to a black-box agent: valid for ``/s/{session_id}/v1/*`` only."""
    mac = hmac.new(agent_key.encode(), b"dressage-session\x00" + session_id.encode(), hashlib.sha256)
    return SESSION_TOKEN_PREFIX + mac.hexdigest()


_STRING = re.compile(rb'"[^"\\\\]*(?:\\\\.[^"\\\\]*)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _depth_ok(raw: bytes) -> bool:
    """Bracket depth (brackets inside strings ignored) stays within the limit; string removal and
    bracket extraction run in C, the Python loop sees brackets only."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return True
    depth = 0
    for c in _STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS):
        depth += 1 if c in (0x5B, 0x7B) else -1
        if depth > MAX_JSON_DEPTH:
            return False
    return True


def _surrogates_paired(raw: bytes) -> bool:
    """Every ``\\uD800-\\uDBFF`` escape is immediately followed by a ``\\uDC00-\\uDFFF`` one, and vice versa."""
    expect_low_at = -1
    for m in _SURROGATE.finditer(raw):
        i = m.start() - 1
        while i >= 0 and raw[i] == 0x5C:
            i -= 1
        if (m.start() - 1 - i) % 2:  # an escaped backslash followed by the text "ud800": not an escape
            continue
        high = m.group()[3:4].lower() in (b"8", b"9", b"a", b"b")
        if expect_low_at >= 0:
            if high or m.start() != expect_low_at:
                return False
            expect_low_at = -1
        elif high:
            expect_low_at = m.end()
        else:
            return False
    return expect_low_at < 0


def loads_json(raw: bytes) -> Any:
    """Parse an untrusted JSON body; ``BadJson`` with a reason for anything a handler cannot use."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadJson("not valid UTF-8") from None
    if not _depth_ok(raw):
        raise BadJson(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if b"\\u" in raw and not _surrogates_paired(raw):
        raise BadJson("contains a lone UTF-16 surrogate (\\ud800-\\udfff) that is not valid Unicode")
    try:
        return json.loads(text)
    except RecursionError:
        raise BadJson(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise BadJson(f"not valid JSON ({type(exc).__name__} at position {getattr(exc, 'pos', '?')})") from None


def printable(text: object, limit: int = 300) -> str:
    """``text`` for one log line: control characters escaped (``\\n`` -> ``\\x0a``), at most ``limit`` chars."""
    s = str(text)
    if len(s) > limit:
        s = s[:limit] + "..."
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", s)


def within(path: str, roots: Iterable[str | Path]) -> Path | None:
    """``path`` resolved, if it is one of ``roots`` or inside one (all resolved); else None."""
    full = Path(path).resolve()
    for root in roots:
        base = Path(root).resolve()
        if full == base or base in full.parents:
            return full
    return None
