"""FastAPI shell of the engine: SGLang's HTTP routes over the `EngineService`.

Invariant: handlers never touch the model or the KV cache (see `service.py`). Errors: a
malformed body or unknown field is 422 naming the field; a field SGLang accepts but this engine
cannot apply is 400 ``{"error": {"message", "param"}}`` naming it (SGLang's status); a live
duplicate ``rid`` is 400; a full queue is 503 with ``Retry-After``; a checkpoint that cannot be
loaded is 400 with ``{"success": false, "message"}`` (SGLang's shape) and leaves the old weights
serving. Every route is listed in docs/engine.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from services.engine.metrics import CONTENT_TYPE, registry_for, scrape
from services.engine.protocol import AbortBody, GenerateBody, PauseBody, UpdateWeightsBody
from services.engine.requests import (
    DuplicateRequest,
    EngineBusy,
    GenRequest,
    InvalidRequest,
    UnsupportedField,
)
from services.engine.service import EngineService
from services.engine.weights import WeightLoadError
from shared.sglang_fields import OWN_ENGINE_VERSION

__all__ = ["EngineService", "build_app"]
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

log = logging.getLogger(__name__)


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def build_app(service: EngineService) -> FastAPI:
    app = FastAPI(title="dressage engine", docs_url=None, redoc_url=None)
    sched = service.scheduler

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        loc = ["body", *exc.field.replace("[", ".").replace("]", "").split(".")]
        return JSONResponse({"detail": [{"loc": loc, "msg": str(exc), "type": "value_error"}]}, 422)

    @app.exception_handler(UnsupportedField)
    async def _unsupported(_: Request, exc: UnsupportedField) -> JSONResponse:
        log.info("refused field=%s: %s", exc.field, exc)
        return JSONResponse({"error": {"message": str(exc), "type": "unsupported_field", "param": exc.field}}, 400)

    @app.exception_handler(DuplicateRequest)
    async def _duplicate(_: Request, exc: DuplicateRequest) -> JSONResponse:
        return _error(400, "duplicate_rid", str(exc))

    @app.exception_handler(EngineBusy)
    async def _busy(_: Request, exc: EngineBusy) -> JSONResponse:
        return _error(503, "engine_busy", str(exc), {"Retry-After": "1"})

    @app.exception_handler(WeightLoadError)
    async def _weights(_: Request, exc: WeightLoadError) -> JSONResponse:
        log.warning("weight update refused: %s version=%s", exc, sched.weight_version)
        return JSONResponse({"success": False, "message": str(exc)}, 400)

    registry = registry_for(service)

    @app.post("/generate")
    async def generate(body: GenerateBody) -> Response:
        if body.stream:
            prepared = await service.prepare(body)  # refusals and bad values answer before the stream starts
            return StreamingResponse(service.stream(body, prepared), media_type="text/event-stream")
        # Plain JSON types already: skip FastAPI's per-element jsonable_encoder pass.
        return JSONResponse(await service.generate(body))

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> dict[str, Any]:
        message = body.abort_message or "aborted by request"
        if body.abort_all:
            return {"aborted": await asyncio.wrap_future(sched.abort_all(message))}
        found: bool = await asyncio.wrap_future(sched.abort(body.rid, message))
        return {"aborted": int(found)}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseBody | None = None) -> dict[str, Any]:
        mode = body.mode if body else "abort"
        n = await asyncio.wrap_future(sched.pause(mode))
        return {"status": "ok", "mode": mode, "aborted": n}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        await asyncio.wrap_future(sched.resume())
        return {"status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsBody) -> dict[str, Any]:
        return await service.update_weights(body)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # No prefix cache here: the batch cache holds only in-flight rows, so there is nothing to flush.
        return PlainTextResponse("Cache flushed.\n(this engine keeps no prefix cache; nothing was held)\n")

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        c = sched.counts()
        return [{"dp_rank": 0, "num_reqs": c["running"] + c["waiting"], "num_waiting_reqs": c["waiting"],
                 "num_tokens": sched.kv_tokens() + sched.waiting_tokens()}]

    @app.get("/v1/loads")
    async def v1_loads(include: str | None = None, dp_rank: int | None = None,
                       format: str | None = None) -> Response:  # noqa: A002 (SGLang's query name)
        sections = {s.strip() for s in include.split(",")} if include else {"all"}
        bad = sorted(sections - LOAD_SECTIONS)
        if bad:
            return JSONResponse({"detail": f"Invalid include sections: {bad}. Valid options: "
                                           f"{sorted(LOAD_SECTIONS)}"}, 400)
        if dp_rank not in (None, 0):
            return JSONResponse({"detail": f"dp_rank {dp_rank} does not exist (this engine has rank 0)"}, 400)
        load = service.loads()
        if not sections & {"all", "core"}:
            load = {k: v for k, v in load.items() if k in ("dp_rank", "timestamp") or isinstance(v, dict)}
        if not sections & {"all", "queues"}:
            load.pop("queues", None)
        if format == "prometheus":
            lines = []
            for key, value in load.items():
                items = value.items() if isinstance(value, dict) else [(None, value)]
                for sub, v in items:
                    if isinstance(v, bool) or not isinstance(v, int | float) or key in ("dp_rank", "timestamp"):
                        continue
                    name = f"sglang_{key}_{sub}" if sub else f"sglang_{key}"
                    lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="0"}} {v}']
            return PlainTextResponse("\n".join(lines) + "\n", media_type=CONTENT_TYPE)
        return JSONResponse({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "version": OWN_ENGINE_VERSION, "accelerator": None, "num_accelerators": 0,
                             "loads": [load]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(scrape(registry), media_type=CONTENT_TYPE)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return service.model_info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": sched.weight_version}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        # ``version`` tells the proxy this is not SGLang (whose ``version`` is its release number).
        return {**service.model_info(), **sched.counts(), "version": OWN_ENGINE_VERSION}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = sched.alive
        return JSONResponse({"status": "ok" if ok else "scheduler_dead", **sched.counts()}, 200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        if sched.paused:
            return JSONResponse({"status": "paused"}, 200)
        req = GenRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=[0], max_new_tokens=1)
        try:
            res = await asyncio.wait_for(service.run(req), timeout=20)
        except TimeoutError:
            return JSONResponse({"status": "timeout"}, 503)
        return JSONResponse({"status": "ok", "tokens": len(res.output_ids)}, 200)

    return app
