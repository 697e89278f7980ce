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
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from services.proxy.errors import UpstreamError, UpstreamUnavailable

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
        logprobs = [float(e[0] if isinstance(e, list | tuple) else e.get("logprob", 0.0) or 0.0)
                    for e in lp_entries]
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
    return Chunk(output_ids, logprobs, versions, finish, weight_version, finish in ABORT_REASONS, chunk_meta)


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
    """Async HTTP to a fixed list of engines (one shared connection pool)."""

    def __init__(self, engines: list[str], connect_timeout_s: float = 2.0, request_timeout_s: float = 600.0,
                 control_timeout_s: float = 120.0, abort_timeout_s: float = 5.0,
                 http: httpx.AsyncClient | None = None) -> None:
        self.engines = [e.rstrip("/") for e in engines]
        self._names = {e: redact(e) for e in self.engines}
        self._control_timeout, self._abort_timeout = control_timeout_s, abort_timeout_s
        timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        # ``http`` lets tests route requests to an in-process ASGI fake.
        self._http = http or httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)

    async def close(self) -> None:
        await self._http.aclose()

    def _name(self, url: str) -> str:
        return self._names.get(url) or redact(url)

    def route(self, session_id: str) -> list[str]:
        return rank_engines(self.engines, session_id) if len(self.engines) > 1 else list(self.engines)

    async def generate(self, url: str, body: dict[str, Any]) -> Chunk:
        """POST ``{url}/generate``; connection failures raise UpstreamUnavailable (nothing was sent)."""
        try:
            resp = await self._http.post(f"{url}/generate", json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise UpstreamUnavailable(f"engine {self._name(url)} unreachable ({type(exc).__name__})", connected=False) from None
        except httpx.TimeoutException as exc:
            raise UpstreamUnavailable(f"engine {self._name(url)} timed out ({type(exc).__name__})", connected=True) from None
        except httpx.TransportError as exc:  # connection dropped mid-request (engine died)
            raise UpstreamUnavailable(f"engine {self._name(url)} failed ({type(exc).__name__})", connected=True) from None
        if resp.status_code >= 400:
            raise UpstreamError(f"engine {self._name(url)} answered {resp.status_code}", engine_status=resp.status_code,
                                engine_detail=_short(resp.text))
        try:
            return parse_generate(resp.json())
        except ValueError:
            raise UpstreamError(f"engine {self._name(url)} returned non-JSON") from None

    async def abort(self, url: str, rid: str) -> bool:
        """Ask ``url`` to abort ``rid``; True on a 2xx (the rid may already have finished)."""
        try:
            resp = await self._http.post(f"{url}/abort_request", json={"rid": rid}, timeout=self._abort_timeout)
        except httpx.HTTPError as exc:
            log.warning("abort failed rid=%s engine=%s: %s", rid, self._name(url), type(exc).__name__)
            return False
        return resp.status_code < 300

    async def update_weights(self, url: str, model_path: str, version: str) -> dict[str, Any]:
        """``POST /update_weights_from_disk``; raises UpstreamError/UpstreamUnavailable on failure."""
        body = {"model_path": model_path, "weight_version": version}
        try:
            resp = await self._http.post(f"{url}/update_weights_from_disk", json=body, timeout=self._control_timeout)
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"engine {self._name(url)} unreachable for weight update ({type(exc).__name__})") from None
        data = _json_or_text(resp)
        ok = resp.status_code < 300 and not (isinstance(data, dict) and data.get("success") is False)
        if not ok:
            raise UpstreamError(f"engine {self._name(url)} refused weights version={version}", engine_status=resp.status_code,
                                engine_detail=_short(str(data)))
        return data if isinstance(data, dict) else {"response": data}

    async def weight_version(self, url: str) -> str | None:
        """The engine's loaded version (``/get_weight_version``, else ``/model_info``); None if unknown."""
        for path in ("/get_weight_version", "/model_info"):
            try:
                resp = await self._http.get(f"{url}{path}", timeout=self._control_timeout)
            except httpx.HTTPError:
                return None
            if resp.status_code < 300:
                data = _json_or_text(resp)
                if isinstance(data, dict) and data.get("weight_version") is not None:
                    return str(data["weight_version"])
        return None


def _json_or_text(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
