"""In-process fake of the engine's SGLang HTTP API, for the proxy's unit tests only.

It implements the same endpoints the proxy uses (``/generate`` with per-token versions,
``/abort_request`` returning the partial output, ``/update_weights_from_disk``,
``/get_weight_version``) over an ASGI app, producing one token every ``step_s`` so tests can
interrupt generations. Integration tests use the real engine instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.proxy.transport import HttpxTransport

VOCAB = 100


class FakeEngine:
    def __init__(self, version: str = "a", step_s: float = 0.002, stop_after: int | None = None) -> None:
        self.version = version
        self.step_s = step_s
        self.stop_after = stop_after  # emit a stop token after this many tokens (None: never)
        self.generate_bodies: list[dict[str, Any]] = []
        self.aborts: list[str] = []
        self.updates: list[dict[str, Any]] = []
        self.running: dict[str, asyncio.Event] = {}
        self.started = asyncio.Event()  # set when any generation is producing tokens
        self.fail_update = False
        self.app = Starlette(routes=[
            Route("/generate", self.generate, methods=["POST"]),
            Route("/abort_request", self.abort, methods=["POST"]),
            Route("/update_weights_from_disk", self.update, methods=["POST"]),
            Route("/get_weight_version", self.get_version, methods=["GET"]),
        ])

    async def generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.generate_bodies.append(body)
        rid = body["rid"]
        if rid in self.running:
            return JSONResponse({"error": "duplicate rid"}, status_code=400)
        abort = self.running[rid] = asyncio.Event()
        ids, lps, versions = [], [], []
        last = body["input_ids"][-1]
        finish: dict[str, Any] = {"type": "length", "length": body["sampling_params"]["max_new_tokens"]}
        try:
            for i in range(body["sampling_params"]["max_new_tokens"]):
                self.started.set()
                if abort.is_set():
                    finish = {"type": "abort", "message": "aborted"}
                    break
                await asyncio.sleep(self.step_s)
                if abort.is_set():
                    finish = {"type": "abort", "message": "aborted"}
                    break
                last = (last + 1) % VOCAB
                ids.append(last)
                lps.append(-0.25)
                versions.append(self.version)
                if self.stop_after is not None and i + 1 >= self.stop_after:
                    finish = {"type": "stop", "matched": last}
                    break
        finally:
            del self.running[rid]
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids), "weight_version": versions[-1] if versions else self.version,
                "output_token_versions": versions, "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]}
        return JSONResponse({"text": "", "output_ids": ids, "meta_info": meta})

    async def abort(self, request: Request) -> JSONResponse:
        rid = (await request.json())["rid"]
        self.aborts.append(rid)
        if rid in self.running:
            self.running[rid].set()
        return JSONResponse({"success": True})

    async def update(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.updates.append(body)
        if self.fail_update:
            return JSONResponse({"success": False, "message": "bad checkpoint"}, status_code=400)
        self.version = body["weight_version"]
        return JSONResponse({"success": True})

    async def get_version(self, request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": self.version})


class DownTransport(httpx.AsyncBaseTransport):
    """An engine whose port refuses connections."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)


def http_client(engines: dict[str, FakeEngine | None]) -> HttpxTransport:
    """A transport routing each engine URL to its fake (None: a dead engine)."""
    mounts: dict[str, httpx.AsyncBaseTransport] = {
        url: (httpx.ASGITransport(app=e.app) if e is not None else DownTransport()) for url, e in engines.items()
    }
    return HttpxTransport(httpx.AsyncClient(mounts=mounts))
