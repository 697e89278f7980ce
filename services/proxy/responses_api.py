"""OpenAI Responses API (``POST /v1/responses``, whole and streamed) on the shared turn core.

``input`` (a string, or items: messages, ``function_call``, ``function_call_output``) and
``instructions`` become chat-template messages; function ``tools`` (Responses' flat shape) become
chat tools; the turn runs like a chat turn (same session, partial rollout, version recording).
The answer is a ``response`` object whose ``output`` holds one ``message`` item (the text) and one
``function_call`` item per tool call. Streaming sends Responses' typed events as the tokens come
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``), the wire
Codex-style CLIs read; a function call as ``output_item.added`` once its name is written, then
``function_call_arguments.delta`` pieces as its arguments are (``shared.toolcalls``); a refusal
after the stream opened as ``error`` then ``response.failed``, with the error's staleness fields. Nothing is stored server-side: ``previous_response_id`` and the other
fields this proxy cannot honour are refused (400 naming the field).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.proxy.errors import ProxyError, UnsupportedParameter
from services.proxy.openai_format import dressage_block, sse
from services.proxy.turns import LiveTurn, TurnPlan, TurnResult, forced_tool, refuse_strict
from shared.toolcalls import ArgsDelta, CallStart, TextPiece, ToolCall

RESPONSES_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "previous_response_id": (None, "responses are not stored; send the whole conversation as input"),
    "conversation": (None, "conversations are not stored; send the whole conversation as input"),
    "prompt": (None, "stored prompt templates are not available"),
    "background": (False, "background responses are not implemented"),
    "reasoning": (None, "this policy has no reasoning controls"),
    "max_tool_calls": (None, "a limit on tool calls cannot be enforced"),
    "top_logprobs": (0, "logprobs are not implemented on /v1/responses; use /v1/chat/completions"),
    "include": ([], "no extra output can be included"),
    "truncation": ("disabled", "automatic truncation is not implemented"),
}
RESPONSES_NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                                 "prompt_cache_retention", "stream_options"})
TEXT_FORMAT = {"format": {"type": "text"}}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, max_length=256)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the turn ends with it)
    session_id: str | None = Field(default=None, min_length=1, max_length=256)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content or []):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise UnsupportedParameter(f"{where}.content.{j}.type", "only text parts can be read by a text-only policy")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def messages_of(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Chat-template messages of ``instructions`` + ``input`` (tool calls merged into their assistant turn)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role", ""), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise UnsupportedParameter(f"input.{i}.role", f"role {item.get('role')!r} is not supported")
            out.append({"role": role, "content": _text(item.get("content"), f"input.{i}")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))})
        else:
            raise UnsupportedParameter(f"input.{i}.type", f"input items of type {kind!r} are not supported")
    return out


def responses_plan(req: ResponsesRequest, default_max_tokens: int) -> TurnPlan:
    if (req.text or {}).get("format") not in (None, {"type": "text"}):
        raise UnsupportedParameter("text.format", "structured output is not implemented")
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.get("type") != "function":
            raise UnsupportedParameter(f"tools.{i}.type", f"hosted tool {t.get('type')!r} is not available")
        refuse_strict([(f"tools.{i}.strict", t.get("strict"))])
        tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                       if k in t}})
    force = None
    if req.tool_choice == "required":
        force = forced_tool(tools, None)
    elif isinstance(req.tool_choice, dict) and req.tool_choice.get("type") == "function":
        force = forced_tool(tools, str(req.tool_choice.get("name")))
    elif req.tool_choice not in (None, "auto", "none"):
        raise UnsupportedParameter("tool_choice", "only auto, none, required or a function tool can be chosen")
    return TurnPlan(messages=messages_of(req), max_new_tokens=req.max_output_tokens or default_max_tokens,
                    tools=tools or None, force_tool=force, one_tool_call=req.parallel_tool_calls is False, parse_tools=req.tool_choice != "none", temperature=req.temperature,
                    top_p=req.top_p, stream=req.stream)


def _message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def _call_item(call: ToolCall | CallStart, arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A ``function_call`` output item; ``arguments`` default: the finished call's."""
    args = arguments if arguments is not None else call.arguments if isinstance(call, ToolCall) else ""
    return {"type": "function_call", "id": f"fc_{call.id[5:]}", "call_id": call.id, "name": call.name,
            "arguments": args, "status": status}


def _envelope(resp_id: str, req: ResponsesRequest, model: str, created: float) -> dict[str, Any]:
    return {"id": resp_id, "object": "response", "created_at": int(created), "model": model, "status": "in_progress",
            "output": [], "error": None, "incomplete_details": None, "instructions": req.instructions,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None, "reasoning": None, "store": False, "text": TEXT_FORMAT,
            "truncation": "disabled", "metadata": {}, "usage": None}


def _finished(env: dict[str, Any], res: TurnResult, output: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(res.gen.output_ids)
    cut = res.gen.finish_reason == "length" and not res.output.tool_calls()
    return {**env, "status": "incomplete" if cut else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": len(res.prompt_ids), "output_tokens": n, "total_tokens": len(res.prompt_ids) + n,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
            "dressage": dressage_block(res.gen, res.session_id, res.segment)}


def response_body(res: TurnResult, req: ResponsesRequest, model: str) -> dict[str, Any]:
    text = res.output.content()
    output = ([_message_item(text, f"msg_{uuid.uuid4().hex}")] if text else []) + [
        _call_item(c) for c in res.output.tool_calls()]
    return _finished(_envelope(f"resp_{uuid.uuid4().hex}", req, model, time.time()), res, output)


async def response_stream(live: LiveTurn, req: ResponsesRequest, model: str) -> AsyncIterator[bytes]:
    env = _envelope(f"resp_{uuid.uuid4().hex}", req, model, time.time())
    seq = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **data}, event=kind)

    yield event("response.created", response=env)
    yield event("response.in_progress", response=env)
    output: list[dict[str, Any]] = []
    msg_id, text = f"msg_{uuid.uuid4().hex}", ""  # the message item being written, if any
    msg_index: int | None = None
    call_index, args = 0, ""  # the function_call item being written and its arguments so far

    def close_text() -> list[bytes]:
        nonlocal msg_index, msg_id, text
        if msg_index is None:
            return []
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        out = [event("response.output_text.done", item_id=msg_id, output_index=msg_index, content_index=0,
                     text=text, logprobs=[]),
               event("response.content_part.done", item_id=msg_id, output_index=msg_index, content_index=0, part=part),
               event("response.output_item.done", output_index=msg_index, item=_message_item(text, msg_id))]
        output[msg_index] = _message_item(text, msg_id)
        msg_index, msg_id, text = None, f"msg_{uuid.uuid4().hex}", ""
        return out

    async for batch in live.events():
        for ev in batch:
            if isinstance(ev, TextPiece):
                if msg_index is None:
                    msg_index = len(output)
                    output.append(_message_item("", msg_id, "in_progress"))
                    yield event("response.output_item.added", output_index=msg_index, item=output[-1])
                    yield event("response.content_part.added", item_id=msg_id, output_index=msg_index, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                text += ev.text
                yield event("response.output_text.delta", item_id=msg_id, output_index=msg_index, content_index=0,
                            delta=ev.text, logprobs=[])
            elif isinstance(ev, CallStart):
                for b in close_text():
                    yield b
                call_index, args = len(output), ""
                output.append(_call_item(ev, "", "in_progress"))
                yield event("response.output_item.added", output_index=call_index, item=output[call_index])
            elif isinstance(ev, ArgsDelta):
                args += ev.text
                yield event("response.function_call_arguments.delta", item_id=output[call_index]["id"],
                            output_index=call_index, delta=ev.text)
            elif isinstance(ev, ToolCall):
                output[call_index] = _call_item(ev)
                yield event("response.function_call_arguments.done", item_id=output[call_index]["id"],
                            output_index=call_index, name=ev.name, arguments=ev.arguments)
                yield event("response.output_item.done", output_index=call_index, item=output[call_index])
            else:  # CallDropped: the call never completes; its text follows as a message
                output[call_index] = {**output[call_index], "arguments": args, "status": "incomplete"}
                yield event("response.output_item.done", output_index=call_index, item=output[call_index])
    for b in close_text():
        yield b
    try:
        res = live.result()
    except ProxyError as exc:  # OpenAI's in-band error, then the response's own end
        err = exc.detail_body()["error"]  # message, type, param, code and the staleness fields
        yield event("error", **{k: v for k, v in err.items() if k != "type"})
        yield event("response.failed", response={**env, "status": "failed", "output": output, "error": err})
        return
    yield event("response.completed", response=_finished(env, res, output))
