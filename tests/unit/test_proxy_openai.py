"""OpenAI chat as agents use it, over the fake engine: tools, streaming, stop strings, logprobs, errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from proxy_fake_engine import FakeEngine
from test_proxy_app import TOKENIZER, run_proxy
from waits import async_wait_for

from services.proxy.runtime import ProxyRuntime

EOS = int(TOKENIZER.eos_token_id)
MSG = [{"role": "user", "content": "code of qzt?"}]
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "qzt"}}\n</tool_call>'


def ids(text: str, eos: bool = True) -> list[int]:
    return [int(i) for i in TOKENIZER.encode(text, add_special_tokens=False)] + ([EOS] if eos else [])


def sse_data(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_tool_calls_are_parsed_into_message_tool_calls_and_recorded_verbatim() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "tools": TOOLS, "max_tokens": 200},
                         headers={"X-Session-Id": "tool-1"})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        call = choice["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"] == {"name": "lookup", "arguments": '{"key": "qzt"}'}
        assert "<tools>lookup</tools>" in TOKENIZER.decode(eng.generate_bodies[0]["input_ids"])
        # The agent sends the call back with the tool's answer: the prompt extends the recorded turn.
        eng.script = ids("4821")
        msgs = [*MSG, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "4821"}]
        r2 = await c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS},
                          headers={"X-Session-Id": "tool-1"})
        assert r2.json()["choices"][0]["message"]["content"] == "4821"
        assert r2.json()["choices"][0]["finish_reason"] == "stop"
        sample = rt.sessions.get("tool-1").samples()
        assert len(sample) == 1 and TOKENIZER.decode(sample[0]["token_ids"]).count(CALL) == 1
    run_proxy(t, engine=FakeEngine(script=ids(CALL)))


@pytest.mark.parametrize(("path", "extra", "prefix"), [
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "lookup"}}},
     '<tool_call>\n{"name": "lookup", "arguments": '),
    ("/v1/chat/completions", {"tool_choice": "required"}, '<tool_call>\n{"name": "'),
    ("/v1/responses", {"tool_choice": {"type": "function", "name": "lookup"}},
     '<tool_call>\n{"name": "lookup", "arguments": '),
    ("/v1/messages", {"tool_choice": {"type": "any"}}, '<tool_call>\n{"name": "'),
])
def test_a_forced_tool_call_starts_the_answer_for_the_model_and_is_not_recorded_as_sampled(
        path: str, extra: dict[str, Any], prefix: str) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        surface = path.split("/")[-1]
        function: dict[str, Any] = TOOLS[0]["function"]
        tools = {"completions": TOOLS, "responses": [{"type": "function", **function}],
                 "messages": [{"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}]}[surface]
        bodies: dict[str, dict[str, Any]] = {"completions": {"messages": MSG}, "responses": {"input": MSG[0]["content"]},
                                             "messages": {"messages": MSG}}
        body = bodies[surface]
        limit = {"max_output_tokens": 200} if surface == "responses" else {"max_tokens": 200}
        r = await c.post(path, json={**body, "tools": tools, **limit, **extra},
                         headers={"X-Session-Id": "forced"})
        assert r.status_code == 200, r.text
        sent = str(TOKENIZER.decode(eng.generate_bodies[0]["input_ids"]))
        assert sent.endswith("<|im_start|>assistant\n" + prefix)  # the call's start is context for the model
        out = r.json()
        name, args = {"completions": lambda: (out["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
                                              json.loads(out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])),
                      "responses": lambda: (out["output"][0]["name"], json.loads(out["output"][0]["arguments"])),
                      "messages": lambda: (out["content"][0]["name"], out["content"][0]["input"])}[surface]()
        assert (name, args) == ("lookup", {"key": "qzt"})
        (sample,) = rt.sessions.get("forced").samples()
        sampled = [tok for tok, m in zip(sample["token_ids"], sample["loss_mask"], strict=True) if m]
        assert TOKENIZER.decode(sampled) == CALL[len(prefix):] + "<|im_end|>"  # the prefix was never sampled
        assert sample["meta"]["tool_calls"] == 1
    run_proxy(t, engine=FakeEngine(script=ids(CALL)))


def test_tool_choice_none_leaves_the_text_as_content_and_malformed_calls_stay_visible() -> None:
    bad = "<tool_call>\n{not json}\n</tool_call>"

    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "tools": TOOLS, "tool_choice": "none"})
        assert r.json()["choices"][0]["message"]["content"] == CALL and "tool_calls" not in r.json()["choices"][0]["message"]
        eng.script = ids(bad)
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "tools": TOOLS})
        assert r.json()["choices"][0]["message"]["content"] == bad
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    run_proxy(t, engine=FakeEngine(script=ids(CALL)))


def test_stream_sends_chunks_as_tokens_are_produced_and_tool_calls_as_they_are_written() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        body = {"messages": MSG, "tools": TOOLS, "seed": 3}
        r = await c.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.headers["content-type"].startswith("text/event-stream")
        total = sse_data(r.text)
        assert eng.generate_bodies[0]["stream"] is True
        deltas = [ch["choices"][0]["delta"] for ch in total if ch["choices"]]
        assert [d["content"] for d in deltas if d.get("content")] == ["h", "i", " "]  # one chunk per token
        first, *rest = [tc for d in deltas for tc in d.get("tool_calls", [])]
        # OpenAI's shape: the first delta names the call, the next ones carry argument pieces only.
        assert (first["index"], first["type"], first["function"]) == (0, "function", {"name": "lookup", "arguments": ""})
        assert first["id"].startswith("call_") and len(rest) > 1
        assert all(tc == {"index": 0, "function": {"arguments": tc["function"]["arguments"]}} for tc in rest)
        assert [ch["choices"][0]["finish_reason"] for ch in total if ch["choices"]][-1] == "tool_calls"
        assert total[-1]["usage"]["completion_tokens"] == len(ids("hi " + CALL))
        whole = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["tool_calls"][0]
        assert "".join(tc["function"]["arguments"] for tc in rest) == whole["function"]["arguments"] == '{"key": "qzt"}'
    run_proxy(t, engine=FakeEngine(script=ids("hi " + CALL), step_s=0.01))


def test_stream_survives_a_preemption_as_one_uninterrupted_stream() -> None:
    text = "abcdefghijklmnopqrstuvwxyz" * 2

    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        async def pause_resume() -> None:
            await async_wait_for(lambda: eng.produced >= 5, what="tokens streamed before the pause")
            await rt.controller.pause(reason="test")
            await rt.controller.resume(version="b")
        task = asyncio.create_task(pause_resume())
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "stream": True, "max_tokens": 100})
        await task
        chunks = sse_data(r.text)
        assert r.text.endswith("data: [DONE]\n\n")
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == text
        final = chunks[-1]
        assert final["choices"][0]["finish_reason"] == "stop" and final["dressage"]["preempts"] >= 1
        assert len(eng.generate_bodies) >= 2
    run_proxy(t, engine=FakeEngine(script=ids(text), step_s=0.01))


def test_stop_strings_cut_text_and_recorded_tokens_at_the_same_place() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "stop": ["END"], "max_tokens": 100},
                         headers={"X-Session-Id": "stop-1"})
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == "one two " and choice["finish_reason"] == "stop"
        sample = rt.sessions.get("stop-1").samples()[0]
        response = [t for t, m in zip(sample["token_ids"], sample["loss_mask"], strict=True) if m]
        assert TOKENIZER.decode(response) == "one two "
        # the abort is sent in the background
        await async_wait_for(lambda: eng.aborts, 5, "the engine request aborted once the stop string matched")
    run_proxy(t, engine=FakeEngine(script=ids("one two END three four five six seven"), step_s=0.01))


def test_logprobs_and_token_ids_in_openai_and_sglang_shapes() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "logprobs": True, "top_logprobs": 2,
                                                       "return_token_ids": True})
        body = r.json()
        content = body["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == ["o", "k", "<|im_end|>"]
        assert all(e["logprob"] == -0.25 and len(e["top_logprobs"]) == 2 for e in content)
        assert content[0]["bytes"] == [ord("o")]
        assert body["choices"][0]["token_ids"] == ids("ok") and body["prompt_token_ids"][-1] == ids("\n", False)[0]
        assert eng.generate_bodies[-1]["top_logprobs_num"] == 2
        assert body["model"] == rt.model_name
    run_proxy(t, engine=FakeEngine(script=ids("ok")))


@pytest.mark.parametrize(("extra", "field"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 2}, "n"),
    ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"min_tokens": 4}, "min_tokens"),
])
def test_fields_that_would_change_the_result_are_refused_with_400_in_openai_shape(extra: dict[str, Any],
                                                                                  field: str) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": MSG, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "unsupported_parameter"
        assert err["type"] == "invalid_request_error" and field in err["message"]
        assert eng.generate_bodies == []
    run_proxy(t)


def test_staleness_errors_keep_their_fields_inside_the_openai_error() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        await c.post("/v1/chat/completions", json={"messages": MSG}, headers={"X-Session-Id": "span"})
        for v in ("b", "c"):
            await rt.controller.pause()
            eng.version = v
            await rt.controller.resume(version=v)
            r = await c.post("/v1/chat/completions", json={"messages": MSG}, headers={"X-Session-Id": "span"})
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "partial_rollout_staleness_exceeded" and err["max_preempts"] == 1
        assert "versions" in err and "version_span" in err and r.json()["detail"]["error"] == err["code"]
    run_proxy(t, max_partial_rollout_preempts=1)


def test_generate_accepts_sglang_fields_and_strips_special_tokens() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/generate", json={"text": "abc", "rid": "my-rid", "return_logprob": False,
                                               "sampling_params": {"max_new_tokens": 50, "stop": "xx",
                                                                   "skip_special_tokens": True}})
        body = r.json()
        assert r.status_code == 200 and body["text"] == "hello " and body["meta_info"]["id"] == "my-rid"
        assert "output_token_logprobs" not in body["meta_info"]
        assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "xx"}
        r = await c.post("/v1/generate", json={"input_ids": [7], "sampling_params": {
            "max_new_tokens": 50, "stop": ["xx"], "no_stop_trim": True, "skip_special_tokens": False}})
        assert r.json()["text"] == "hello xx" and TOKENIZER.decode(r.json()["output_ids"]) == "hello xx"
        eng.script = ids("fin")
        r = await c.post("/v1/generate", json={"input_ids": [7], "sampling_params": {"skip_special_tokens": False}})
        assert r.json()["text"] == "fin<|im_end|>"
        r = await c.post("/v1/generate", json={"input_ids": [7]})
        assert r.json()["text"] == "fin"
    run_proxy(t, engine=FakeEngine(script=ids("hello xx world")))


def sse_events(text: str) -> list[tuple[str, Any]]:
    out, kind = [], ""
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[6:])))
    return out


def test_responses_api_maps_input_and_tools_onto_the_same_session_core() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        tools = [{"type": "function", "name": "lookup", "parameters": TOOLS[0]["function"]["parameters"]}]
        r = await c.post("/s/resp-1/v1/responses", json={"input": "code of qzt?", "tools": tools,
                                                         "max_output_tokens": 200})
        body = r.json()
        assert r.status_code == 200 and body["object"] == "response" and body["status"] == "completed"
        call = body["output"][0]
        assert call["type"] == "function_call" and call["name"] == "lookup" and call["arguments"] == '{"key": "qzt"}'
        eng.script = ids("4821")
        follow = [{"role": "user", "content": "code of qzt?"},
                  {"type": "function_call", "call_id": call["call_id"], "name": "lookup", "arguments": call["arguments"]},
                  {"type": "function_call_output", "call_id": call["call_id"], "output": "4821"}]
        r = await c.post("/s/resp-1/v1/responses", json={"input": follow, "tools": tools, "stream": True})
        events = sse_events(r.text)
        kinds = [k for k, _ in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "".join(d["delta"] for k, d in events if k == "response.output_text.delta") == "4821"
        assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "4821"
        samples = rt.sessions.get("resp-1").samples()
        assert len(samples) == 1 and samples[0]["meta"]["tool_calls"] == 1  # one trajectory, the call counted
        r = await c.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    run_proxy(t, engine=FakeEngine(script=ids(CALL)))


def test_messages_api_maps_tool_use_and_tool_result_blocks_and_streams_events() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        tools = [{"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}]
        r = await c.post("/v1/messages", json={"max_tokens": 200, "messages": MSG, "tools": tools},
                         headers={"X-Session-Id": "msg-1"})
        body = r.json()
        assert body["type"] == "message" and body["stop_reason"] == "tool_use"
        block = body["content"][0]
        assert block["type"] == "tool_use" and block["input"] == {"key": "qzt"}
        eng.script = ids("4821 END more")
        msgs = [*MSG, {"role": "assistant", "content": [block]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "4821"}]}]
        r = await c.post("/v1/messages", json={"max_tokens": 50, "messages": msgs, "tools": tools, "stream": True,
                                               "stop_sequences": [" END"]}, headers={"X-Session-Id": "msg-1"})
        events = sse_events(r.text)
        assert [k for k, _ in events][0] == "message_start" and events[-1][0] == "message_stop"
        assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == "4821"
        delta = next(d for k, d in events if k == "message_delta")
        assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " END"}
        assert len(rt.sessions.get("msg-1").samples()) == 1
        r = await c.post("/v1/messages", json={"max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.type"
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"  # Anthropic's shape
    run_proxy(t, engine=FakeEngine(script=ids(CALL)))


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 5}),
    ("/v1/responses", {"input": "code of qzt?", "max_output_tokens": 5}),
    ("/v1/messages", {"messages": MSG, "max_tokens": 5}),
])
def test_unknown_fields_are_refused_and_fields_without_effect_accepted_on_every_surface(
        path: str, body: dict[str, Any]) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        ok = await c.post(path, json={**body, "metadata": {"run": "x"}})
        assert ok.status_code == 200, ok.text
        r = await c.post(path, json={**body, "top_k_typo": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k_typo"
        assert r.json()["error"]["code"] == "unsupported_parameter" and len(eng.generate_bodies) == 1
    run_proxy(t)


def test_streamed_tool_calls_on_responses_and_messages_arrive_as_they_are_written() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        tools = [{"type": "function", "name": "lookup", "parameters": TOOLS[0]["function"]["parameters"]}]
        body = {"input": "code of qzt?", "tools": tools, "max_output_tokens": 200}
        events = sse_events((await c.post("/v1/responses", json={**body, "stream": True})).text)
        added = next(d for k, d in events if k == "response.output_item.added" and d["item"]["type"] == "function_call")
        assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
        pieces = [d["delta"] for k, d in events if k == "response.function_call_arguments.delta"]
        done = next(d for k, d in events if k == "response.output_item.done" and d["item"]["type"] == "function_call")
        whole = (await c.post("/v1/responses", json=body)).json()["output"][0]["arguments"]
        assert len(pieces) > 1 and "".join(pieces) == done["item"]["arguments"] == whole
        assert [k for k, _ in events].index("response.function_call_arguments.done") > [k for k, _ in events].index(
            "response.function_call_arguments.delta") and done["item"]["name"] == "lookup"
        assert events[-1][1]["response"]["output"][-1]["arguments"] == whole
        tools_a = [{"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}]
        body_a = {"max_tokens": 200, "messages": MSG, "tools": tools_a}
        events = sse_events((await c.post("/v1/messages", json={**body_a, "stream": True})).text)
        start = next(d for k, d in events if k == "content_block_start" and d["content_block"]["type"] == "tool_use")
        partial = [d["delta"]["partial_json"] for k, d in events
                   if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
        whole_input = (await c.post("/v1/messages", json=body_a)).json()["content"][0]["input"]
        assert start["content_block"]["name"] == "lookup" and start["content_block"]["input"] == {}
        assert len(partial) > 1 and json.loads("".join(partial)) == whole_input == {"key": "qzt"}
        assert next(d for k, d in events if k == "message_delta")["delta"]["stop_reason"] == "tool_use"
    run_proxy(t, engine=FakeEngine(script=ids(CALL)))


@pytest.mark.parametrize(("path", "tool", "field"), [
    ("/v1/chat/completions", {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
     "tools.0.function.strict"),
    ("/v1/responses", {"type": "function", "name": "lookup", "parameters": {"type": "object"}}, "tools.0.strict"),
    ("/v1/messages", {"name": "lookup", "input_schema": {"type": "object"}}, "tools.0.strict"),
])
def test_strict_tools_are_refused_by_name_and_strict_false_is_served(path: str, tool: dict[str, Any],
                                                                     field: str) -> None:
    def with_strict(value: bool) -> dict[str, Any]:
        if "function" in tool:
            return {**tool, "function": {**tool["function"], "strict": value}}
        return {**tool, "strict": value}

    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        body = ({"input": "code of qzt?", "max_output_tokens": 5} if path == "/v1/responses"
                else {"messages": MSG, "max_tokens": 5})
        r = await c.post(path, json={**body, "tools": [with_strict(True)]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (field, "unsupported_parameter") and eng.generate_bodies == []
        assert (await c.post(path, json={**body, "tools": [with_strict(False)]})).status_code == 200
        assert (await c.post(path, json={**body, "tools": [tool]})).status_code == 200
    run_proxy(t)


@pytest.mark.parametrize(("path", "single"), [
    ("/v1/chat/completions", {"parallel_tool_calls": False}), ("/v1/responses", {"parallel_tool_calls": False}),
    ("/v1/messages", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}), ("/v1/chat/completions", {}),
])
def test_parallel_tool_calls_false_ends_the_turn_with_the_first_call(path: str, single: dict[str, Any]) -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        surface = path.split("/")[-1]
        tools: Any = {"completions": TOOLS, "responses": [{"type": "function", **TOOLS[0]["function"]}],
                      "messages": [{"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}]}[surface]
        body: dict[str, Any] = ({"input": "code of qzt?", "max_output_tokens": 300} if surface == "responses"
                                else {"messages": MSG, "max_tokens": 300})
        r = await c.post(path, json={**body, "tools": tools, **single}, headers={"X-Session-Id": "one"})
        assert r.status_code == 200, r.text
        out = r.json()
        calls = {"completions": lambda: out["choices"][0]["message"]["tool_calls"],
                 "responses": lambda: [o for o in out["output"] if o["type"] == "function_call"],
                 "messages": lambda: [b for b in out["content"] if b["type"] == "tool_use"]}[surface]()
        (sample,) = rt.sessions.get("one").samples()
        sampled = str(TOKENIZER.decode([tok for tok, m in zip(sample["token_ids"], sample["loss_mask"], strict=True)
                                        if m]))
        if single:  # one call, and the recorded turn ends where the call does: what was returned
            assert len(calls) == 1 and sampled == CALL
        else:
            assert len(calls) == 2 and sampled == CALL + CALL + "<|im_end|>"
    run_proxy(t, engine=FakeEngine(script=ids(CALL + CALL)))
