"""Anthropic Messages API (``POST /v1/messages``, whole and streamed) on the shared turn core.

``system`` + ``messages`` (text, ``tool_use`` and ``tool_result`` blocks) become chat-template
messages and ``tools`` (``input_schema``) chat tools; the turn runs like a chat turn. The answer is
a ``message`` with ``text`` and ``tool_use`` content blocks and Anthropic's ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``); streaming sends Anthropic's
events (``message_start``, ``content_block_start/delta/stop``, ``message_delta``,
``message_stop``) as tokens are produced, a ``tool_use`` block's ``input_json_delta`` pieces as its
arguments are written; a refusal after the stream opened is one ``error`` event with the
error's staleness fields. Forced tool use (``tool_choice`` ``any`` / ``tool``) is
served as for chat (``turns.forced_tool``). Images, documents, server tools, extended thinking and
any field not implemented here (``MESSAGES_NO_EFFECT`` aside) are refused (400 naming the field).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.proxy.errors import ProxyError, UnsupportedParameter
from services.proxy.openai_format import dressage_block, sse
from services.proxy.turns import LiveTurn, TurnPlan, TurnResult, forced_tool, refuse_strict
from shared.toolcalls import ArgsDelta, CallStart, TextPiece, ToolCall

MESSAGES_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "thinking": (None, "this policy has no extended thinking"),
    "mcp_servers": (None, "MCP servers are not available"),
    "container": (None, "code-execution containers are not available"),
}


MESSAGES_NO_EFFECT = frozenset({"metadata", "service_tier"})


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, max_length=256)
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    session_id: str | None = Field(default=None, min_length=1, max_length=256)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise UnsupportedParameter(where, "content must be a string or a list of blocks")
    return content


def _text_of(blocks: Any, where: str) -> str:
    out = []
    for j, b in enumerate(_blocks(blocks, where)):
        if b.get("type") != "text":
            raise UnsupportedParameter(f"{where}.{j}.type", f"block {b.get('type')!r} cannot be read by a text-only "
                                                            "policy")
        out.append(str(b.get("text", "")))
    return "".join(out)


def messages_of(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        role, text, calls = m.get("role"), [], []
        if role not in ("user", "assistant"):
            raise UnsupportedParameter(f"messages.{i}.role", f"role {role!r} is not supported")
        for j, b in enumerate(_blocks(m.get("content"), f"messages.{i}.content")):
            kind = b.get("type")
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text_of(b.get("content") or "", f"messages.{i}.content.{j}.content")})
            else:
                raise UnsupportedParameter(f"messages.{i}.content.{j}.type",
                                           f"block {kind!r} is not supported in a {role} message")
        if text or calls or not any(b.get("type") == "tool_result" for b in _blocks(m.get("content"), "")):
            msg: dict[str, Any] = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def messages_plan(req: MessagesRequest) -> TurnPlan:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.get("type") not in (None, "custom"):
            raise UnsupportedParameter(f"tools.{i}.type", f"server tool {t.get('type')!r} is not available")
        refuse_strict([(f"tools.{i}.strict", t.get("strict"))])
        tools.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                       "parameters": t.get("input_schema")}})
    choice = (req.tool_choice or {}).get("type", "auto")
    if choice not in ("auto", "none", "any", "tool"):
        raise UnsupportedParameter("tool_choice", f"tool_choice type {choice!r} is not one of auto, none, any, tool")
    force = forced_tool(tools, None if choice == "any" else str((req.tool_choice or {}).get("name"))) \
        if choice in ("any", "tool") else None
    one = bool((req.tool_choice or {}).get("disable_parallel_tool_use"))  # at most one tool_use block
    return TurnPlan(messages=messages_of(req), max_new_tokens=req.max_tokens, tools=tools or None, force_tool=force,
                    one_tool_call=one,
                    parse_tools=choice != "none", stops=tuple(req.stop_sequences or ()), temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, stream=req.stream)


def _tool_block(call: ToolCall | CallStart) -> dict[str, Any]:
    """A ``tool_use`` block; a call still being written has an empty input (its JSON streams after)."""
    return {"type": "tool_use", "id": f"toolu_{call.id[5:]}", "name": call.name,
            "input": json.loads(call.arguments) if isinstance(call, ToolCall) else {}}


def stop_reason(res: TurnResult) -> str:
    if res.output.tool_calls():
        return "tool_use"
    if res.output.matched_stop is not None:
        return "stop_sequence"
    return "max_tokens" if res.gen.finish_reason == "length" else "end_turn"


def _head(model: str, input_tokens: int) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}


def message_body(res: TurnResult, model: str) -> dict[str, Any]:
    text = res.output.content()
    content = ([{"type": "text", "text": text}] if text else []) + [_tool_block(c) for c in res.output.tool_calls()]
    return {**_head(model, len(res.prompt_ids)), "content": content, "stop_reason": stop_reason(res),
            "stop_sequence": res.output.matched_stop,
            "usage": {"input_tokens": len(res.prompt_ids), "output_tokens": len(res.gen.output_ids)},
            "dressage": dressage_block(res.gen, res.session_id, res.segment)}


async def message_stream(live: LiveTurn, model: str) -> AsyncIterator[bytes]:
    def event(kind: str, **data: Any) -> bytes:
        return sse({"type": kind, **data}, event=kind)

    yield event("message_start", message=_head(model, len(live.prompt_ids)))
    index, text_open = 0, False
    async for batch in live.events():
        for ev in batch:
            if isinstance(ev, TextPiece):
                if not text_open:
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    text_open = True
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": ev.text})
            elif isinstance(ev, CallStart):
                if text_open:
                    yield event("content_block_stop", index=index)
                    index, text_open = index + 1, False
                yield event("content_block_start", index=index, content_block=_tool_block(ev))
            elif isinstance(ev, ArgsDelta):
                yield event("content_block_delta", index=index,
                            delta={"type": "input_json_delta", "partial_json": ev.text})
            else:  # ToolCall, or CallDropped (its text follows in a text block)
                yield event("content_block_stop", index=index)
                index += 1
    if text_open:
        yield event("content_block_stop", index=index)
    try:
        res = live.result()
    except ProxyError as exc:  # Anthropic's in-band error: {type, message} and the staleness fields
        yield event("error", error=exc.detail_body()["error"])
        return
    yield event("message_delta", delta={"stop_reason": stop_reason(res), "stop_sequence": res.output.matched_stop},
                usage={"output_tokens": len(res.gen.output_ids)},
                dressage=dressage_block(res.gen, res.session_id, res.segment))
    yield event("message_stop")
