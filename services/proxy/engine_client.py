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
* Each engine is asked once what it is (``/server_info``, else ``/get_server_info``) and then
  spoken to in its dialect (``sglang_compat``: this project's engine, or SGLang 0.5.9 - 0.5.23):
  the load, weight-version and health routes, a weight load that cannot trip SGLang's flush
  assert, and no ``/generate`` field the engine does not know. ``forget(url)`` asks again (an
  engine that went down may come back as another release). With ``live_updates`` an engine that
  cannot load under running requests (SGLang) is refused: never used, its health check fails.
* A streamed error (SGLang: ``data: {"error": ...}`` in a 200) raises the error the same answer
  raises unstreamed (``UpstreamStreamError``: same status and body), never an empty "stop" chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from services.proxy.errors import UpstreamError, UpstreamStreamError, UpstreamUnavailable
from shared.http_transport import ConnectFailed, RawHttp, RequestFailed, Transport
from shared.retry import Backoff, retry_until
from shared.sglang_compat import (
    FLUSH_ROUTE,
    INFO_ROUTES,
    Dialect,
    RouteKind,
    dialect_for,
    live_refusal,
    loads_of,
    sendable,
    stream_error,
    weight_version_of,
)

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
                 transport: Transport | None = None, engine_api_key: str | None = None,
                 health_timeout_s: float = 5.0, live_updates: bool = False) -> None:
        self.engines = [e.rstrip("/") for e in engines]
        # Clients see ``engine-<i>`` (its index in proxy.engines), never an engine URL: URLs are internal topology.
        self._names = {e: f"engine-{i}" for i, e in enumerate(self.engines)}
        self._no_stream: set[str] = set()  # engines that refused ``stream: true`` (served whole instead)
        self._request_timeout = request_timeout_s
        self._control_timeout, self._abort_timeout = control_timeout_s, abort_timeout_s
        self._health_timeout = health_timeout_s  # SGLang's /health runs a generation: >= 1 s
        self._live = live_updates  # proxy.weight_updates: live (engines that cannot are refused)
        self._dialects: dict[str, Dialect] = {}  # by engine URL, once identified
        # Tests pass an HttpxTransport routed to in-process ASGI fakes.
        self._http: Transport = transport or RawHttp(connect_timeout=connect_timeout_s, bearer=engine_api_key)

    async def close(self) -> None:
        await self._http.close()

    def _name(self, url: str) -> str:
        return self._names.get(url) or "engine-?"

    def route(self, session_id: str) -> list[str]:
        return rank_engines(self.engines, session_id) if len(self.engines) > 1 else list(self.engines)

    async def dialect(self, url: str) -> Dialect:
        """How ``url`` speaks, asked once. UpstreamUnavailable (``connected=False``: nothing was sent
        to generate) when it cannot be asked now, or cannot serve this proxy (``live_updates``)."""
        d = self._dialects.get(url)
        if d is None:
            d = self._dialects[url] = await self._identify(url)
        if self._live and (why := live_refusal(d)):
            raise UpstreamUnavailable(f"engine {self._name(url)} not used: {why}", connected=False)
        return d

    async def _identify(self, url: str) -> Dialect:
        info: Any = None
        for path in INFO_ROUTES:
            try:
                status, data = await self._call("GET", url, path, None, self._health_timeout)
            except UpstreamUnavailable as exc:
                raise UpstreamUnavailable(f"engine {self._name(url)} not identified ({exc.message})",
                                          connected=False) from None
            if status == 404:
                continue
            if status >= 300 or not isinstance(data, dict):
                raise UpstreamUnavailable(f"engine {self._name(url)} answered {status} to {path}", connected=False)
            info = data
            break
        d = dialect_for(info)
        if d.note:
            log.warning("engine %s speaks %s: %s", self._name(url), d.name, d.note)
        else:
            log.info("engine %s speaks %s", self._name(url), d.name)
        if self._live and (why := live_refusal(d)):
            log.error("engine %s is not used: %s", self._name(url), why)
        return d

    def forget(self, url: str) -> None:
        """Identify ``url`` again before its next use (it went down: it may come back as another release)."""
        self._dialects.pop(url, None)

    async def identify_all(self) -> dict[str, Dialect | None]:
        """Every engine's dialect (None: not reachable now), refusing none (the start-up check reads them)."""
        async def one(url: str) -> Dialect | None:
            try:
                d = self._dialects[url] = self._dialects.get(url) or await self._identify(url)
            except UpstreamUnavailable:
                return None
            return d
        found = await asyncio.gather(*(one(u) for u in self.engines))
        return dict(zip(self.engines, found, strict=True))

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
        body = sendable(body, await self.dialect(url))
        if body.get("stream"):
            if url not in self._no_stream:
                try:
                    return await self._generate_stream(url, body, on_delta or (lambda c: None))
                except UpstreamError as exc:
                    if (isinstance(exc, UpstreamStreamError) or exc.extra.get("engine_status") not in (400, 422)
                            or "stream" not in exc.extra["engine_detail"]):
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
        body = sendable(body, await self.dialect(url))
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
                        raw = json.loads(data)
                    except ValueError:
                        raise UpstreamError(f"engine {self._name(url)} streamed a non-JSON event") from None
                    if (err := stream_error(raw)) is not None:
                        # SGLang's in-stream error (HTTP 200): the error its unstreamed answer is (a 400).
                        log.warning("engine %s reported an error mid-stream: %s", self._name(url), _short(str(err)))
                        raise UpstreamStreamError(f"engine {self._name(url)} answered 400", engine_status=400,
                                                  engine_detail=_short(str(err)))
                    event = parse_generate(raw)
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
        """``POST /update_weights_from_disk``; raises UpstreamError/UpstreamUnavailable on failure.

        SGLang: the cache flush around the load is made to succeed (``Dialect.drain_before_load`` /
        ``flush_after_load``), so its scheduler's flush assert cannot fire."""
        d = await self.dialect(url)
        if d.drain_before_load:  # the engine flushes after the load and dies if that fails: load only when idle
            await self._flush(url, version, "before the load")
        body = {"model_path": model_path, "weight_version": version, **d.load_fields}
        status, data = await self._call("POST", url, "/update_weights_from_disk", body, self._control_timeout)
        if status >= 300 or (isinstance(data, dict) and data.get("success") is False):
            raise UpstreamError(f"engine {self._name(url)} refused weights version={version}", engine_status=status,
                                engine_detail=_short(str(data)))
        if d.flush_after_load:  # loaded with flush_cache: false; no cache of the old weights may serve
            await self._flush(url, version, "after the load")
        return data if isinstance(data, dict) else {"response": data}

    async def _flush(self, url: str, version: str, when: str) -> None:
        """``/flush_cache`` until it succeeds (SGLang answers 400 while requests run or wait)."""
        async def attempt() -> bool:
            status, data = await self._call("POST", url, FLUSH_ROUTE, None, self._control_timeout)
            if status in (400, 503):
                return False
            if status >= 300:
                raise UpstreamError(f"engine {self._name(url)} answered {status} to {FLUSH_ROUTE}",
                                    engine_status=status, engine_detail=_short(str(data)))
            return True

        if not await retry_until(attempt, self._control_timeout, Backoff(first_s=0.05, max_s=1.0)):
            raise UpstreamError(f"engine {self._name(url)} refused {FLUSH_ROUTE} {when} (requests still running) "
                                f"for {self._control_timeout:.0f}s; weights version={version}", engine_status=400)

    async def _read(self, url: str, kind: RouteKind, routes: tuple[str, ...], timeout: float) -> Any | None:
        """GET the first of ``routes`` that does not answer 404 (remembered for the next read); None if none."""
        for path in routes:
            try:
                status, data = await self._call("GET", url, path, None, timeout)
            except UpstreamUnavailable:
                return None
            if status == 404:
                continue
            if status >= 300:
                return None
            if path != routes[0] and url in self._dialects:
                self._dialects[url] = self._dialects[url].prefer(kind, path)
            return data
        return None

    async def load(self, url: str, timeout: float) -> Any | None:
        """The engine's load, one object per dp rank (``/get_load``'s list, ``/v1/loads``' ``loads``);
        None when it does not answer."""
        try:
            d = await self.dialect(url)
        except UpstreamUnavailable:
            return None
        body = await self._read(url, "load", d.load_routes, timeout)
        return None if body is None else loads_of(body)

    async def health_status(self, url: str, timeout: float | None = None) -> int | None:
        """The HTTP status of the engine's health route (None: unreachable, or refused by this proxy).
        SGLang's runs a generation (>= 1 s): it gets ``health_timeout_s`` whatever ``timeout`` says."""
        try:
            d = await self.dialect(url)
            wait = self._health_timeout if d.slow_health or timeout is None else timeout
            status, _ = await self._call("GET", url, d.health_route, None, wait)
        except UpstreamUnavailable:
            return None
        return status

    async def healthy(self, url: str, timeout: float | None = None) -> bool:
        """The engine's health route answered 200."""
        return await self.health_status(url, timeout) == 200

    async def weight_version(self, url: str, timeout: float | None = None) -> str | None:
        """The engine's loaded version (``/get_weight_version`` or ``/model_info``); None if unknown."""
        try:
            d = await self.dialect(url)
        except UpstreamUnavailable:
            return None
        body = await self._read(url, "weight_version", d.weight_version_routes, timeout or self._control_timeout)
        return weight_version_of(body)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
