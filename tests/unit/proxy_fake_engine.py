"""In-process fake of the engine's SGLang HTTP API, for the proxy's unit tests only.

It implements the same endpoints the proxy uses (``/generate`` with per-token versions,
``/abort_request`` returning the partial output, ``/update_weights_from_disk``,
``/get_weight_version``, and ``/get_server_info`` saying it is this project's engine) over an ASGI app, producing one token every ``step_s`` so tests can
interrupt generations. Integration tests use the real engine instead.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shared.http_transport import HttpxTransport
from shared.sglang_fields import OWN_ENGINE_VERSION

VOCAB = 100


class FakeEngine:
    def __init__(self, version: str = "a", step_s: float = 0.002, stop_after: int | None = None,
                 script: list[int] | None = None) -> None:
        self.script = script  # emit these ids (continuing where a resumed prompt left off), then stop
        self.version = version
        self.step_s = step_s
        self.stop_after = stop_after  # emit a stop token after this many tokens (None: never)
        self.generate_bodies: list[dict[str, Any]] = []  # one per prompt (a batch's prompts each)
        self.batch_sizes: list[int] = []  # prompts per batched /generate
        self.aborts: list[str] = []
        self.updates: list[dict[str, Any]] = []
        self.running: dict[str, asyncio.Event] = {}
        self.started = asyncio.Event()  # set when any generation is producing tokens
        self.produced = 0  # tokens emitted so far, over every generation: what tests wait on
        self.fail_update = False
        self.app = Starlette(routes=[
            Route("/generate", self.generate, methods=["POST"]),
            Route("/abort_request", self.abort, methods=["POST"]),
            Route("/update_weights_from_disk", self.update, methods=["POST"]),
            Route("/get_weight_version", self.get_version, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
        ])

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        if body["input_ids"] and isinstance(body["input_ids"][0], list):  # SGLang's batch: a list of prompts
            return await self._batch(body)
        self.generate_bodies.append(body)
        rid = body["rid"]
        if rid in self.running:
            return JSONResponse({"error": "duplicate rid"}, status_code=400)
        if body.get("stream"):
            return StreamingResponse(self._sse(body), media_type="text/event-stream")
        meta: dict[str, Any] = {}
        async for meta in self._run(body):  # noqa: B007  # the last item is the result
            pass
        return JSONResponse({"text": "", "output_ids": meta["output_ids"], "meta_info": meta["meta_info"]})

    async def _batch(self, body: dict[str, Any]) -> Response:
        """One response per prompt, in order (each under its own rid, abortable alone)."""
        items = [{**body, "input_ids": ids, "rid": rid, "sampling_params": sp} for ids, rid, sp
                 in zip(body["input_ids"], body["rid"], body["sampling_params"], strict=True)]
        self.batch_sizes.append(len(items))
        self.generate_bodies += items

        async def one(item: dict[str, Any]) -> dict[str, Any]:
            meta: dict[str, Any] = {}
            async for meta in self._run(item):  # noqa: B007  # the last item is the result
                pass
            return {"text": "", "output_ids": meta["output_ids"], "meta_info": meta["meta_info"]}

        return JSONResponse(list(await asyncio.gather(*(one(i) for i in items))))

    async def _sse(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """SGLang's streamed /generate: one event per token, cumulative output_ids and logprobs."""
        async for event in self._run(body):
            yield b"data: " + json.dumps({"text": "", **event}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _next(self, body: dict[str, Any], produced: list[int], last: int) -> int | None:
        if self.script is None:
            return (last + 1) % VOCAB
        done = self._resumed_from(body) + len(produced)
        return self.script[done] if done < len(self.script) else None

    def _resumed_from(self, body: dict[str, Any]) -> int:
        """How much of the script a resumed prompt (prompt + partial output) already holds."""
        prompt, script = body["input_ids"], self.script or []
        for n in range(min(len(prompt), len(script)), 0, -1):
            if prompt[-n:] == script[:n]:
                return n
        return 0

    async def _run(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        rid = body["rid"]
        abort = self.running[rid] = asyncio.Event()
        ids: list[int] = []
        lps: list[float] = []
        versions: list[str] = []
        last = body["input_ids"][-1]
        finish: dict[str, Any] | None = None

        def event(final: bool) -> dict[str, Any]:
            meta = {"id": rid, "finish_reason": finish if final else None, "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(ids), "weight_version": versions[-1] if versions else self.version,
                    "output_token_versions": list(versions),
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]}
            if body.get("top_logprobs_num"):
                meta["output_top_logprobs"] = [[[lp, t, None], [lp - 1.0, (t + 1) % VOCAB, None]][:body["top_logprobs_num"]]
                                               for lp, t in zip(lps, ids, strict=True)]
            return {"output_ids": list(ids), "meta_info": meta}

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
                nxt = self._next(body, ids, last)
                if nxt is None:
                    finish = {"type": "stop", "matched": last}
                    break
                last = nxt
                ids.append(last)
                self.produced += 1
                lps.append(-0.25)
                versions.append(self.version)
                if self.stop_after is not None and i + 1 >= self.stop_after:
                    finish = {"type": "stop", "matched": last}
                    break
                if body.get("stream"):
                    yield event(False)
        finally:
            del self.running[rid]
        if finish is None:
            finish = {"type": "length", "length": body["sampling_params"]["max_new_tokens"]}
        yield event(True)

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

    async def server_info(self, request: Request) -> JSONResponse:
        return JSONResponse({"version": OWN_ENGINE_VERSION, "weight_version": self.version})


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
