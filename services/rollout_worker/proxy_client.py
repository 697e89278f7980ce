"""The worker's view of the proxy: a small async interface, its HTTP implementation, error mapping.

Contract (docs/proxy.md): ``POST /v1/chat/completions`` with header
``X-Session-Id`` records one model call in that session; ``POST /v1/sessions/{id}/finalize`` closes
it to new turns and returns ``{"session_id", "samples": [Sample dicts], ...}``; ``DELETE /v1/sessions/{id}`` drops it;
``POST /v1/sessions/close`` does both for a whole group in one call (``{"closed", "missing", "records"}``); black-box
agents reach the same session through the session-scoped base URL ``{proxy}/s/{id}/v1``.

Every failure surfaces as ``TrajectoryFailed`` with a code: the proxy's own 502 ``detail.error``
(``shared.codes.PROXY_502_CODES``: the span limit, a changed trajectory version, a preempted generation),
``upstream_unavailable`` (503), ``session_not_found`` (404), ``proxy_http_<status>``,
``proxy_timeout`` or ``proxy_unreachable`` (codes in ``shared.codes``). A 502 ``upstream_error`` whose
engine answered 502/503/504 (an engine still loading after a restart) is ``upstream_unavailable`` too:
infrastructure, never the trajectory's fault. ``services.rollout_worker.fake_proxy`` implements the
same interface in process for unit tests; both run through the same contract tests.
A 503 ``over_capacity`` is backpressure, not a failure: the request is repeated after its
``Retry-After`` (the trajectory timeout bounds the wait).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from services.rollout_worker.errors import TrajectoryFailed
from shared.codes import (
    OVER_CAPACITY,
    PROXY_TIMEOUT,
    PROXY_UNREACHABLE,
    SESSION_NOT_FOUND,
    UPSTREAM_ERROR,
    UPSTREAM_UNAVAILABLE,
)
from shared.http_transport import HttpxTransport, RawHttp, Transport, TransportError

ChatMessages = list[dict[str, str]]
CLOSE_PATH = "/v1/sessions/close"


@dataclass(frozen=True)
class ClosedSessions:
    """What ``POST /v1/sessions/close`` answered: a record per closed session, the ids it did not know."""

    records: dict[str, dict[str, Any]]
    missing: list[str]


def closed_sessions(body: Any, session_id: str) -> ClosedSessions:
    """Check the shape of a close answer (pure; used by the fake too); raises ``TrajectoryFailed``."""
    if not isinstance(body, dict) or not isinstance(body.get("records"), dict) \
            or not isinstance(body.get("missing"), list):
        raise TrajectoryFailed("invalid_proxy_response", "close answer lacks records/missing", session_id=session_id)
    records = {str(k): v for k, v in body["records"].items() if isinstance(v, dict)}
    return ClosedSessions(records, [str(m) for m in body["missing"]])
ENGINE_DOWN_STATUSES = frozenset({502, 503, 504})  # an engine answering these is restarting or overloaded
MAX_BACKPRESSURE_RETRIES = 1000  # the trajectory timeout bounds the wait long before this
CONNECT_TIMEOUT_S = 10.0


class ProxyClient(Protocol):
    """What the group runner needs from the proxy."""

    base_url: str  # e.g. "http://127.0.0.1:8800" (no trailing slash)
    api_key: str | None  # bearer token the proxy expects; None = no auth

    async def chat(self, session_id: str, messages: ChatMessages, max_tokens: int, temperature: float) -> str:
        """One model call recorded in ``session_id``; returns the assistant's text."""
        ...

    async def chat_many(self, session_ids: list[str], messages: ChatMessages, max_tokens: int,
                        temperature: float) -> list[str]:
        """One call for n trajectories at the same messages: choice i is recorded in ``session_ids[i]``
        (``n`` + ``X-Session-Ids``); returns the n assistant texts in order."""
        ...

    async def finalize(self, session_id: str) -> dict[str, Any]:
        """Close the session to new turns (a running turn is recorded first) and return its record,
        including ``samples`` (Sample-shaped dicts)."""
        ...

    async def delete_session(self, session_id: str) -> None:
        """Drop the session (unknown sessions are fine)."""
        ...

    async def close_sessions(self, session_ids: list[str], records: bool = True) -> ClosedSessions:
        """Finalize and drop every session in one call; with ``records`` their records come back
        (each as ``finalize`` returns it). Unknown sessions are listed, not an error."""
        ...

    def agent_base_url(self, session_id: str) -> str:
        """The OpenAI base URL a black-box agent uses so its calls land in ``session_id``."""
        ...

    async def aclose(self) -> None: ...


def session_path(session_id: str, suffix: str = "") -> str:
    """``/v1/sessions/{id}{suffix}`` with the id URL-quoted."""
    return f"/v1/sessions/{quote(session_id, safe='')}{suffix}"


class SessionCalls:
    """The session calls every ``ProxyClient`` makes the same way, on top of its ``_send``."""

    base_url: str

    async def _send(self, method: str, path: str, session_id: str) -> Any:
        raise NotImplementedError

    async def delete_session(self, session_id: str) -> None:
        try:
            await self._send("DELETE", session_path(session_id), session_id)
        except TrajectoryFailed as exc:
            if exc.code != SESSION_NOT_FOUND:
                raise

    def agent_base_url(self, session_id: str) -> str:
        return f"{self.base_url}/s/{quote(session_id, safe='')}/v1"


def _detail(body: Any) -> dict[str, Any]:
    """The error object of a proxy error body: ``detail`` when it is a dict, else the top level."""
    if isinstance(body, dict):
        inner = body.get("detail")
        return inner if isinstance(inner, dict) else body
    return {}


def proxy_error(status: int, body: Any, session_id: str | None = None) -> TrajectoryFailed:
    """Map a non-2xx proxy response to a ``TrajectoryFailed`` (pure; used by the fake too), attributed to
    the session the proxy's ``detail.session_id`` names, else to ``session_id``."""
    detail = _detail(body)
    named = detail.get("session_id")  # the proxy names the session it refused (one choice of many, say)
    session_id = named if isinstance(named, str) and named else session_id
    message = str(detail.get("message") or detail.get("detail") or (body if isinstance(body, str) else ""))[:500]
    code = detail.get("error") if isinstance(detail.get("error"), str) else None
    if status == 502 and code == UPSTREAM_ERROR and detail.get("engine_status") in ENGINE_DOWN_STATUSES:
        return TrajectoryFailed(UPSTREAM_UNAVAILABLE, message, session_id=session_id)
    if status == 502 and code:
        return TrajectoryFailed(code, message, session_id=session_id)
    if status == 503:
        return TrajectoryFailed(OVER_CAPACITY if code == OVER_CAPACITY else UPSTREAM_UNAVAILABLE, message,
                                session_id=session_id)
    if status == 404:
        return TrajectoryFailed(SESSION_NOT_FOUND, message, session_id=session_id)
    return TrajectoryFailed(f"proxy_http_{status}", message or (code or ""), session_id=session_id)


def retry_after(header: str | None, cap_s: float = 5.0) -> float:
    """Seconds to wait on a 503 ``over_capacity`` (its ``Retry-After``, 0.5 s if absent, capped)."""
    try:
        return min(cap_s, max(0.05, float(header))) if header else 0.5
    except ValueError:
        return 0.5


def chat_replies(body: Any, session_ids: list[str]) -> list[str]:
    """The n assistant texts of a chat completion with n choices, by choice index; raises ``TrajectoryFailed``."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != len(session_ids):
        raise TrajectoryFailed("invalid_proxy_response", f"expected {len(session_ids)} choices",
                               session_id=session_ids[0])
    ordered = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    return [chat_reply({"choices": [c]}, sid) for c, sid in zip(ordered, session_ids, strict=True)]


def chat_reply(body: Any, session_id: str) -> str:
    """The assistant text of an OpenAI chat completion body; raises ``TrajectoryFailed``."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise TrajectoryFailed("invalid_proxy_response", "no choices[0].message.content",
                               session_id=session_id) from exc
    return content if isinstance(content, str) else ""


class HttpProxyClient(SessionCalls):
    """``ProxyClient`` over HTTP: the lean keep-alive client of ``shared.http_transport`` (httpx, when
    a test hands in an httpx ``transport``, e.g. an in-process ASGI app or a mock)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        if transport is None:
            self._http: Transport = RawHttp(connect_timeout=CONNECT_TIMEOUT_S, bearer=api_key)
        else:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            self._http = HttpxTransport(httpx.AsyncClient(headers=headers, transport=transport))

    async def _request(self, method: str, path: str, session_id: str, body: Any | None = None,
                       headers: dict[str, str] | None = None) -> Any:
        """The decoded JSON body of a 2xx answer (None when empty); raises ``TrajectoryFailed``."""
        for _ in range(MAX_BACKPRESSURE_RETRIES):
            try:
                reply = await self._http.exchange(method, f"{self.base_url}{path}", body, self.timeout_s, headers)
            except TransportError as exc:
                code = PROXY_TIMEOUT if exc.timed_out else PROXY_UNREACHABLE
                raise TrajectoryFailed(code, f"{method} {path}: {type(exc).__name__}: {exc}",
                                       session_id=session_id) from exc
            try:
                decoded: Any = json.loads(reply.body) if reply.body else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                if reply.status < 400:
                    raise TrajectoryFailed("invalid_proxy_response", f"{method} {path}: the body is not JSON",
                                           session_id=session_id) from None
                decoded = reply.body[:500].decode("utf-8", "replace")
            if reply.status < 400:
                return decoded
            failure = proxy_error(reply.status, decoded, session_id)
            if failure.code != OVER_CAPACITY:
                raise failure
            await asyncio.sleep(retry_after(reply.headers.get("retry-after")))
        raise failure

    async def chat(self, session_id: str, messages: ChatMessages, max_tokens: int, temperature: float) -> str:
        payload = {"model": "policy", "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        body = await self._request("POST", "/v1/chat/completions", session_id, payload, {"X-Session-Id": session_id})
        return chat_reply(body, session_id)

    async def chat_many(self, session_ids: list[str], messages: ChatMessages, max_tokens: int,
                        temperature: float) -> list[str]:
        payload = {"model": "policy", "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                   "n": len(session_ids)}
        body = await self._request("POST", "/v1/chat/completions", session_ids[0], payload,
                                   {"X-Session-Ids": ",".join(session_ids)})
        return chat_replies(body, session_ids)

    async def _send(self, method: str, path: str, session_id: str) -> Any:
        return await self._request(method, path, session_id)  # DELETE may answer with an empty body: None

    async def close_sessions(self, session_ids: list[str], records: bool = True) -> ClosedSessions:
        body = await self._request("POST", CLOSE_PATH, session_ids[0],
                                   {"session_ids": session_ids, "records": records})
        return closed_sessions(body, session_ids[0])

    async def finalize(self, session_id: str) -> dict[str, Any]:
        body = await self._send("POST", session_path(session_id, "/finalize"), session_id)
        if not isinstance(body, dict):
            raise TrajectoryFailed("invalid_proxy_response", "session body is not an object", session_id=session_id)
        return body

    async def aclose(self) -> None:
        await self._http.close()
