"""Response shapes of the OpenAI chat API (whole and streamed) and SGLang-like token responses.

Pure functions of a finished ``TurnResult`` or of the events of a live one. Streaming is real:
``chat_stream`` sends the role chunk as soon as the turn is admitted, then a
``chat.completion.chunk`` for each event as the tokens are produced (a preemption and its resume
inside the turn are invisible: the stream just pauses). A tool call streams as OpenAI's do: a first
``delta.tool_calls`` entry with ``index``, ``id``, ``type`` and ``function.name`` (arguments
``""``) once the model wrote its name, then ``{index, function: {arguments}}`` pieces as it writes
them, which concatenated are the whole response's ``arguments``; with ``logprobs``, the last chunk of each
batch carries the logprobs of the tokens behind its text (``LiveTurn.settled``), so the chunks'
entries concatenated are exactly the whole response's list; then the finish chunk (with the
logprobs of the tokens not sent yet, and ``token_ids`` of the whole response when asked), the usage chunk when
``stream_options.include_usage``, and ``[DONE]``. A turn refused after the stream started ends
with one ``data: {"error": {...}}`` event (OpenAI's in-band error) instead of ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from services.proxy.controller import Generation
from services.proxy.errors import ProxyError
from services.proxy.turns import LiveTurn, TurnResult
from shared.staleness import ordered_real_versions
from shared.tasks.reasoning import ReasoningParser, split_reasoning
from shared.toolcalls import ArgsDelta, CallDropped, CallStart, TextPiece, ToolCall

Decode = Callable[[list[int]], str]


def dressage_block(gen: Generation, session_id: str, segment_index: int) -> dict[str, Any]:
    """The ``dressage`` extension: which versions produced this response and how it was stitched."""
    return {"session_id": session_id, "segment_index": segment_index,
            "weight_version": gen.versions[-1] if gen.versions else None,
            "versions": ordered_real_versions(dict.fromkeys(gen.versions)), "preempts": gen.preempts,
            "partial_rollout_chunks": gen.chunks}


def finish_reason(res: TurnResult) -> str:
    """OpenAI's finish reason; a preemption is never one (partial rollout resumes it)."""
    if res.output.tool_calls():
        return "tool_calls"
    return "length" if res.gen.finish_reason == "length" else "stop"


def logprob_entries(ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[Sequence[tuple[int, float]]],
                    top: int, token_text: Decode, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` entries of tokens ``[start, end)``."""
    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = token_text([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    end = len(ids) if end is None else end
    return [{**entry(ids[i], logprobs[i]), "top_logprobs": [entry(t, v) for t, v in (tops[i] if i < len(tops) else [])[:top]]}
            for i in range(start, end)]


def logprobs_block(res: TurnResult, top: int, token_text: Decode, start: int = 0) -> dict[str, Any]:
    """``choices[].logprobs`` in OpenAI's shape, one entry per returned token (from ``start``)."""
    gen = res.gen
    return {"content": logprob_entries(gen.output_ids, gen.logprobs, gen.top_logprobs, top, token_text, start),
            "refusal": None}


def _usage(res: TurnResult) -> dict[str, int]:
    n = len(res.gen.output_ids)
    return {"prompt_tokens": len(res.prompt_ids), "completion_tokens": n, "total_tokens": len(res.prompt_ids) + n}


def chat_completion(res: TurnResult, model: str, logprobs: int | None, token_ids: bool,
                    token_text: Decode, reasoning_parser: ReasoningParser | None = None) -> dict[str, Any]:
    """``chat.completion`` for a finished turn; ``logprobs``: None (off) or the top-k count. With a
    ``reasoning_parser`` the reasoning block goes to ``message.reasoning_content`` (SGLang's shape; null
    without one) and ``content`` is the text after it (``shared.tasks.reasoning``)."""
    calls = res.output.tool_calls()
    content = res.output.content()
    reasoning: str | None = None
    if reasoning_parser is not None:
        reasoning, content = split_reasoning(content, reasoning_parser)
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning_parser is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason(res),
                              "logprobs": None if logprobs is None else logprobs_block(res, logprobs, token_text)}
    body: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                            "created": int(time.time()), "model": model, "choices": [choice], "usage": _usage(res),
                            "dressage": dressage_block(res.gen, res.session_id, res.segment)}
    if token_ids:
        body["prompt_token_ids"] = res.prompt_ids
        choice["token_ids"] = res.gen.output_ids
    return body


def merge_choices(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``chat.completion`` with n choices from n single-choice ones (choice i is body i's, each
    recorded in its own session): usage counts the shared prompt once, ``dressage.choices`` has each
    choice's block."""
    first = bodies[0]
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    prompt = first["usage"]["prompt_tokens"]
    return {**first, "choices": [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "dressage": {"choices": [b["dressage"] for b in bodies]}}


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + b"data: " + payload.encode() + b"\n\n"


async def chat_stream(live: LiveTurn, model: str, include_usage: bool, logprobs: int | None, token_ids: bool,
                      token_text: Decode) -> AsyncIterator[bytes]:
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": extra.pop("logprobs", None),
                  **extra.pop("choice", {})}
        return sse({**base, "choices": [choice], **extra})

    first: dict[str, Any] = {"prompt_token_ids": live.prompt_ids} if token_ids else {}
    yield chunk({"role": "assistant", "content": ""}, **first)
    n_calls = sent = 0  # tool calls ended; tokens whose logprobs were sent
    out = live.output
    async for batch in live.events():
        deltas: list[dict[str, Any]] = []
        for ev in batch:
            if isinstance(ev, TextPiece):
                deltas.append({"content": ev.text})
            elif isinstance(ev, CallStart):
                deltas.append({"tool_calls": [{"index": n_calls, "id": ev.id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, ArgsDelta):
                deltas.append({"tool_calls": [{"index": n_calls, "function": {"arguments": ev.text}}]})
            elif isinstance(ev, ToolCall | CallDropped):  # the call is over (a dropped one's text follows)
                n_calls += 1
        for i, delta in enumerate(deltas):
            lp: dict[str, Any] = {}
            if logprobs is not None and i == len(deltas) - 1 and live.settled > sent:  # the batch's tokens
                lp = {"logprobs": {"content": logprob_entries(out.ids, out.logprobs, out.tops, logprobs, token_text,
                                                              sent, live.settled), "refusal": None}}
                sent = live.settled
            yield chunk(delta, **lp)
    try:
        res = live.result()
    except ProxyError as exc:
        yield sse(exc.detail_body())
        return
    extra: dict[str, Any] = {"dressage": dressage_block(res.gen, res.session_id, res.segment)}
    if logprobs is not None:  # the tokens not sent yet (the end-of-turn token, text a stop string cut)
        extra["logprobs"] = logprobs_block(res, logprobs, token_text, start=sent)
    if token_ids:
        extra["choice"] = {"token_ids": res.gen.output_ids}
    yield chunk({}, finish_reason(res), **extra)
    if include_usage:
        yield sse({**base, "choices": [], "usage": _usage(res)})
    yield b"data: [DONE]\n\n"


def token_response(res: TurnResult, text: str, rid: str | None, with_logprobs: bool) -> dict[str, Any]:
    """``/v1/generate`` answer, in SGLang's ``/generate`` shape so one parser reads both."""
    gen = res.gen
    finish: dict[str, Any] = {"type": gen.finish_reason}
    if res.output.matched_stop is not None:
        finish = {"type": "stop", "matched": res.output.matched_stop}
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": finish, "prompt_tokens": len(res.prompt_ids),
        "completion_tokens": len(gen.output_ids), "output_token_versions": gen.versions,
        **dressage_block(gen, res.session_id, res.segment),
    }
    if with_logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(gen.logprobs, gen.output_ids, strict=True)]
    return {"text": text, "output_ids": gen.output_ids, "session_id": res.session_id, "meta_info": meta}
