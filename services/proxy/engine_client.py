"""HTTP client for SGLang-compatible engines: sticky routing, generate, abort by rid, weight loads.

Contract:
* ``route(session_id)`` ranks the engines by rendezvous hashing, so a session always lands on
  the same engine while it is up (its KV/prefix cache stays warm) and only the sessions of a
  removed engine move. A ``generate`` whose engine refuses the *connection* is tried on the next
  one (the request was never sent, so no engine runs it twice); every engine refusing gives
  ``UpstreamUnavailable`` after at most ``connect_timeout_s`` per engine, never a hang.
* ``parse_generate`` (pure) turns a ``/generate`` body into a ``Chunk``: output ids, logprobs
  and one version per output token (``meta_info.output_token_versions``, else the response's
  ``weight_version`` for every token), and whether the engine reports the request aborted.
* Aborts go to the engine the rid was sent to (the caller keeps that URL).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from services.proxy.errors import UpstreamError, UpstreamUnavailable
from shared.http_transport import ConnectFailed, RawHttp, RequestFailed, Transport

log = logging.getLogger(__name__)

ABORT_REASONS = frozenset({"abort", "aborted", "preempt", "preempted", "cancel", "cancelled", "canceled"})


@dataclass
class Chunk:
    """One engine response: the tokens one rid produced before it stopped or was aborted."""

    output_ids: list[int]
    logprobs: list[float]  # one per output id
    versions: list[str]  # weight version per output id (raw labels; normalised by the recorder)
    finish_type: str  # "stop" | "length" | "abort" | ...
    weight_version: str | None  # the response's version (last token's), None if absent
    aborted: bool  # the engine says the request was aborted (partial output)
    meta: dict[str, Any] = field(default_factory=dict)  # prompt_tokens, completion_tokens, ...
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per output id ([] if not asked)

    def tail(self, n: int) -> Chunk:
        """The same response without its first ``n`` tokens (a stream event's new part)."""
        return Chunk(self.output_ids[n:], self.logprobs[n:], self.versions[n:], self.finish_type,
                     self.weight_version, self.aborted, self.meta, self.top_logprobs[n:])


def _top_entries(meta: dict[str, Any], n: int) -> list[list[tuple[int, float]]]:
    """SGLang's ``output_top_logprobs`` (per token: ``[[logprob, token_id, text], ...]``)."""
    raw = meta.get("output_top_logprobs")
    if not isinstance(raw, list) or len(raw) != n:
        return []
    try:
        return [[(int(e[1]), float(e[0])) for e in (pos or [])] for pos in raw]
    except (TypeError, ValueError, IndexError) as exc:
        raise UpstreamError(f"engine response output_top_logprobs malformed: {exc}") from None


def _finish_type(meta: dict[str, Any], body: dict[str, Any]) -> str:
    fr = meta.get("finish_reason", body.get("finish_reason"))
    if isinstance(fr, dict):
        fr = fr.get("type")
    return str(fr).strip().lower() if fr is not None else "stop"


def parse_generate(body: Any) -> Chunk:
    """Parse an SGLang ``/generate`` response; raises UpstreamError naming the bad field."""
    if not isinstance(body, dict):
        raise UpstreamError("engine response is not a JSON object")
    meta = body.get("meta_info") or {}
    if not isinstance(meta, dict):
        raise UpstreamError("engine response meta_info is not an object")
    lp_entries = meta.get("output_token_logprobs") or []
    ids = body.get("output_ids")
    if ids is None:  # some SGLang versions only report ids inside the logprob entries
        ids = [e[1] if isinstance(e, list | tuple) else e.get("token_id") for e in lp_entries]
    try:
        output_ids = [int(t) for t in ids]
        try:  # SGLang's [logprob, token_id, text] triples: the hot path, no per-entry type checks
            logprobs = [float(e[0]) for e in lp_entries]
        except (TypeError, KeyError):  # dict entries ({"logprob": ...}) from other servers
            logprobs = [float(e.get("logprob", 0.0) or 0.0) for e in lp_entries]
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise UpstreamError(f"engine response output_ids/output_token_logprobs malformed: {exc}") from None
    if len(logprobs) != len(output_ids):
        # Without a logprob per token the sample cannot be trained on; say so instead of guessing.
        raise UpstreamError(f"engine returned {len(output_ids)} output ids but {len(logprobs)} logprobs")
    wv = meta.get("weight_version", meta.get("version"))
    weight_version = None if wv is None else str(wv)
    per_token = meta.get("output_token_versions")
    if isinstance(per_token, list) and len(per_token) == len(output_ids):
        versions = [str(v) for v in per_token]
    else:
        if per_token is not None:
            log.warning("engine output_token_versions length %s != %d tokens; using weight_version=%s",
                        len(per_token) if isinstance(per_token, list) else "?", len(output_ids), weight_version)
        versions = [weight_version or "unknown"] * len(output_ids)
    finish = _finish_type(meta, body)
    chunk_meta = {k: meta[k] for k in ("prompt_tokens", "completion_tokens", "id") if k in meta}
    return Chunk(output_ids, logprobs, versions, finish, weight_version, finish in ABORT_REASONS, chunk_meta,
                 _top_entries(meta, len(output_ids)))


def sse_events(buffer: bytearray, piece: bytes) -> list[bytes]:
    """Append ``piece`` to ``buffer``; return the ``data:`` payloads of the events it completed."""
    buffer += piece.replace(b"\r\n", b"\n")
    out: list[bytes] = []
    while (end := buffer.find(b"\n\n")) >= 0:
        event, buffer[:] = bytes(buffer[:end]), buffer[end + 2:]
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    return out


def stream_delta(chunk: Chunk, seen: list[int]) -> Chunk:
    """The new tokens of one streamed ``/generate`` event, given the ids ``seen`` so far.

    SGLang streams cumulative ``output_ids`` by default and disjoint pieces with
    ``--incremental-streaming-output``; ``completion_tokens`` (the running total) tells which."""
    total = chunk.meta.get("completion_tokens")
    n = len(chunk.output_ids)
    cumulative = n == total if isinstance(total, int) and seen else chunk.output_ids[:len(seen)] == seen
    return chunk.tail(len(seen)) if cumulative and n >= len(seen) else chunk


def redact(url: str) -> str:
    """``url`` without user:password, for messages and logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def rank_engines(engines: list[str], key: str) -> list[str]:
    """Rendezvous (highest-random-weight) order of ``engines`` for ``key``: stable per key."""
    def score(url: str) -> bytes:
        return hashlib.blake2b(f"{url}\x00{key}".encode(), digest_size=8).digest()
    return sorted(engines, key=score, reverse=True)


class EngineClient:
    """Async HTTP to a fixed list of engines over one ``Transport`` (keep-alive pools)."""

    def __init__(self, engines: list[str], connect_timeout_s: float = 2.0, request_timeout_s: float = 600.0,
                 control_timeout_s: float = 120.0, abort_timeout_s: float = 5.0,
                 transport: Transport | None = None, engine_api_key: str | None = None) -> None:
        self.engines = [e.rstrip("/") for e in engines]
        # Clients see ``engine-<i>`` (its index in proxy.engines), never an engine URL: URLs are internal topology.
        self._names = {e: f"engine-{i}" for i, e in enumerate(self.engines)}
        self._no_stream: set[str] = set()  # engines that refused ``stream: true`` (served whole instead)
        self._request_timeout = request_timeout_s
        self._control_timeout, self._abort_timeout = control_timeout_s, abort_timeout_s
        # Tests pass an HttpxTransport routed to in-process ASGI fakes.
        self._http: Transport = transport or RawHttp(connect_timeout=connect_timeout_s, bearer=engine_api_key)

    async def close(self) -> None:
        await self._http.close()

    def _name(self, url: str) -> str:
        return self._names.get(url) or "engine-?"

    def route(self, session_id: str) -> list[str]:
        return rank_engines(self.engines, session_id) if len(self.engines) > 1 else list(self.engines)

    async def _call(self, method: str, url: str, path: str, body: Any | None, timeout: float) -> tuple[int, Any]:
        """``(status, parsed JSON or text)``; transport failures become UpstreamUnavailable."""
        try:
            status, raw = await self._http.request(method, f"{url}{path}", body, timeout)
        except ConnectFailed as exc:
            raise UpstreamUnavailable(f"engine {self._name(url)} unreachable ({exc})", connected=False) from None
        except RequestFailed as exc:
            raise UpstreamUnavailable(f"engine {self._name(url)} {path} failed ({exc})", connected=True) from None
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode("utf-8", "replace")

    async def generate(self, url: str, body: dict[str, Any],
                       on_delta: Callable[[Chunk], None] | None = None) -> Chunk:
        """POST ``{url}/generate``; ``connected=False`` on the error means nothing was sent.

        With ``body["stream"]`` the engine's SSE events are read as they come: ``on_delta`` gets
        each event's new tokens, and the returned chunk holds them all (the last event's finish)."""
        if body.get("stream"):
            if url not in self._no_stream:
                try:
                    return await self._generate_stream(url, body, on_delta or (lambda c: None))
                except UpstreamError as exc:
                    if exc.extra.get("engine_status") not in (400, 422) or "stream" not in exc.extra["engine_detail"]:
                        raise
                    # An engine without SGLang's streaming: nothing ran; ask it whole from now on.
                    log.warning("engine %s does not stream /generate; using whole responses", self._name(url))
                    self._no_stream.add(url)
            body = {k: v for k, v in body.items() if k != "stream"}
            chunk = await self.generate(url, body)
            if on_delta is not None:
                on_delta(chunk)
            return chunk
        status, data = await self._call("POST", url, "/generate", body, self._request_timeout)
        if status >= 400:
            raise UpstreamError(f"engine {self._name(url)} answered {status}", engine_status=status,
                                engine_detail=_short(str(data)))
        if not isinstance(data, dict):
            raise UpstreamError(f"engine {self._name(url)} returned non-JSON")
        return parse_generate(data)

    async def generate_batch(self, url: str, body: dict[str, Any], size: int) -> list[Chunk]:
        """POST a batched ``{url}/generate`` (SGLang's list of prompts, one ``rid`` each); the engine
        answers a JSON list, one response per prompt in order. Errors as ``generate``."""
        status, data = await self._call("POST", url, "/generate", body, self._request_timeout)
        if status >= 400:
            raise UpstreamError(f"engine {self._name(url)} answered {status}", engine_status=status,
                                engine_detail=_short(str(data)))
        if not isinstance(data, list) or len(data) != size:
            raise UpstreamError(f"engine {self._name(url)} answered a batch of {size} with no list of {size}")
        return [parse_generate(item) for item in data]

    async def _generate_stream(self, url: str, body: dict[str, Any], on_delta: Callable[[Chunk], None]) -> Chunk:
        buffer, error = bytearray(), bytearray()
        total: Chunk | None = None
        error_status = 0
        try:
            async for status, piece in self._http.stream("POST", f"{url}/generate", body, self._request_timeout):
                if status >= 400:
                    error_status, error = status, error + piece[:4096]
                    continue
                for data in sse_events(buffer, piece):
                    if data == b"[DONE]":
                        continue
                    try:
                        event = parse_generate(json.loads(data))
                    except ValueError:
                        raise UpstreamError(f"engine {self._name(url)} streamed a non-JSON event") from None
                    delta = stream_delta(event, total.output_ids if total else [])
                    total = delta if total is None else Chunk(
                        total.output_ids + delta.output_ids, total.logprobs + delta.logprobs,
                        total.versions + delta.versions, delta.finish_type, delta.weight_version or total.weight_version,
                        delta.aborted, delta.meta, total.top_logprobs + delta.top_logprobs)
                    on_delta(delta)
        except ConnectFailed as exc:
            raise UpstreamUnavailable(f"engine {self._name(url)} unreachable ({exc})", connected=False) from None
        except RequestFailed as exc:
            raise UpstreamUnavailable(f"engine {self._name(url)} /generate failed ({exc})", connected=True) from None
        if error:
            raise UpstreamError(f"engine {self._name(url)} answered {error_status}", engine_status=error_status,
                                engine_detail=_short(error.decode("utf-8", "replace")))
        if total is None:  # an engine that ignored ``stream`` and answered one JSON body
            try:
                total = parse_generate(json.loads(bytes(buffer)))
            except ValueError:
                raise UpstreamError(f"engine {self._name(url)} streamed no event") from None
            on_delta(total)
        return total

    async def abort(self, url: str, rid: str) -> bool:
        """Ask ``url`` to abort ``rid``; True on a 2xx (the rid may already have finished)."""
        try:
            status, _ = await self._call("POST", url, "/abort_request", {"rid": rid}, self._abort_timeout)
        except UpstreamUnavailable as exc:
            log.warning("abort failed rid=%s: %s", rid, exc.message)
            return False
        return status < 300

    async def update_weights(self, url: str, model_path: str, version: str) -> dict[str, Any]:
        """``POST /update_weights_from_disk``; raises UpstreamError/UpstreamUnavailable on failure."""
        body = {"model_path": model_path, "weight_version": version}
        status, data = await self._call("POST", url, "/update_weights_from_disk", body, self._control_timeout)
        if status >= 300 or (isinstance(data, dict) and data.get("success") is False):
            raise UpstreamError(f"engine {self._name(url)} refused weights version={version}", engine_status=status,
                                engine_detail=_short(str(data)))
        return data if isinstance(data, dict) else {"response": data}

    async def load(self, url: str, timeout: float) -> Any | None:
        """The engine's ``/get_load`` body (SGLang: one object per dp rank); None when it does not answer."""
        try:
            status, data = await self._call("GET", url, "/get_load", None, timeout)
        except UpstreamUnavailable:
            return None
        return data if status < 300 else None

    async def healthy(self, url: str, timeout: float) -> bool:
        """``GET /health`` answered 200."""
        try:
            status, _ = await self._call("GET", url, "/health", None, timeout)
        except UpstreamUnavailable:
            return False
        return status == 200

    async def weight_version(self, url: str, timeout: float | None = None) -> str | None:
        """The engine's loaded version (``/get_weight_version``, else ``/model_info``); None if unknown."""
        for path in ("/get_weight_version", "/model_info"):
            try:
                status, data = await self._call("GET", url, path, None, timeout or self._control_timeout)
            except UpstreamUnavailable:
                return None
            if status < 300 and isinstance(data, dict) and data.get("weight_version") is not None:
                return str(data["weight_version"])
        return None


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
