"""The engine's SGLang request fixtures (slime's rollout bodies, SGLang's own shapes) replayed against
the proxy's ``/v1/generate``: what SGLang accepts is served with its semantics or refused with a 400
naming the field, never a 422 for a field SGLang knows and never silently dropped when it matters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxy_fake_engine import FakeEngine
from test_proxy_app import run_proxy

from services.proxy.runtime import ProxyRuntime

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine"
# fixture -> the field a 400 names (None: served)
EXPECTED = {"sglang_native_text": None, "slime_generate_seeded": None, "slime_generate_top_p": None,
            "slime_generate_routing_replay": "return_routed_experts", "sglang_batch_text": "text",
            "sglang_parallel_n": "input_ids", "sglang_native_stream": "stream",
            "sglang_logprobs_top": "logprob_start_len"}


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def test_every_generate_fixture_is_covered() -> None:
    generate = {p.stem for p in FIXTURES.glob("*.json") if fixture(p.stem).get("path") == "/generate"}
    assert generate == set(EXPECTED) | {"sglang_refused"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sglang_and_slime_bodies_are_served_or_refused_naming_the_field(name: str) -> None:
    body, refused = fixture(name)["body"], EXPECTED[name]

    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        r = await c.post("/v1/generate", json=body)
        if refused is not None:
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == refused and err["code"] == "unsupported_parameter" and refused in err["message"]
            assert eng.generate_bodies == []
            return
        assert r.status_code == 200, r.text
        out = r.json()
        sent = eng.generate_bodies[0]["sampling_params"]
        asked = body["sampling_params"]
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) <= asked["max_new_tokens"]
        assert ("output_token_logprobs" in out["meta_info"]) == body.get("return_logprob", True)
        for key in ("temperature", "top_k", "sampling_seed", "custom_params"):  # SGLang's semantics: forwarded
            if asked.get(key) is not None:
                assert sent[key] == asked[key], key
        if asked.get("stop_token_ids"):
            assert set(asked["stop_token_ids"]) <= set(sent["stop_token_ids"])
    run_proxy(t)


def test_fields_no_part_of_the_system_implements_are_refused_naming_them() -> None:
    cases = fixture("sglang_refused")["cases"]

    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        for case in cases:
            r = await c.post("/v1/generate", json=case["body"])
            assert r.status_code == 400 and r.json()["error"]["param"] == case["field"], (case, r.text)
        assert eng.generate_bodies == []
    run_proxy(t)


def test_penalties_and_min_p_reach_the_engine_and_bookkeeping_fields_change_nothing() -> None:
    async def t(c: httpx.AsyncClient, rt: ProxyRuntime, eng: FakeEngine) -> None:
        params = {"max_new_tokens": 4, "min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": -0.5,
                  "repetition_penalty": 1.2, "logit_bias": {"12": -1.0}, "n": 1, "min_new_tokens": 0,
                  "stream_interval": 2, "spaces_between_special_tokens": False}
        r = await c.post("/v1/generate", json={"input_ids": [10, 11], "sampling_params": params, "log_metrics": True,
                                               "routing_key": "k", "data_parallel_rank": 0, "stream": False})
        assert r.status_code == 200, r.text
        sent = eng.generate_bodies[0]["sampling_params"]
        assert {k: sent[k] for k in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                                     "logit_bias")} == {k: params[k] for k in ("min_p", "frequency_penalty",
                                                                               "presence_penalty",
                                                                               "repetition_penalty", "logit_bias")}
        for body, field in (({"sampling_params": {"n": 2}}, "sampling_params.n"),
                            ({"sampling_params": {"min_new_tokens": 3}}, "sampling_params.min_new_tokens"),
                            ({"sampling_params": {"stop_regex": "x+"}}, "sampling_params.stop_regex"),
                            ({"data_parallel_rank": 1}, "data_parallel_rank")):
            r = await c.post("/v1/generate", json={"input_ids": [10], **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = await c.post("/v1/generate", json={"input_ids": [10], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 422  # a field SGLang does not know is still a typo, not a knob
    run_proxy(t)
