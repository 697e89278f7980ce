"""The official ``openai`` and ``anthropic`` SDKs drive a real proxy in front of a real CPU engine:
chat, tools, real streaming, logprobs, stop strings, errors, the Responses and Messages surfaces,
streams that survive continuous weight updates, and the recorded SDK request bodies replayed.
Tool calls streamed as they are written are checked against the scripted fake engine over HTTP
(a random tiny model does not write well-formed calls), through each SDK's own accumulator."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from paths import REPO
from proxy_support import AppThread, EngineProc, ProxyThread, start_engine

from shared.config import ProxyConfig
from shared.keys import Keys
from shared.modeling import load_tokenizer
from shared.modeling.tokenizer import build_tokenizer, save_tokenizer
from shared.redisproc import RedisProcess
from shared.schemas import WeightVersion
from shared.versionbus import publish_version

sys.path.insert(0, str(REPO / "tests" / "unit"))
from proxy_fake_engine import FakeEngine  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "proxy"
MSG: list[Any] = [{"role": "user", "content": "reverse 123"}]
TOOLS: list[Any] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
FORCE: Any = {"type": "function", "function": {"name": "lookup"}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "qzt", "n": [1, 2]}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProc]:
    eng = start_engine(tmp_path_factory.mktemp("sdk-engine"))
    yield eng
    eng.stop()


@pytest.fixture
def proxy(engine: EngineProc, redis_server: RedisProcess, keys: Keys) -> Iterator[ProxyThread]:
    engine.reset("1")
    cfg = ProxyConfig(engines=[engine.url], pause_timeout_s=10, max_partial_rollout_preempts=50)
    with ProxyThread(cfg, engine.model_dir, redis_server.port, keys) as p:
        yield p


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[FakeEngine, ProxyThread]]:
    """A proxy over the scripted fake engine (served over HTTP) that writes ``CALL``, a token a step."""
    tok = build_tokenizer()
    save_tokenizer(tok, tmp_path)
    eng = FakeEngine(script=[*tok.encode(CALL, add_special_tokens=False), tok.eos_token_id], step_s=0.01)
    with AppThread(eng.app) as served, ProxyThread(ProxyConfig(engines=[served.url], follow_versions=False),
                                                   tmp_path) as p:
        yield eng, p


def client(p: ProxyThread, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.url}/s/{session}/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_sdk_chat_tools_logprobs_stop_and_errors(proxy: ProxyThread, engine: EngineProc) -> None:
    c = client(proxy, "sdk-1")
    plain = c.chat.completions.create(model="anything", messages=MSG, max_tokens=12, temperature=1.0)
    assert isinstance(plain.choices[0].message.content, str) and plain.model == proxy.runtime.model_name
    with_tools = c.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=4)
    assert with_tools.usage is not None and plain.usage is not None
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # the template rendered the tool list
    lp = c.chat.completions.create(model="m", messages=MSG, max_tokens=6, logprobs=True, top_logprobs=2,
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
    assert lp.choices[0].logprobs is not None and lp.choices[0].logprobs.content is not None
    entries = lp.choices[0].logprobs.content
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert max(t.logprob for t in entries[0].top_logprobs) >= entries[0].top_logprobs[-1].logprob
    assert (lp.model_extra or {})["prompt_token_ids"] and len((lp.choices[0].model_extra or {})["token_ids"]) == 6
    cut = client(proxy, "sdk-stop").chat.completions.create(model="m", messages=MSG, max_tokens=60, stop=["1", "2"],
                                                            extra_body={"ignore_eos": True})
    text = cut.choices[0].message.content or ""
    assert "1" not in text and "2" not in text and cut.choices[0].finish_reason in ("stop", "length")
    tok = load_tokenizer(engine.model_dir)
    sample = httpx.get(f"{proxy.url}/v1/sessions/sdk-stop").json()["samples"][-1]
    response = [t for t, m in zip(sample["token_ids"], sample["loss_mask"], strict=True) if m]
    assert tok.decode(response, skip_special_tokens=True) == text  # specials have no text in the answer
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="m", messages=MSG, response_format={"type": "json_object"})
    assert err.value.code == "unsupported_parameter" and err.value.param == "response_format"
    assert "response_format" in err.value.message


def test_openai_sdk_n_choices_land_one_per_named_session(proxy: ProxyThread) -> None:
    c = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0, timeout=120)
    out = c.chat.completions.create(model="m", messages=MSG, n=3, max_tokens=5, temperature=1.0,
                                    extra_body={"ignore_eos": True}, extra_headers={"X-Session-Ids": "n-0,n-1,n-2"})
    assert [ch.index for ch in out.choices] == [0, 1, 2] and out.usage is not None
    assert out.usage.completion_tokens == 15
    for i, choice in enumerate(out.choices):
        sample = httpx.get(f"{proxy.url}/v1/sessions/n-{i}").json()["samples"][-1]
        assert sum(sample["loss_mask"]) == 5 and isinstance(choice.message.content, str)
    with pytest.raises(openai.BadRequestError) as err:  # n > 1 with no session per choice
        c.chat.completions.create(model="m", messages=MSG, n=2, max_tokens=5)
    assert err.value.code == "unsupported_parameter" and err.value.param == "n"


def test_openai_sdk_stream_arrives_as_tokens_are_produced(proxy: ProxyThread) -> None:
    c = client(proxy, "sdk-stream")
    start = time.monotonic()
    arrivals: list[float] = []
    text = ""
    stream = c.chat.completions.create(model="m", messages=MSG, max_tokens=300, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    last: Any = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - start)
            text += chunk.choices[0].delta.content
        last = chunk
    total = time.monotonic() - start
    assert len(arrivals) >= 100  # one chunk per token or so, not one blob at the end
    assert arrivals[0] < 0.5 * total, (arrivals[0], total)  # the first text came while the rest was generated
    assert last.usage.completion_tokens == 300


def test_streamed_logprobs_arrive_with_their_tokens_and_add_up_to_the_whole_list(proxy: ProxyThread) -> None:
    stream = client(proxy, "sdk-stream-lp").chat.completions.create(
        model="m", messages=MSG, max_tokens=80, stream=True, logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, entries, carrying, chunks, usage = "", [], [], 0, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        chunks += 1
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None and choice.logprobs.content:
            entries += choice.logprobs.content
            carrying.append(chunks)
    assert usage is not None and len(entries) == usage.completion_tokens == 80
    special = re.compile(r"<\|[a-z_]+\|>")  # a random model writes special tokens; the answer skips their text
    assert "".join(e.token for e in entries if not special.fullmatch(e.token)) == text  # each token once, in order
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert len(carrying) >= 20 and carrying[0] < chunks / 2  # along the stream, not one block in the last chunk


@pytest.mark.parametrize("mode", ["pause", "live"])
def test_streams_and_whole_answers_survive_continuous_weight_updates(engine: EngineProc, redis_server: RedisProcess,
                                                                     keys: Keys, mode: Literal["pause", "live"]) -> None:
    engine.reset("1")
    cfg = ProxyConfig(engines=[engine.url], pause_timeout_s=10, max_partial_rollout_preempts=50, weight_updates=mode)
    with ProxyThread(cfg, engine.model_dir, redis_server.port, keys) as proxy:
        finals, whole = _generate_under_updates(proxy, engine, redis_server, keys)
    assert all(f.choices[0].finish_reason == "length" for f in finals) and whole.choices[0].finish_reason == "length"
    extras = [(f.model_extra or {})["dressage"] for f in [*finals, whole]]
    preempts = [x["preempts"] for x in extras]
    if mode == "pause":
        assert sum(preempts) >= 1, preempts  # updates did land mid-generation, and nobody saw an abort
    else:  # live: updates land between decode steps of running requests, which are never interrupted
        assert preempts == [0] * 4 and all(len(x["partial_rollout_chunks"]) == 1 for x in extras), extras
        assert max(len(x["versions"]) for x in extras) >= 2, extras


def _generate_under_updates(proxy: ProxyThread, engine: EngineProc, redis_server: RedisProcess,
                            keys: Keys) -> tuple[list[Any], Any]:
    """Three streamed and one whole 400-token chat answer while a version is published every 0.4 s."""
    r = redis.Redis(port=redis_server.port)
    stop = threading.Event()

    def publish() -> None:
        n = 2
        while not stop.is_set():
            path = engine.second_dir if n % 2 == 0 else engine.model_dir
            publish_version(r, keys, WeightVersion(version=str(n), path=str(path), step=n, published_at=time.time()))
            n += 1
            stop.wait(0.4)

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    try:
        c = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0, timeout=120)
        finals = []
        for i in range(3):
            chunks = list(c.chat.completions.create(
                model="m", messages=MSG, max_tokens=400, stream=True, extra_body={"ignore_eos": True,
                                                                                  "session_id": f"upd-{i}"}))
            finals.append(chunks[-1])
        whole = c.chat.completions.create(model="m", messages=MSG, max_tokens=400,
                                          extra_body={"ignore_eos": True, "session_id": "upd-whole"})
    finally:
        stop.set()
        publisher.join(10)
    return finals, whole


def test_responses_and_messages_surfaces_through_their_sdks(proxy: ProxyThread) -> None:
    c = client(proxy, "sdk-resp")
    resp = c.responses.create(model="m", input="reverse 123", max_output_tokens=8)
    assert resp.status in ("completed", "incomplete") and resp.model == proxy.runtime.model_name
    events = [e.type for e in c.responses.create(model="m", input="reverse 123", max_output_tokens=8, stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    a = anthropic.Anthropic(base_url=f"{proxy.url}/s/sdk-msg", api_key="none", max_retries=0)
    msg = a.messages.create(model="m", max_tokens=8, messages=MSG)
    assert msg.type == "message" and msg.stop_reason in ("end_turn", "max_tokens")
    with a.messages.stream(model="m", max_tokens=8, messages=MSG) as s:
        streamed = s.get_final_message()
    assert streamed.usage.output_tokens >= 1
    with pytest.raises(anthropic.BadRequestError):
        a.messages.create(model="m", max_tokens=8, messages=MSG, thinking={"type": "enabled", "budget_tokens": 1024})
    turns = httpx.get(f"{proxy.url}/v1/sessions/sdk-msg").json()["turns"]
    assert turns == 2


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_recorded_sdk_request_bodies_replay_against_the_proxy(proxy: ProxyThread, name: str) -> None:
    rec = json.loads((FIXTURES / f"{name}.json").read_text())
    r = httpx.post(f"{proxy.url}/s/fx-{name.replace('_', '-')}{rec['path']}", json=rec["body"], timeout=120)
    if "response_format" in name:
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        return
    assert r.status_code == 200, r.text
    if rec["body"].get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream") and "data: " in r.text
    else:
        assert r.json()["dressage"]["session_id"] == f"fx-{name.replace('_', '-')}"


def test_sdk_streams_accumulate_a_tool_call_written_piece_by_piece_to_the_whole_answers_call(
        scripted: tuple[FakeEngine, ProxyThread]) -> None:
    _, p = scripted
    c = client(p, "sdk-tools")
    whole = c.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=200).choices[0].message
    assert whole.tool_calls and isinstance(call := whole.tool_calls[0], ChatCompletionMessageFunctionToolCall)
    with c.chat.completions.stream(model="m", messages=MSG, tools=TOOLS, max_tokens=200) as s:
        pieces = [e.arguments_delta for e in s if e.type == "tool_calls.function.arguments.delta"]
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls
    streamed = final.message.tool_calls[0]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert len([x for x in pieces if x]) > 1 and "".join(pieces) == call.function.arguments == '{"key": "qzt", "n": [1, 2]}'
    tools_r: Any = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}, "strict": False}]
    whole_r = c.responses.create(model="m", input="reverse 123", tools=tools_r, max_output_tokens=200)
    with c.responses.stream(model="m", input="reverse 123", tools=tools_r, max_output_tokens=200) as rs:
        deltas = [e.delta for e in rs if e.type == "response.function_call_arguments.delta"]
        final_r = rs.get_final_response()
    calls = [o for o in final_r.output if o.type == "function_call"]
    assert [(o.name, o.arguments) for o in calls] == [(o.name, o.arguments) for o in whole_r.output
                                                      if o.type == "function_call"]
    assert len(deltas) > 1 and "".join(deltas) == calls[0].arguments == call.function.arguments
    a = anthropic.Anthropic(base_url=f"{p.url}/s/sdk-tools-msg", api_key="none", max_retries=0)
    tools_a: Any = [{"name": "lookup", "input_schema": {"type": "object"}}]
    whole_m = a.messages.create(model="m", max_tokens=200, messages=MSG, tools=tools_a)
    with a.messages.stream(model="m", max_tokens=200, messages=MSG, tools=tools_a) as ms:
        partial = [e.partial_json for e in ms if e.type == "input_json"]
        final_m = ms.get_final_message()
    assert final_m.stop_reason == whole_m.stop_reason == "tool_use"
    uses = [(b.name, b.input) for b in final_m.content if b.type == "tool_use"]
    assert uses == [(b.name, b.input) for b in whole_m.content if b.type == "tool_use"]
    assert len(partial) > 1 and json.loads("".join(partial)) == {"key": "qzt", "n": [1, 2]}


def test_sdk_stream_opens_on_admission_and_names_a_forced_call_before_the_model_writes(
        scripted: tuple[FakeEngine, ProxyThread]) -> None:
    eng, p = scripted
    assert httpx.post(f"{p.url}/v1/rollout/pause", json={"reason": "test"}).status_code == 200
    try:  # paused: the turn is admitted and waits for the resume; the SDK has its stream already
        stream = client(p, "sdk-early").chat.completions.create(model="m", messages=MSG, tools=TOOLS, tool_choice=FORCE,
                                                                max_tokens=200, stream=True)
        chunks = iter(stream)
        role, named = next(chunks), next(chunks)
        assert role.choices[0].delta.role == "assistant"
        assert named.choices[0].delta.tool_calls and named.choices[0].delta.tool_calls[0].function is not None
        assert named.choices[0].delta.tool_calls[0].function.name == "lookup" and eng.generate_bodies == []
    finally:
        assert httpx.post(f"{p.url}/v1/rollout/resume", json={}).status_code == 200
    rest = list(chunks)
    args = "".join(tc.function.arguments or "" for ch in rest if ch.choices for tc in ch.choices[0].delta.tool_calls or []
                   if tc.function is not None)
    assert args == '{"key": "qzt", "n": [1, 2]}' and rest[-1].choices[0].finish_reason == "tool_calls"


def test_a_seeded_forced_call_streams_to_what_the_whole_answer_returns(proxy: ProxyThread) -> None:
    """The real (random) model after a forced call's start: streamed and whole answers of one seed agree,
    malformed call (content, finish) or well-formed (arguments) alike."""
    kw: Any = {"model": "m", "messages": MSG, "tools": TOOLS, "tool_choice": FORCE, "max_tokens": 24, "seed": 11,
               "temperature": 1.0}
    whole = client(proxy, "sdk-seed-whole").chat.completions.create(**kw).choices[0]
    content, args, names, finish = "", "", [], None
    for ch in client(proxy, "sdk-seed-stream").chat.completions.create(**kw, stream=True):
        if ch.choices:
            content += ch.choices[0].delta.content or ""
            fns = [tc.function for tc in ch.choices[0].delta.tool_calls or [] if tc.function]
            args += "".join(f.arguments or "" for f in fns)
            names += [f.name for f in fns if f.name]
            finish = ch.choices[0].finish_reason or finish
    assert names == ["lookup"]  # the forced call is named once, when the stream opens
    assert (content, finish) == (whole.message.content or "", whole.finish_reason)
    calls = [c for c in whole.message.tool_calls or [] if isinstance(c, ChatCompletionMessageFunctionToolCall)]
    if calls:
        assert args == calls[0].function.arguments
