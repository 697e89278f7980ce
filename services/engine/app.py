"""FastAPI shell of the engine: SGLang's HTTP routes over the `Scheduler`.

Invariant: handlers never touch the model or the KV cache. They validate the body, hand a
request or a command to the scheduler thread and await its future, so the event loop stays
free while tokens are computed. Errors: a bad body is 422 naming the field; a live duplicate
``rid`` is 400; a full queue is 503 with ``Retry-After``; a checkpoint that cannot be loaded is
400 with ``{"success": false, "message"}`` (SGLang's shape) and leaves the old weights serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.engine.protocol import (
    AbortBody,
    GenerateBody,
    PauseBody,
    UpdateWeightsBody,
    generate_response,
)
from services.engine.requests import DuplicateRequest, EngineBusy, GenRequest, GenResult, InvalidRequest
from services.engine.sampling import SamplingSpec
from services.engine.scheduler import Scheduler
from services.engine.weights import WeightLoadError, check_state, read_checkpoint

log = logging.getLogger(__name__)


class EngineService:
    """Async operations of the engine; everything model-related goes through the scheduler."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any | None, *, eos_ids: Iterable[int] = (),
                 max_new_tokens_limit: int = 4096, tokenizer_path: str | None = None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer  # None: only input_ids in, empty text out
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.max_new_tokens_limit = max_new_tokens_limit
        self.tokenizer_path = tokenizer_path
        self._update_lock = asyncio.Lock()  # weight updates apply in call order

    def _prompt_ids(self, body: GenerateBody) -> list[int]:
        if body.input_ids is not None:
            return body.input_ids
        if self.tokenizer is None:
            raise InvalidRequest("text", "this engine has no tokenizer; send input_ids")
        return [int(i) for i in self.tokenizer.encode(body.text or "")]

    def to_request(self, body: GenerateBody) -> GenRequest:
        sp = body.sampling_params
        if sp.max_new_tokens > self.max_new_tokens_limit:
            raise InvalidRequest("sampling_params.max_new_tokens",
                                 f"{sp.max_new_tokens} exceeds this engine's limit {self.max_new_tokens_limit}")
        ids = self._prompt_ids(body)
        if body.return_logprob and body.logprob_start_len >= len(ids):
            raise InvalidRequest("logprob_start_len", f"{body.logprob_start_len} is not below the prompt "
                                                      f"length {len(ids)}")
        stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else self.eos_ids)
        return GenRequest(
            rid=body.rid or uuid.uuid4().hex, input_ids=ids, max_new_tokens=sp.max_new_tokens,
            sampling=SamplingSpec(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                  seed=sp.sampling_seed),
            stop_token_ids=frozenset(stops),
            logprob_start_len=body.logprob_start_len if body.return_logprob else -1,
        )

    async def run(self, req: GenRequest) -> GenResult:
        """Submit `req` and wait for its result; a cancelled caller aborts the request."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenResult] = loop.create_future()

        def settle(res: GenResult) -> None:
            if not fut.done():
                fut.set_result(res)

        def deliver(res: GenResult) -> None:  # runs on the scheduler thread
            loop.call_soon_threadsafe(settle, res)

        self.scheduler.submit(req, deliver)
        try:
            return await fut
        except asyncio.CancelledError:
            self.scheduler.abort(req.rid)
            raise

    async def generate(self, body: GenerateBody) -> dict[str, Any]:
        t0 = time.perf_counter()
        req = self.to_request(body)
        result = await self.run(req)
        tok, skip = self.tokenizer, body.sampling_params.skip_special_tokens
        text = tok.decode(result.output_ids, skip_special_tokens=skip) if tok is not None else ""
        token_texts = input_texts = None
        if body.return_logprob and body.return_text_in_logprobs and tok is not None:
            token_texts = [tok.decode([t]) for t in result.output_ids]
            if result.input_logprobs is not None:
                input_texts = [tok.decode([t]) for t in req.input_ids[body.logprob_start_len:]]
        return generate_response(result, body, req.input_ids, text, token_texts, input_texts,
                                 time.perf_counter() - t0)

    async def update_weights(self, body: UpdateWeightsBody) -> dict[str, Any]:
        async with self._update_lock:
            state = await asyncio.to_thread(read_checkpoint, body.model_path)
            await asyncio.to_thread(check_state, self.scheduler.runner.model, state)
            version = body.weight_version or self.scheduler.weight_version
            if body.weight_version is None:  # SGLang keeps the label too, but tokens get mislabelled
                log.warning("weight update without weight_version: new weights keep version=%s path=%s",
                            version, body.model_path)
            n = await asyncio.wrap_future(
                self.scheduler.swap_weights(state, version, body.model_path, body.abort_all_requests))
        return {"success": True, "message": f"weights of {body.model_path} loaded as version {version}",
                "num_paused_requests": n, "weight_version": version}

    def model_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {"model_path": s.model_path, "tokenizer_path": self.tokenizer_path or s.model_path,
                "is_generation": True, "weight_version": s.weight_version,
                "context_length": s.runner.context_len, "vocab_size": s.runner.vocab_size,
                "max_batch_size": s.max_batch_size, "paused": s.paused,
                "preferred_sampling_params": None}


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def build_app(service: EngineService) -> FastAPI:
    app = FastAPI(title="dressage engine", docs_url=None, redoc_url=None)
    sched = service.scheduler

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        loc = ["body", *exc.field.replace("[", ".").replace("]", "").split(".")]
        return JSONResponse({"detail": [{"loc": loc, "msg": str(exc), "type": "value_error"}]}, 422)

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

    @app.post("/generate")
    async def generate(body: GenerateBody) -> JSONResponse:
        # Plain JSON types already: skip FastAPI's per-element jsonable_encoder pass.
        return JSONResponse(await service.generate(body))

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> dict[str, Any]:
        if body.abort_all:
            return {"aborted": await asyncio.wrap_future(sched.abort_all())}
        found: bool = await asyncio.wrap_future(sched.abort(body.rid))
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

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        return {"success": True}  # no prefix cache: the batch cache holds only in-flight rows

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return service.model_info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": sched.weight_version}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {**service.model_info(), **sched.counts()}

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
