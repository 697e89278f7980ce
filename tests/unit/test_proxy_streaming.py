"""Streams on the three surfaces over the fake engine: when they open, how a malformed tool call
ends, and how a refusal after they opened is reported (in-band, with the staleness fields)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from proxy_fake_engine import FakeEngine
from test_proxy_app import run_proxy
from test_proxy_openai import CALL, MSG, TOOLS, ids, sse_data, sse_events
from waits import async_wait_for

from services.proxy.app import build_app
from services.proxy.runtime import ProxyRuntime

PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]
BAD = '<tool_call>\n{"name": "lookup", "arguments": {"key": qzt}}\n</tool_call>'  # invalid JSON arguments


def body(path: str, **extra: Any) -> dict[str, Any]:
    """A request for ``path`` with the lookup tool (``force``: a forced call of it)."""
    force = extra.pop("force", False)
    if path.endswith("responses"):
        out: dict[str, Any] = {"input": MSG[0]["content"], "max_output_tokens": 200,
                               "tools": [{"type": "function", **TOOLS[0]["function"]}]}
        choice: Any = {"type": "function", "name": "lookup"}
    elif path.endswith("messages"):
        out = {"messages": MSG, "max_tokens": 200,
               "tools": [{"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}]}
        choice = {"type": "tool", "name": "lookup"}
    else:
        out = {"messages": MSG, "max_tokens": 200, "tools": TOOLS}
        choice = {"type": "function", "function": {"name": "lookup"}}
    return {**out, **({"tool_choice": choice} if force else {}), **extra}


async def open_stream(app: Any, path: str, payload: dict[str, Any]) -> tuple[asyncio.Queue[Any], asyncio.Task[None]]:
    """Run one request on the ASGI app itself and hand over what it sends, as it sends it
    (httpx's ASGI transport would only return once the whole response was written)."""
    sent: asyncio.Queue[Any] = asyncio.Queue()
    request = [{"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}]
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"proxy")],
             "server": ("proxy", 80), "client": ("test", 1)}
    return sent, asyncio.create_task(app(scope, receive, send))


def tool_arguments(path: str, text: str) -> str:
    """The streamed call's arguments, its pieces concatenated, on any surface."""
    if path.endswith("completions"):
        return "".join(tc["function"]["arguments"] for ch in sse_data(text) for tc in
                       ch["choices"][0]["delta"].get("tool_calls", []) if ch["choices"])
    events = sse_events(text)
    if path.endswith("responses"):
        return "".join(d["delta"] for k, d in events if k == "response.function_call_arguments.delta")
    return "".join(d["delta"].get("partial_json", "") for k, d in events if k == "content_block_delta")


@pytest.mark.parametrize(("path", "opening"), [("/v1/chat/completions", '"role": "assistant"'),
                                               ("/v1/responses", "response.created"), ("/v1/messages", "message_start")])
def test_a_stream_opens_as_soon_as_the_turn_is_admitted_and_a_forced_call_is_named_at_once(path: str,
                                                                                          opening: str) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        await rt.controller.pause(reason="test")  # the turn is admitted, then waits for the resume
        sent, task = await open_stream(build_app(rt), path, body(path, force=True, stream=True))
        start = await asyncio.wait_for(sent.get(), 5)
        assert (start["type"], start["status"]) == ("http.response.start", 200)
        head = ""
        while '"lookup"' not in head:  # the role chunk / opening event, then the call's start
            head += (await asyncio.wait_for(sent.get(), 5))["body"].decode()
        assert opening in head.split("\n\n")[0] and eng.generate_bodies == []  # nothing generated yet
        await rt.controller.resume(version="a")
        await asyncio.wait_for(task, 10)
        rest = []
        while not sent.empty():
            rest.append(sent.get_nowait()["body"].decode())
        assert tool_arguments(path, head + "".join(rest)) == '{"key": "qzt"}'
    run_proxy(t, engine=FakeEngine(script=ids(CALL), step_s=0.005))


@pytest.mark.parametrize("path", PATHS)
def test_a_streamed_call_that_turns_out_malformed_ends_as_the_whole_answer_does(path: str) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        whole = (await c.post(path, json=body(path), headers={"X-Session-Id": "whole"})).json()
        text = (await c.post(path, json=body(path, stream=True), headers={"X-Session-Id": "streamed"})).text
        if path.endswith("completions"):
            chunks = [ch for ch in sse_data(text) if ch["choices"]]
            assert whole["choices"][0]["message"] == {"role": "assistant", "content": BAD}
            assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == BAD
            assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "stop"
        elif path.endswith("responses"):
            events = sse_events(text)
            dropped = next(d["item"] for k, d in events if k == "response.output_item.done"
                           and d["item"]["type"] == "function_call")
            assert dropped["status"] == "incomplete"  # started once its name was written, never completed
            final = events[-1][1]["response"]
            messages = [o for o in final["output"] if o["type"] == "message"]
            assert [m["content"][0]["text"] for m in messages] == [whole["output"][0]["content"][0]["text"]] == [BAD]
            assert [o["type"] for o in whole["output"]] == ["message"] and final["status"] == "completed"
        else:
            events = sse_events(text)
            streamed = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta"
                               and d["delta"]["type"] == "text_delta")
            assert streamed == whole["content"][0]["text"] == BAD and len(whole["content"]) == 1
            stop = next(d for k, d in events if k == "message_delta")["delta"]["stop_reason"]
            assert stop == whole["stop_reason"] == "end_turn"
        for sid in ("whole", "streamed"):  # counted alike: the training metric does not depend on streaming
            (sample,) = rt.sessions.get(sid).samples()
            assert (sample["meta"]["tool_calls"], sample["meta"]["malformed_tool_calls"]) == (0, 1)
    run_proxy(t, engine=FakeEngine(script=ids(BAD)))


@pytest.mark.parametrize("path", PATHS)
def test_a_refusal_after_the_stream_opened_is_in_band_and_keeps_the_staleness_fields(path: str) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        sid = {"X-Session-Id": "late"}
        plain = {k: v for k, v in body(path).items() if k not in ("tools",)}
        assert (await c.post(path, json=plain, headers=sid)).status_code == 200  # version a
        await rt.controller.pause()
        eng.version = "b"
        await rt.controller.resume(version="b")
        assert (await c.post(path, json=plain, headers=sid)).status_code == 200  # b: two versions, the limit
        await rt.controller.pause()
        streamed = asyncio.create_task(c.post(path, json={**plain, "stream": True}, headers=sid))
        await async_wait_for(lambda: rt.limit.in_flight == 1, what="the streamed turn admitted, waiting")
        eng.version = "c"
        await rt.controller.resume(version="c")  # a third version: refused before the chunk is sent
        r = await streamed
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        if path.endswith("completions"):
            err = sse_data(r.text)[-1]["error"]
            assert "data: [DONE]" not in r.text
        else:
            events = sse_events(r.text)
            kinds = [k for k, _ in events]
            assert "error" in kinds and not {"response.completed", "message_stop"} & set(kinds)
            event = events[kinds.index("error")][1]
            err = event if path.endswith("responses") else event["error"]
            if path.endswith("responses"):  # then the response's own end, as OpenAI streams a failure
                assert kinds[-1] == "response.failed"
                failed = events[-1][1]["response"]
                assert failed["status"] == "failed" and failed["error"]["code"] == err["code"]
                assert failed["error"]["max_preempts"] == 1 and failed["error"]["message"] == err["message"]
        assert err["code"] == "partial_rollout_staleness_exceeded" and err["max_preempts"] == 1
        assert "versions" in err and "version_span" in err and err["message"]
        assert len(eng.generate_bodies) == 2  # the refused chunk never reached the engine
    run_proxy(t, max_partial_rollout_preempts=1)
