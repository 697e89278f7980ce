"""An in-process fake of the proxy for tests: same interface, same HTTP routes, scripted failures.

``FakeProxy`` holds the state (sessions and their recorded Sample dicts, deletions, concurrency
high-water mark) and answers like the real proxy. Three ways in, all sharing ``FakeProxy.handle``
so they cannot drift apart:
* ``FakeProxyClient`` — the ``ProxyClient`` interface, in process (unit tests of the runner);
* ``fake.transport()`` — an ``httpx.MockTransport`` so ``HttpProxyClient`` runs against it;
* ``serve(fake)`` — a real loopback HTTP server, for black-box agent subprocesses and workers.

Recorded segments: one Sample per model call, context tokens = the characters of the messages
(mask 0, version ``"-1"``), response tokens = the characters of the reply (mask 1, the fake's
current ``version``). ``fail(session_id, call_index)`` returns an error code to inject:
a proxy 502 code, ``"upstream_unavailable"`` or ``"over_capacity"`` (503s) or ``"http_500"``.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

import httpx

from services.rollout_worker.proxy_client import (
    CLOSE_PATH,
    MAX_BACKPRESSURE_RETRIES,
    ChatMessages,
    ClosedSessions,
    SessionCalls,
    chat_replies,
    chat_reply,
    closed_sessions,
    proxy_error,
    retry_after,
    session_path,
)
from shared.codes import OVER_CAPACITY
from shared.edge import session_token
from shared.staleness import version_spans

ReplyFn = Callable[[str, ChatMessages], str]  # (session_id, messages) -> assistant text
FailFn = Callable[[str, int], str | None]  # (session_id, call index in the session) -> error code or None


def _completion(text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": len(text), "total_tokens": len(text)}}


def _choices(headers: dict[str, str]) -> int:
    """Model calls one chat request makes: one per session of ``X-Session-Ids``, else one."""
    many = {k.lower(): v for k, v in headers.items()}.get("x-session-ids")
    return len(many.split(",")) if many else 1


class FakeProxy:
    """Proxy state + request handling; thread-safe (the HTTP server is threaded)."""

    def __init__(self, reply: ReplyFn | None = None, version: str = "0", delay_s: float = 0.0,
                 fail: FailFn | None = None, api_key: str | None = None) -> None:
        self.reply = reply or (lambda sid, msgs: "42")
        self.version, self.delay_s, self.fail, self.api_key = version, delay_s, fail, api_key
        self.sessions: dict[str, list[dict[str, Any]]] = {}
        self.deleted: list[str] = []
        self.finalized: set[str] = set()
        self.closes: list[list[str]] = []  # the ids of every POST /v1/sessions/close, in order
        self.calls: list[tuple[str, ChatMessages]] = []
        self.rewards: dict[str, dict[str, Any]] = {}  # POST /s/{sid}/v1/reward, the last report per session
        self.active = 0  # model calls in progress right now
        self.max_active = 0  # high-water mark of concurrent model calls
        self._lock = threading.Lock()

    def enter(self, calls: int = 1) -> None:
        with self._lock:
            self.active += calls
            self.max_active = max(self.max_active, self.active)

    def leave(self, calls: int = 1) -> None:
        with self._lock:
            self.active -= calls

    def _record(self, session_id: str, messages: ChatMessages) -> tuple[int, dict[str, Any]]:
        with self._lock:
            index = len(self.sessions.get(session_id, []))
            self.calls.append((session_id, [dict(m) for m in messages]))
        code = self.fail(session_id, index) if self.fail else None
        if code is not None:
            status = {"upstream_unavailable": 503, "over_capacity": 503, "http_500": 500}.get(code, 502)
            return status, {"detail": {"error": code, "message": f"fake proxy injected {code}", "session_id": session_id}}
        text = self.reply(session_id, messages)
        context = [ord(c) % 256 for m in messages for c in m.get("content", "")] or [0]
        response = [ord(c) % 256 for c in text]
        versions = ["-1"] * len(context) + [self.version] * len(response)
        sample = {"traj_id": session_id, "segment_index": index, "token_ids": context + response,
                  "loss_mask": [0] * len(context) + [1] * len(response),
                  "logprobs": [0.0] * len(context) + [-0.5] * len(response),
                  "token_versions": versions, "version_spans": version_spans(versions),
                  "start_version": self.version if response else None,
                  "end_version": self.version if response else None,
                  "reward": 0.0, "finish_reason": "stop", "partial_rollout": False, "meta": {}}
        with self._lock:
            self.sessions.setdefault(session_id, []).append(sample)
        return 200, _completion(text)

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
        """Answer one HTTP request like the proxy (no delay; callers sleep ``delay_s``)."""
        headers = {k.lower(): v for k, v in headers.items()}
        parts = [unquote(p) for p in path.split("?")[0].strip("/").split("/")]
        if self.api_key:  # the proxy's rule: the agent key anywhere, a session token under /s/{its session}/v1/
            sid = parts[1] if parts[0] == "s" and len(parts) > 2 else None
            granted = {f"Bearer {self.api_key}"} | ({f"Bearer {session_token(self.api_key, sid)}"} if sid else set())
            if headers.get("authorization") not in granted:
                return 401, {"detail": {"error": "unauthorized", "message": "bad or missing bearer token"}}
        if method == "POST" and parts[-3:] == ["v1", "chat", "completions"]:
            session = parts[1] if parts[0] == "s" and len(parts) == 5 else headers.get("x-session-id") \
                or headers.get("x-session-ids")
            if not session:
                return 400, {"detail": {"error": "missing_session", "message": "X-Session-Id header required"}}
            try:
                messages = json.loads(body or b"{}")["messages"]
            except (ValueError, KeyError, TypeError):
                return 422, {"detail": {"error": "invalid_request", "message": "messages required"}}
            choices = [sid.strip() for sid in headers["x-session-ids"].split(",")] if "x-session-ids" in headers \
                else [session]
            for sid in choices:
                if sid in self.finalized:
                    return 409, {"detail": {"error": "session_conflict", "message": f"session {sid!r} is finalized"}}
            answers = [self._record(sid, messages) for sid in choices]  # n choices: one recorded per session
            if len(answers) == 1 or any(status != 200 for status, _ in answers):
                return next(((st, a) for st, a in answers if st != 200), answers[0])
            merged = answers[0][1]
            merged["choices"] = [{**a["choices"][0], "index": i} for i, (_, a) in enumerate(answers)]
            return 200, merged
        if method == "POST" and parts[0] == "s" and parts[2:] == ["v1", "reward"]:
            return self._reward(parts[1], body)
        if method == "POST" and parts == ["v1", "sessions", "close"]:
            return self._close(json.loads(body or b"{}"))
        if parts[:2] == ["v1", "sessions"] and len(parts) in (3, 4):
            with self._lock:
                read = (method == "GET" and len(parts) == 3) or (method == "POST" and parts[3:] == ["finalize"])
                if read and parts[2] in self.sessions:
                    if method == "POST":
                        self.finalized.add(parts[2])
                    return 200, {"session_id": parts[2], "samples": list(self.sessions[parts[2]]),
                                 "finalized": parts[2] in self.finalized, "versions": [self.version]}
                if method == "DELETE" and len(parts) == 3:
                    self.deleted.append(parts[2])
                    if self.sessions.pop(parts[2], None) is not None:
                        return 200, {"deleted": parts[2]}
            return 404, {"detail": {"error": "session_not_found", "message": parts[2]}}
        return 404, {"detail": f"no route {method} {path}"}

    def _reward(self, sid: str, body: bytes) -> tuple[int, Any]:
        """The proxy's rule: a finite reward for a live session that made a model call, not yet finalized."""
        try:
            req = json.loads(body or b"{}")
            reward = float(req["reward"])
            report = {"reward": reward, "components": dict(req.get("components") or {})}
        except (ValueError, KeyError, TypeError):
            return 422, {"detail": {"error": "invalid_request", "message": "reward: a number is required"}}
        if not math.isfinite(reward):
            return 422, {"detail": {"error": "invalid_request", "message": "reward must be finite"}}
        with self._lock:
            if sid in self.finalized:
                return 409, {"detail": {"error": "session_conflict", "message": f"session {sid!r} is finalized"}}
            if sid not in self.sessions:
                return 404, {"detail": {"error": "session_not_found", "message": sid}}
            self.rewards[sid] = report
        return 200, {"session_id": sid, **report}

    def _close(self, req: dict[str, Any]) -> tuple[int, Any]:
        ids = req.get("session_ids")
        if not isinstance(ids, list) or not ids or len(set(ids)) != len(ids):
            return 422, {"detail": {"error": "invalid_request", "message": "session_ids: distinct ids required"}}
        records: dict[str, Any] = {}
        with self._lock:
            self.closes.append(list(ids))
            missing = [sid for sid in ids if sid not in self.sessions]
            self.deleted += ids  # asked to drop, known or not (as DELETE records it)
            for sid in ids:
                if sid in self.sessions:
                    self.finalized.add(sid)
                    samples = self.sessions.pop(sid)
                    if req.get("records", True):
                        records[sid] = {"session_id": sid, "samples": samples, "finalized": True,
                                        "versions": [self.version], "agent_reward": self.rewards.get(sid)}
        return 200, {"closed": [s for s in ids if s not in missing], "missing": missing, "records": records}

    async def handle_async(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
        """``handle`` after ``delay_s`` for model calls, counted as in flight meanwhile."""
        if not path.split("?")[0].endswith("/chat/completions"):
            return self.handle(method, path, headers, body)
        calls = _choices(headers)
        self.enter(calls)
        try:
            await asyncio.sleep(self.delay_s)
            return self.handle(method, path, headers, body)
        finally:
            self.leave(calls)

    def handle_blocking(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
        """``handle_async`` for server threads."""
        if not path.split("?")[0].endswith("/chat/completions"):
            return self.handle(method, path, headers, body)
        calls = _choices(headers)
        self.enter(calls)
        try:
            time.sleep(self.delay_s)
            return self.handle(method, path, headers, body)
        finally:
            self.leave(calls)

    def transport(self) -> httpx.MockTransport:
        """An httpx transport answering from this fake (async, honours ``delay_s`` for chat calls)."""

        async def handler(request: httpx.Request) -> httpx.Response:
            status, body = await self.handle_async(request.method, request.url.raw_path.decode(),
                                                   dict(request.headers), request.content)
            return httpx.Response(status, json=body, headers={"Retry-After": "0"} if status == 503 else None)

        return httpx.MockTransport(handler)


class FakeProxyClient(SessionCalls):
    """``ProxyClient`` calling a ``FakeProxy`` directly (no HTTP), errors mapped like the HTTP client."""

    def __init__(self, fake: FakeProxy, base_url: str = "http://fake-proxy") -> None:
        self.fake, self.base_url, self.api_key = fake, base_url, fake.api_key

    def _headers(self, session_id: str) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"X-Session-Id": session_id, **auth}

    async def _call(self, method: str, path: str, session_id: str, body: bytes = b"",
                    headers: dict[str, str] | None = None) -> Any:
        """One request through ``FakeProxy.handle`` with the HTTP client's error and backpressure rules."""
        sent = self._headers(session_id) if headers is None else headers
        for _ in range(MAX_BACKPRESSURE_RETRIES):
            status, answer = await self.fake.handle_async(method, path, sent, body)
            if status < 400:
                return answer
            failure = proxy_error(status, answer, session_id)
            if failure.code != OVER_CAPACITY:
                raise failure
            await asyncio.sleep(retry_after("0"))
        raise failure

    async def chat(self, session_id: str, messages: ChatMessages, max_tokens: int, temperature: float) -> str:
        body = await self._call("POST", "/v1/chat/completions", session_id, json.dumps({"messages": messages}).encode())
        return chat_reply(body, session_id)

    async def chat_many(self, session_ids: list[str], messages: ChatMessages, max_tokens: int,
                        temperature: float) -> list[str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = json.dumps({"messages": messages, "n": len(session_ids)}).encode()
        answer = await self._call("POST", "/v1/chat/completions", session_ids[0], body,
                                  {"X-Session-Ids": ",".join(session_ids), **auth})
        return chat_replies(answer, session_ids)

    async def _send(self, method: str, path: str, session_id: str) -> Any:
        return await self._call(method, path, session_id)

    async def finalize(self, session_id: str) -> dict[str, Any]:
        return dict(await self._send("POST", session_path(session_id, "/finalize"), session_id))

    async def close_sessions(self, session_ids: list[str], records: bool = True) -> ClosedSessions:
        body = json.dumps({"session_ids": session_ids, "records": records}).encode()
        return closed_sessions(await self._call("POST", CLOSE_PATH, session_ids[0], body), session_ids[0])

    async def aclose(self) -> None:
        return None


@contextmanager
def serve(fake: FakeProxy) -> Iterator[str]:
    """Serve ``fake`` over real loopback HTTP in a thread; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, payload = fake.handle_blocking(self.command, self.path, dict(self.headers.items()), body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            if status == 503:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="fake-proxy", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
