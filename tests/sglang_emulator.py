"""A version emulator of SGLang's HTTP server, for the proxy's tests (unit: in-process over ASGI;
integration: served by uvicorn, stopped and restarted on its port).

It replays one release's recorded route set (``fixtures/engine/sglang_versions.json``): the
routes that release has (any other answers FastAPI's 404), their status codes and bodies, the
health check's latency (>= 1 s: a one-token generation) and its 503 while starting, ``/flush_cache``
refused (400) while requests run, ``/generate`` whole, batched and streamed (cumulative events),
and errors unstreamed (400) and streamed (an ``{"error": ...}`` event in a 200). It keeps what a
test checks the proxy against: every request (``requests``), fields a release does not know
(``unknown_fields``), and ``crashed`` — what SGLang's scheduler does when its cache flush after a
weight load fails (the assert of 0.5.6 - 0.5.20, or later with ``flush_cache`` true).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "engine" / "sglang_versions.json"
RECORDED: dict[str, Any] = json.loads(FIXTURE.read_text())
VERSIONS: list[str] = list(RECORDED["versions"])  # every supported release, oldest first


def era_of(version: str) -> str:
    return str(RECORDED["versions"][version])


def _fill(value: Any, subs: dict[str, Any]) -> Any:
    """``value`` with every ``"$NAME"`` string replaced by ``subs["$NAME"]`` (inside strings too)."""
    if isinstance(value, dict):
        return {k: _fill(v, subs) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, subs) for v in value]
    if isinstance(value, str):
        if value in subs:
            return subs[value]
        for k, v in subs.items():
            if isinstance(v, str):
                value = value.replace(k, v)
    return value


class SGLangEmulator:
    def __init__(self, version: str, weight_version: str = "default", health_delay_s: float | None = None,
                 starting_s: float = 0.0, tokens: int = 4, drop: tuple[str, ...] = ()) -> None:
        self.version, self.weight_version = version, weight_version
        self.routes: dict[str, dict[str, Any]] = {k: v for k, v in RECORDED["eras"][era_of(version)]["routes"].items()
                                                  if k not in drop}
        self.health_delay_s = self.routes["GET /health"]["delay_s"] if health_delay_s is None else health_delay_s
        self.starting_s, self.tokens = starting_s, tokens
        self.requests: list[tuple[str, str, Any]] = []  # (method, path with query, JSON body or None)
        self.unknown_fields: set[str] = set()  # request fields this release's dataclasses do not have
        self.busy_flushes = 0  # the next N /flush_cache (and loads) find a request still running
        self.fail_generate_after: int | None = None  # the next /generate raises SGLang's ValueError after N tokens
        self.crashed = False  # a load's own flush failed: SGLang's scheduler asserted and died
        self.restart()
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST", "PUT"])])

    def restart(self) -> None:
        """As after a process start: starting (health 503) for ``starting_s``, launch weights."""
        self.started_at = time.monotonic()

    def _subs(self) -> dict[str, Any]:
        return {"$VERSION": self.version, "$WEIGHT_VERSION": self.weight_version, "$RUNNING": 0, "$WAITING": 0,
                "$TOTAL": 0, "$ERROR_MESSAGE": RECORDED["generate"]["error_message"]}

    async def handle(self, request: Request) -> Response:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raw = await request.body()
        body = json.loads(raw) if raw else None
        self.requests.append((request.method, path, body))
        if self.crashed:
            return Response(status_code=503)
        key = f"{request.method} {request.url.path}"
        if key == "GET /flush_cache":
            key = "POST /flush_cache"  # SGLang's route takes both verbs
        route = self.routes.get(key)
        if route is None:
            return JSONResponse({"detail": "Not Found"}, 404)
        if key == "GET /health":
            if time.monotonic() - self.started_at < self.starting_s:
                return Response(status_code=route["starting_status"])
            await asyncio.sleep(self.health_delay_s)  # the generation, checked once per second
            return Response(status_code=route["status"])
        if key == "POST /flush_cache":
            if self.busy_flushes:
                self.busy_flushes -= 1
                return Response(route["busy_body"], status_code=route["busy_status"])
            return Response(route["body"], status_code=route["status"])
        if key == "POST /update_weights_from_disk":
            return self._load(route, body or {})
        if key == "POST /generate":
            return self._generate(body or {})
        out = _fill(route["body"], self._subs())
        if isinstance(out, str):
            return Response(out, status_code=route["status"])
        return JSONResponse(out, route["status"])

    def _load(self, route: dict[str, Any], body: dict[str, Any]) -> Response:
        self.unknown_fields |= set(body) - set(route["fields"])
        flushes = route["flushes_after_load"] == "always" or body.get("flush_cache", True)
        if flushes and self.busy_flushes:  # "Cache flush failed after updating weights"
            self.crashed = True
            return Response(status_code=500)
        self.weight_version = str(body.get("weight_version") or self.weight_version)
        return JSONResponse(_fill(route["body"], self._subs()), route["status"])

    def _answer(self, body: dict[str, Any], rid: str, ids: list[int], n: int, done: bool) -> dict[str, Any]:
        gen = RECORDED["generate"]
        new = [10 + (i % 20) for i in range(n)]  # ids every test tokenizer has
        finish = _fill(gen["finish_length"], {"$COMPLETION_TOKENS": n}) if done else None
        subs = {**self._subs(), "$TEXT": "", "$OUTPUT_IDS": new, "$RID": rid, "$FINISH": finish,
                "$PROMPT_TOKENS": len(ids), "$COMPLETION_TOKENS": n,
                "$OUTPUT_TOKEN_LOGPROBS": [[-0.5, t, None] for t in new]}
        return dict(_fill(gen["response"], subs))

    def _generate(self, body: dict[str, Any]) -> Response:
        self.unknown_fields |= set(body) - set(RECORDED["generate"]["fields"])
        gen = RECORDED["generate"]
        prompts = body.get("input_ids") or [[0]]
        batched = isinstance(prompts[0], list)
        items = list(zip(prompts, body.get("rid") or [f"r{i}" for i in range(len(prompts))],
                         body["sampling_params"], strict=True)) if batched else \
            [(prompts, body.get("rid") or "r", body.get("sampling_params") or {})]
        fail, self.fail_generate_after = self.fail_generate_after, None
        if fail is not None and not body.get("stream"):
            return JSONResponse(_fill(gen["error"]["body"], self._subs()), gen["error"]["status"])
        answers = [(ids, rid, min(self.tokens, int(sp.get("max_new_tokens") or self.tokens)))
                   for ids, rid, sp in items]
        if body.get("stream"):
            ids, rid, n = answers[0]
            return StreamingResponse(self._events(body, rid, ids, n, fail), media_type="text/event-stream")
        out = [self._answer(body, rid, ids, n, True) for ids, rid, n in answers]
        return JSONResponse(out if batched else out[0])

    async def _events(self, body: dict[str, Any], rid: str, ids: list[int], n: int,
                      fail: int | None) -> AsyncIterator[bytes]:
        for i in range(1, n + 1):
            if fail is not None and i > fail:
                break
            yield b"data: " + json.dumps(self._answer(body, rid, ids, i, i == n)).encode() + b"\n\n"
            await asyncio.sleep(0)
        if fail is not None:
            yield b"data: " + json.dumps(_fill(RECORDED["generate"]["stream_error_event"], self._subs())).encode() \
                + b"\n\n"
        yield b"data: [DONE]\n\n"
