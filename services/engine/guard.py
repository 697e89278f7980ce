"""The engine's edge: bearer auth, a body limit and strict JSON, in front of whatever routes the app has.

Invariants (pure ASGI, so it wraps the app without knowing its request schemas):
* with ``engine.api_key`` set, every path but ``/health`` needs ``Authorization: Bearer <key>``
  (constant-time compare) -- 401 before the body is read. The key is shared by the proxy (and
  the trainer) only; agents never hold it;
* a body over ``engine.max_body_bytes`` is 413, from ``Content-Length`` or while it streams in;
* a body that is not acceptable JSON (``shared.edge.loads_json``: nesting, UTF-8, lone
  surrogates) is 400 with the reason, before a route parses it, so none of these reach a 500.
The body is buffered (it is bounded) and replayed to the app unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.edge import BadJson, bearer, loads_json, same_secret

OPEN_PATHS = frozenset({"/health"})


async def _answer(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = []) -> None:  # noqa: B006
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": raw})


class EngineGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not same_secret(bearer(headers), self.api_key):
            await _answer(send, 401, {"error": {"type": "unauthorized", "message": "missing or invalid bearer token"}},
                          [(b"www-authenticate", b"Bearer")])
            return
        too_big = {"error": {"type": "body_too_large", "message": f"body exceeds engine.max_body_bytes={self.max_body}"}}
        declared = next((v for k, v in headers if k == b"content-length"), b"0")
        if not declared.isdigit() or int(declared) > self.max_body:
            await _answer(send, 413 if declared.isdigit() else 400, too_big if declared.isdigit() else
                          {"error": {"type": "invalid_request", "message": "content-length is not an integer"}})
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                await _answer(send, 413, too_big)
                return
        body = b"".join(chunks)
        if body.strip():
            try:
                loads_json(body)
            except BadJson as exc:
                await _answer(send, 400, {"error": {"type": "invalid_request", "message": f"body: {exc}"}})
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnect notices
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
