"""Response shapes: OpenAI ``chat.completion`` (and its pseudo-stream), SGLang-like token responses.

Pure functions of a finished ``Generation``. ``stream: true`` is answered as a *pseudo-stream*:
the generation runs to completion first (it may be preempted and resumed, and it may be refused
by a version check — a refusal must stay an HTTP error, which a started stream could not carry),
then the text is sent as SSE ``chat.completion.chunk`` events and ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from services.proxy.controller import Generation
from shared.staleness import ordered_real_versions

OPENAI_FINISH = {"stop": "stop", "length": "length"}
STREAM_PIECE_CHARS = 16


def _extension(gen: Generation, session_id: str, segment_index: int) -> dict[str, Any]:
    """The ``dressage`` block: which versions produced this response and how it was stitched."""
    return {"session_id": session_id, "segment_index": segment_index,
            "weight_version": gen.versions[-1] if gen.versions else None,
            "versions": ordered_real_versions(dict.fromkeys(gen.versions)), "preempts": gen.preempts,
            "partial_rollout_chunks": gen.chunks}


def chat_completion(gen: Generation, text: str, prompt_tokens: int, model: str, session_id: str,
                    segment_index: int) -> dict[str, Any]:
    n_out = len(gen.output_ids)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": OPENAI_FINISH.get(gen.finish_reason, "stop"), "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out},
        "dressage": _extension(gen, session_id, segment_index),
    }


def chat_stream(completion: dict[str, Any], include_usage: bool) -> Iterator[bytes]:
    """SSE events of a finished ``chat_completion`` (role, text pieces, finish, [usage], [DONE])."""
    base = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}
    choice = completion["choices"][0]
    text: str = choice["message"]["content"]

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    yield event({"role": "assistant", "content": ""})
    for i in range(0, len(text), STREAM_PIECE_CHARS):
        yield event({"content": text[i:i + STREAM_PIECE_CHARS]})
    yield event({}, choice["finish_reason"], dressage=completion["dressage"])
    if include_usage:
        yield b"data: " + json.dumps({**base, "choices": [], "usage": completion["usage"]}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def token_response(gen: Generation, text: str | None, prompt_tokens: int, session_id: str,
                   segment_index: int) -> dict[str, Any]:
    """``/v1/generate`` answer, in SGLang's ``/generate`` shape so one parser reads both."""
    return {
        "text": text,
        "output_ids": gen.output_ids,
        "session_id": session_id,
        "meta_info": {
            "finish_reason": {"type": gen.finish_reason},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(gen.output_ids),
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(gen.logprobs, gen.output_ids, strict=True)],
            "output_token_versions": gen.versions,
            **_extension(gen, session_id, segment_index),
        },
    }
