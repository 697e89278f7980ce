"""Edge guards: bearer auth, body-size limit, request metrics (one pure-ASGI middleware) and the
in-app concurrency limit.

Contract:
* authentication and scopes are ``services.proxy.auth``'s: with ``api_key`` or ``operator_key`` set,
  every path except ``/health`` needs a bearer credential of the route's scope (401 none or a wrong
  one, 403 a valid one of another scope), decided before the body is read; the principal is put in
  ``auth.PRINCIPAL`` for the routes. Keys are never logged and never echoed;
* a body larger than ``max_body_bytes`` gets 413 — refused up front from ``Content-Length``, and
  also while streaming (chunked bodies, lying headers) by counting bytes as they are received;
* an exception no handler took becomes 500 ``{"error": "internal_error"}`` and one log line
  (with the traceback, in the log only); a client that went away mid-request (``ClientDisconnect``,
  routine when a worker is killed or times out) is one info line and ``client_disconnects`` + 1;
* ``ConcurrencyLimit`` counts generations in flight *in the app* (uvicorn's
  ``--limit-concurrency`` counts connections, and idle keep-alive connections are not work);
  over the limit a request gets 503 ``over_capacity`` with ``Retry-After`` at once, never queued.
"""

from __future__ import annotations

import json
import logging
import time
from types import TracebackType
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.proxy.auth import PRINCIPAL, Authorizer, Refusal
from services.proxy.errors import OverCapacity, ProxyError, error_body
from services.proxy.metrics import ProxyMetrics
from shared.edge import printable

log = logging.getLogger(__name__)

class BodyTooLarge(ProxyError):
    status = 413
    code = "body_too_large"


def route_name(path: str) -> str:
    """A bounded metrics label for ``path`` (session ids never become labels)."""
    if path.startswith("/s/"):
        parts = path.split("/", 3)
        path = "/" + parts[3] if len(parts) > 3 else "/"
    if path == "/v1/chat/completions":
        return "chat"
    if path == "/v1/generate":
        return "generate"
    for prefix, name in (("/v1/sessions", "sessions"), ("/v1/rollout", "rollout")):
        if path.startswith(prefix):
            return name
    return path.strip("/").replace("/", "_") if path in ("/health", "/metrics", "/v1/models") else "other"


class ConcurrencyLimit:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def __enter__(self) -> ConcurrencyLimit:
        if self.in_flight >= self.limit:
            raise OverCapacity(f"{self.in_flight} requests in flight (proxy.max_concurrency={self.limit})")
        self.in_flight += 1
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.in_flight -= 1


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


class Guard:
    """Pure ASGI middleware (no per-request task or body copy, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ProxyMetrics,
                 operator_key: str | None = None) -> None:
        self.app, self.max_body, self.metrics = app, max_body_bytes, metrics
        self.auth = Authorizer(api_key, operator_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        route = route_name(scope["path"])
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_wrapper)
        finally:
            self.metrics.request_done(route, status[0], time.perf_counter() - start)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        who = self.auth.decide(scope["path"], scope.get("headers", []))
        if isinstance(who, Refusal):
            code = "unauthorized" if who.status == 401 else "forbidden"
            await _send_json(send, who.status, error_body(who.status, {"error": code, "message": who.message}),
                             {"WWW-Authenticate": "Bearer"} if who.status == 401 else None)
            return
        PRINCIPAL.set(who)  # this request's task: routes bind sessions to it (services.proxy.auth)
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None:
            try:
                too_big = int(declared) > self.max_body
            except ValueError:
                await _send_json(send, 400, error_body(400, {"error": "invalid_request", "field": "content-length",
                                                             "message": "content-length: not an integer"}))
                return
            if too_big:
                await _send_json(send, 413, BodyTooLarge(self._limit_msg()).detail_body())
                return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge(self._limit_msg())
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:  # raised outside a route's error handling
            if not started:
                await _send_json(send, 413, exc.detail_body())
        except ClientDisconnect:  # routine (a worker killed or timed out mid-request): one line, counted
            self.metrics.client_disconnects.inc()
            sid = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-session-id"), "")
            log.info("client disconnected before the answer: %s %s session_id=%s", printable(scope.get("method")),
                     printable(scope["path"]), printable(sid or "-"))
        except Exception as exc:  # the last resort: a log line for us, no stack trace for the client
            log.error("internal error on %s %s: %s", printable(scope.get("method")), printable(scope["path"]),
                      type(exc).__name__,
                      exc_info=exc)
            if not started:
                await _send_json(send, 500, {"error": "internal_error"})

    def _limit_msg(self) -> str:
        return f"request body exceeds proxy.max_body_bytes={self.max_body}"
