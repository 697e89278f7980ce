"""FastAPI routes of the proxy: OpenAI chat, token-id generate, sessions, rollout control, health.

Every route is a thin shell: validate at the edge (``schemas``), run one turn through the
``GenerationController``, record it in the session (only after every check passed), render.
Errors are ``ProxyError``s rendered as ``{"detail": {"error": <code>, ...}}``; anything else is
a 500 ``{"error": "internal_error"}`` plus a log line — never a stack trace in a response.

The session of a request is named by the ``/s/{session_id}/v1/...`` base URL, the
``X-Session-Id`` header or the body's ``session_id`` (two that disagree: 422); with none, a
fresh ``anon-…`` id is used and returned in the ``X-Session-Id`` response header.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.proxy import openai_format as fmt
from services.proxy.auth import PRINCIPAL
from services.proxy.chat import chat_plan
from services.proxy.errors import InvalidRequest, ProxyError, SessionNotFound, UnsupportedParameter
from services.proxy.guards import Guard
from services.proxy.messages_api import (
    MESSAGES_NO_EFFECT,
    MESSAGES_UNSUPPORTED,
    MessagesRequest,
    message_body,
    message_stream,
    messages_plan,
)
from services.proxy.responses_api import (
    RESPONSES_NO_EFFECT,
    RESPONSES_UNSUPPORTED,
    ResponsesRequest,
    response_body,
    response_stream,
    responses_plan,
)
from services.proxy.runtime import ProxyRuntime
from services.proxy.schemas import (
    CHAT_NO_EFFECT,
    CHAT_UNSUPPORTED,
    ChatRequest,
    CloseSessionsRequest,
    GenerateRequest,
    PauseRequest,
    ResumeRequest,
    RewardReport,
    parse,
    refuse_generate_fields,
    refuse_unknown,
    refuse_unsupported,
)
from services.proxy.sessions import Session, check_session_id
from services.proxy.turns import LiveTurn, TurnPlan, TurnResult, run_turn, run_turns
from shared.edge import BadJson, loads_json
from shared.tasks.reasoning import ReasoningParser

log = logging.getLogger(__name__)
M = TypeVar("M", ChatRequest, ResponsesRequest, MessagesRequest)

MAX_CHOICES = 256  # n per chat call with X-Session-Ids: a GRPO group's samples
TRUE, FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


async def _json_body(request: Request, allow_empty: bool = False) -> Any:
    raw = await request.body()
    if not raw.strip() and allow_empty:
        return {}
    try:
        return loads_json(raw)  # depth, UTF-8 and lone surrogates checked: a 400 with the reason, never a 500
    except BadJson as exc:
        raise InvalidRequest("body", str(exc)) from None


def _session_id(path_sid: str | None, request: Request, body_sid: str | None) -> str:
    given = [(w, v) for w, v in (("path", path_sid), ("X-Session-Id", request.headers.get("x-session-id")),
                                 ("session_id", body_sid)) if v]
    if len({v for _, v in given}) > 1:
        raise InvalidRequest(given[1][0], f"session id {given[1][1]!r} conflicts with {given[0][0]} {given[0][1]!r}")
    return check_session_id(given[0][1], given[0][0]) if given else f"anon-{uuid.uuid4().hex}"


def _partial(request: Request, default: bool) -> bool:
    raw = request.headers.get("x-dressage-partial-rollout")
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in TRUE | FALSE:
        raise InvalidRequest("X-Dressage-Partial-Rollout", "must be 1/true or 0/false")
    return value in TRUE


def choice_sessions(header: str | None) -> list[str] | None:
    """The sessions of ``X-Session-Ids: id0,id1,...`` (one per choice), checked; None without the header."""
    if header is None:
        return None
    sids = [check_session_id(part.strip(), "X-Session-Ids") for part in header.split(",")]
    if len(sids) > MAX_CHOICES or len(set(sids)) != len(sids):
        raise InvalidRequest("X-Session-Ids", f"1-{MAX_CHOICES} distinct session ids, comma-separated")
    return sids


def _session_body(s: Session) -> dict[str, Any]:
    return {**s.summary(), "samples": s.samples()}


def build_app(rt: ProxyRuntime) -> FastAPI:
    """The ASGI app over a runtime (config, tokenizer, engine client, controller, sessions)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await rt.start()
        try:
            yield
        finally:
            await rt.stop()

    app = FastAPI(title="dressage proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = rt

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        body = exc.detail_body()
        if request.url.path.endswith("/v1/messages"):  # Anthropic's shape: {"type": "error", "error": {type, message}}
            body = {"type": "error", **body}
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = [{"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()]
        first = errs[0] if errs else {"field": "body", "message": "invalid"}
        err = InvalidRequest(first["field"], first["message"], errors=errs[:20])
        return JSONResponse(err.detail_body(), status_code=422)

    def token_text(ids: list[int]) -> str:
        return rt.decode(ids, skip_special_tokens=False)

    async def surface(request: Request, path_sid: str | None, unsupported: dict[str, tuple[Any, str]],
                      no_effect: frozenset[str], model: type[M], plan_of: Callable[[M], TurnPlan], whole: Callable[[TurnResult, M], Any],
                      streamed: Callable[[LiveTurn, M], AsyncIterator[bytes]]) -> Response:
        """One model call on any API surface: validate, plan, run (whole or streamed), render."""
        raw = await _json_body(request)
        refuse_unsupported(raw, unsupported)
        refuse_unknown(raw, model, unsupported, no_effect)
        req = parse(model, raw, rt.limits)
        sid = _session_id(path_sid, request, getattr(req, "session_id", None))
        partial = _partial(request, rt.cfg.partial_rollout)
        plan = plan_of(req)
        headers = {"X-Session-Id": sid}
        if not plan.stream:
            return JSONResponse(whole(await run_turn(rt, sid, partial, plan), req), headers=headers)
        live = await LiveTurn.start(rt, sid, partial, plan)
        await live.started()  # a refusal before the turn is admitted is still an HTTP error; later ones are in-band
        return StreamingResponse(streamed(live, req), media_type="text/event-stream", headers=headers)

    def reasoning_of(req: ChatRequest) -> ReasoningParser | None:
        """The reasoning split of a whole (not streamed) chat completion: ``proxy.reasoning_parser`` unless
        the request asks ``separate_reasoning: false``."""
        return rt.cfg.reasoning_parser if req.separate_reasoning else None

    def chat_logprobs(req: ChatRequest) -> int | None:
        return (req.top_logprobs or 0) if req.logprobs else None

    async def chat_choices(request: Request, path_sid: str | None, sids: list[str]) -> Response:
        """``n`` choices, choice i generated and recorded in session ``sids[i]`` (``X-Session-Ids``), as
        n requests would be: one HTTP call for a GRPO group's shared first turn. All or nothing: the
        first refusal is the answer (choices that finished stay recorded in their sessions)."""
        raw = await _json_body(request)
        if not isinstance(raw, dict) or raw.get("n", 1) != len(sids):
            raise InvalidRequest("n", f"must equal the {len(sids)} sessions X-Session-Ids names")
        body = {k: v for k, v in raw.items() if k != "n"}
        refuse_unsupported(body, CHAT_UNSUPPORTED)
        refuse_unknown(body, ChatRequest, CHAT_UNSUPPORTED, CHAT_NO_EFFECT)
        req = parse(ChatRequest, body, rt.limits)
        if path_sid or request.headers.get("x-session-id") or req.session_id:
            raise InvalidRequest("X-Session-Ids", "names every choice's session: send no other session id")
        plan = chat_plan(req, rt.cfg.max_tokens_limit)
        if plan.stream:
            raise UnsupportedParameter("stream", "n > 1 choices are not streamed")
        partial = _partial(request, rt.cfg.partial_rollout)
        plans = [plan if plan.seed is None else replace(plan, seed=(plan.seed + i) % (1 << 63)) for i in range(len(sids))]
        done = await run_turns(rt, sids, partial, plans)
        for res in done:
            if isinstance(res, BaseException):
                raise res
        bodies = [fmt.chat_completion(res, rt.model_name, chat_logprobs(req), req.return_token_ids, token_text,
                                      reasoning_of(req))
                  for res in done if not isinstance(res, BaseException)]
        return JSONResponse(fmt.merge_choices(bodies), headers={"X-Session-Ids": ",".join(sids)})

    async def chat(request: Request, path_sid: str | None) -> Response:
        if (sids := choice_sessions(request.headers.get("x-session-ids"))) is not None:
            return await chat_choices(request, path_sid, sids)
        return await surface(
            request, path_sid, CHAT_UNSUPPORTED, CHAT_NO_EFFECT, ChatRequest, lambda r: chat_plan(r, rt.cfg.max_tokens_limit),
            lambda res, r: fmt.chat_completion(res, rt.model_name, chat_logprobs(r), r.return_token_ids, token_text,
                                               reasoning_of(r)),
            lambda live, r: fmt.chat_stream(live, rt.model_name, bool(r.stream_options and r.stream_options.include_usage),
                                            chat_logprobs(r), r.return_token_ids, token_text))

    async def generate(request: Request, path_sid: str | None) -> Response:
        req = parse(GenerateRequest, refuse_generate_fields(await _json_body(request)), rt.limits)
        sid = _session_id(path_sid, request, req.session_id)
        sp = req.sampling_params
        ids = req.input_ids if req.input_ids is not None else [
            int(i) for i in rt.tokenizer.encode(req.text or "", add_special_tokens=False)]
        plan = TurnPlan(messages=[], max_new_tokens=sp.max_new_tokens or rt.cfg.max_tokens_limit,
                        stops=sp.stop_strings(), temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                        seed=sp.sampling_seed, engine_params=sp.engine_params(),
                        stop_token_ids=sp.stop_token_ids, skip_special_tokens=sp.skip_special_tokens,
                        no_stop_trim=sp.no_stop_trim)
        res = await run_turn(rt, sid, _partial(request, rt.cfg.partial_rollout), plan, prompt_ids=ids)
        body = fmt.token_response(res, res.output.final_text, req.rid, req.return_logprob)
        return JSONResponse(body, headers={"X-Session-Id": sid})

    async def responses(request: Request, path_sid: str | None) -> Response:
        return await surface(request, path_sid, RESPONSES_UNSUPPORTED, RESPONSES_NO_EFFECT, ResponsesRequest,
                             lambda r: responses_plan(r, rt.cfg.max_tokens_limit),
                             lambda res, r: response_body(res, r, rt.model_name),
                             lambda live, r: response_stream(live, r, rt.model_name))

    async def messages(request: Request, path_sid: str | None) -> Response:
        return await surface(request, path_sid, MESSAGES_UNSUPPORTED, MESSAGES_NO_EFFECT, MessagesRequest, messages_plan,
                             lambda res, r: message_body(res, rt.model_name),
                             lambda live, r: message_stream(live, rt.model_name))

    async def responses_route(request: Request) -> Response:
        return await responses(request, request.path_params.get("session_id"))

    async def messages_route(request: Request) -> Response:
        return await messages(request, request.path_params.get("session_id"))

    async def chat_route(request: Request) -> Response:
        return await chat(request, request.path_params.get("session_id"))

    async def generate_route(request: Request) -> Response:
        return await generate(request, request.path_params.get("session_id"))

    # The hot path as plain Starlette routes: no per-request dependency injection.
    for prefix in ("", "/s/{session_id}"):
        app.add_route(f"{prefix}/v1/chat/completions", chat_route, methods=["POST"])
        app.add_route(f"{prefix}/v1/generate", generate_route, methods=["POST"])
        app.add_route(f"{prefix}/v1/responses", responses_route, methods=["POST"])
        app.add_route(f"{prefix}/v1/messages", messages_route, methods=["POST"])

    @app.get("/v1/models")
    @app.get("/s/{session_id}/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": rt.model_name, "object": "model", "owned_by": "dressage"}]}

    def _known(session_id: str) -> Session:
        """The session, if the caller's credential may see it (``services.proxy.auth``); else 404."""
        return rt.sessions.get(check_session_id(session_id, "session_id"), principal=PRINCIPAL.get())

    async def report_reward(request: Request) -> Response:
        """The agent's own reward for its session (``/s/{session}/v1/reward`` only: a session token is valid
        for its own session, so a report for another session is refused by the guard, 403). The session
        must exist (it made a model call) and not be finalized: 404 / 409 otherwise."""
        req = parse(RewardReport, await _json_body(request))
        s = _known(str(request.path_params["session_id"]))
        s.report_reward(req.reward, req.components)
        return JSONResponse({"session_id": s.session_id, **(s.agent_reward or {})})

    app.add_route("/s/{session_id}/v1/reward", report_reward, methods=["POST"])

    @app.get("/v1/sessions/{session_id}")
    async def read_session(session_id: str) -> dict[str, Any]:
        return _session_body(_known(session_id))

    @app.post("/v1/sessions/{session_id}/finalize")
    async def finalize_session(session_id: str) -> dict[str, Any]:
        s = _known(session_id)
        async with s.lock:  # a running turn is recorded first
            s.finalized = True
        return _session_body(s)

    async def close_sessions(request: Request) -> Response:
        """Finalize, read and drop many sessions at once: one call per GRPO group instead of two per
        trajectory. Ids the caller may not see are listed as ``missing`` (as a 404 would say)."""
        req = parse(CloseSessionsRequest, await _json_body(request))
        closed, missing = await rt.sessions.close(req.session_ids, principal=PRINCIPAL.get())
        rt.metrics.sessions.set(len(rt.sessions))
        records = {s.session_id: _session_body(s) for s in closed} if req.records else {}
        return JSONResponse({"closed": [s.session_id for s in closed], "missing": missing, "records": records})

    app.add_route("/v1/sessions/close", close_sessions, methods=["POST"])  # before /v1/sessions/{id}: plain route

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        _known(session_id)
        if not rt.sessions.delete(session_id):
            raise SessionNotFound(f"unknown or expired session {session_id!r}", session_id=session_id)
        rt.metrics.sessions.set(len(rt.sessions))
        return {"session_id": session_id, "deleted": True}

    @app.post("/v1/rollout/pause")
    async def pause(request: Request) -> dict[str, Any]:
        req = parse(PauseRequest, await _json_body(request, allow_empty=True))
        return await rt.controller.pause(session_id=req.session_id, timeout_s=req.timeout_s, reason=req.reason)

    @app.post("/v1/rollout/resume")
    async def resume(request: Request) -> dict[str, Any]:
        req = parse(ResumeRequest, await _json_body(request, allow_empty=True))
        return await rt.controller.resume(session_id=req.session_id, version=req.version)

    @app.get("/v1/rollout/state")
    async def rollout_state() -> dict[str, Any]:
        return rt.state()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "time": time.time(), "engines": len(rt.client.engines),
                "partial_rollout": rt.cfg.partial_rollout,
                "max_partial_rollout_preempts": rt.cfg.max_partial_rollout_preempts,
                "version": rt.controller.current_version, "paused": not rt.controller.runnable(""),
                "sessions": len(rt.sessions)}

    @app.get("/metrics")
    async def metrics() -> Response:
        rt.metrics.sessions.set(len(rt.sessions))
        data, ctype = rt.metrics.render()
        return Response(data, media_type=ctype)

    api_key = rt.cfg.api_key.get_secret_value() if rt.cfg.api_key else None
    operator_key = rt.cfg.operator_key.get_secret_value() if rt.cfg.operator_key else None
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=rt.cfg.max_body_bytes, metrics=rt.metrics,
                       operator_key=operator_key)
    return app
