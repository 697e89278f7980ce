"""What a user's own model, task and agent need from the proxy: chat_template_kwargs honoured, the
reasoning split as reasoning_content, and an agent's reward reported for its own session only."""

from __future__ import annotations

import httpx
from proxy_fake_engine import FakeEngine
from test_proxy_app import TOKENIZER, run_proxy

from services.proxy.runtime import ProxyRuntime
from shared.edge import session_token

EOS = int(TOKENIZER.eos_token_id)
MSG = [{"role": "user", "content": "2+2="}]
EMPTY_THOUGHT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def ids(text: str) -> list[int]:
    return [int(i) for i in TOKENIZER.encode(text, add_special_tokens=False)] + [EOS]


def prompt_of(eng: FakeEngine, i: int = -1) -> str:
    return str(TOKENIZER.decode(eng.generate_bodies[i]["input_ids"]))


def test_chat_template_kwargs_reach_the_template_instead_of_a_400() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 8,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        assert prompt_of(eng).endswith(EMPTY_THOUGHT)
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 8})  # same messages: no cache mix-up
        assert r.status_code == 200 and not prompt_of(eng).endswith(EMPTY_THOUGHT)
        rt.template_kwargs = {"enable_thinking": False}  # model.chat_template_kwargs: every prompt's default
        await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 8})
        assert prompt_of(eng).endswith(EMPTY_THOUGHT)
        await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 8,
                                                   "chat_template_kwargs": {"enable_thinking": True}})
        assert not prompt_of(eng).endswith(EMPTY_THOUGHT)  # the request's own value wins
    run_proxy(t, engine=FakeEngine(script=ids("4")))


def test_reasoning_parser_returns_reasoning_content_and_the_answer_as_content() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 40}, headers={"X-Session-Id": "r1"})
        message = r.json()["choices"][0]["message"]
        assert message["reasoning_content"] == "two and two" and message["content"] == "4"
        whole = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 40,
                                                           "separate_reasoning": False})
        assert whole.json()["choices"][0]["message"]["content"] == "<think>two and two</think>4"
        sample = rt.sessions.get("r1").samples()[0]  # the recorded tokens are the whole reply, thought included
        assert "<think>two and two</think>4" in TOKENIZER.decode(sample["token_ids"])
    run_proxy(t, engine=FakeEngine(script=ids("<think>two and two</think>4")), reasoning_parser="qwen3")


def test_an_agent_reports_its_reward_for_its_own_session_only() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        mine = {"Authorization": f"Bearer {session_token('k', 'mine')}"}
        assert (await c.post("/s/mine/v1/chat/completions", json={"messages": MSG}, headers=mine)).status_code == 200
        ok = await c.post("/s/mine/v1/reward", json={"reward": 0.5, "components": {"tests": 1.0}}, headers=mine)
        assert ok.status_code == 200 and ok.json()["reward"] == 0.5
        other = await c.post("/s/theirs/v1/reward", json={"reward": 1.0}, headers=mine)
        assert other.status_code == 403  # a session token is valid under its own session only
        nan = await c.post("/s/mine/v1/reward", content=b'{"reward": NaN}',
                           headers={**mine, "Content-Type": "application/json"})
        assert nan.status_code in (400, 422)
        bad = await c.post("/s/mine/v1/reward", json={"reward": 1.0, "components": {"a b": 1}}, headers=mine)
        assert bad.status_code == 422 and "component name" in bad.text
        agent = {"Authorization": "Bearer k"}
        unknown = await c.post("/s/nobody/v1/reward", json={"reward": 1.0}, headers=agent)
        assert unknown.status_code == 404  # a reward needs a session that made a model call
        closed = (await c.post("/v1/sessions/close", json={"session_ids": ["mine"]}, headers=agent)).json()
        assert closed["records"]["mine"]["agent_reward"] == {"reward": 0.5, "components": {"tests": 1.0}}
    run_proxy(t, engine=FakeEngine(script=ids("4")), api_key="k")


def test_a_reward_for_a_finalized_session_is_refused() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        await c.post("/s/s1/v1/chat/completions", json={"messages": MSG})
        await c.post("/v1/sessions/s1/finalize")
        r = await c.post("/s/s1/v1/reward", json={"reward": 1.0})
        assert r.status_code == 409 and rt.sessions.get("s1").agent_reward is None
    run_proxy(t, engine=FakeEngine(script=ids("4")))
