"""Recorded slime / SGLang client requests replayed against the real engine over HTTP.

The fixtures (tests/fixtures/engine/) are the bodies those clients send; the assertions check
SGLang 0.5's semantics for each field (stop strings and trimming, penalties, min_new_tokens,
top logprobs, n and batches, streaming, loads, weight updates) against a local reference model.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from proxy_support import EngineProc, start_engine
from reference_model import greedy_ignore_eos
from waits import wait_for

from shared.modeling import load_model, load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProc]:
    eng = start_engine(tmp_path_factory.mktemp("sglang-compat"), max_batch_size=8)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def client(engine: EngineProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def local(engine: EngineProc) -> Any:
    return load_model(engine.model_dir)


def fixture(name: str, engine: EngineProc | None = None) -> dict[str, Any]:
    text = (FIXTURES / f"{name}.json").read_text()
    if engine is not None:
        text = text.replace("$MODEL_DIR", str(engine.model_dir)).replace("$SECOND_DIR", str(engine.second_dir))
    return dict(json.loads(text))


def replay(client: httpx.Client, name: str, engine: EngineProc | None = None) -> httpx.Response:
    fx = fixture(name, engine)
    return client.request(fx["method"], fx["path"], json=fx["body"])


def test_slime_default_request_is_served_with_logprobs(client: httpx.Client) -> None:
    r = replay(client, "slime_generate_top_p")
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    entries = meta["output_token_logprobs"]
    # slime reads tokens and logprobs from these triples
    assert [e[1] for e in entries] == body["output_ids"] and all(e[0] <= 0 for e in entries)
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"]


def test_slime_seeded_request_repeats_exactly_and_no_stop_trim_keeps_the_stop(client: httpx.Client) -> None:
    a, b = replay(client, "slime_generate_seeded"), replay(client, "slime_generate_seeded")
    assert a.status_code == 200, a.text
    assert a.json()["output_ids"] == b.json()["output_ids"]  # sampling_seed: deterministic
    body = fixture("slime_generate_seeded")["body"]
    # Same request with a stop string the model actually produces: no_stop_trim keeps it in the text.
    first = a.json()["text"]
    stop = first[2:4] if len(first) >= 4 else None
    if stop:
        body["sampling_params"]["stop"] = [stop]
        kept = client.post("/generate", json=body).json()
        assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert kept["text"].endswith(stop)
        body["sampling_params"]["no_stop_trim"] = False
        trimmed = client.post("/generate", json=body).json()
        assert trimmed["text"] == kept["text"][:kept["text"].find(stop)]
        assert trimmed["output_ids"] == kept["output_ids"]  # ids keep every token, as in SGLang


@pytest.mark.parametrize("key", ["stop", "stop_regex"])
def test_stop_strings_and_regexes_cut_where_the_model_writes_them(client: httpx.Client, key: str) -> None:
    body = fixture("slime_generate_seeded")["body"]
    sp = body["sampling_params"]
    sp.update(stop=None, stop_token_ids=None, ignore_eos=True, max_new_tokens=16)
    whole = client.post("/generate", json=body).json()["text"]  # seeded: the same tokens up to any stop
    assert len(whole) >= 8, whole
    stop = whole[4:6]
    pattern = stop if key == "stop" else re.escape(stop)
    pos = whole.find(stop)
    kept = client.post("/generate", json={**body, "sampling_params": {**sp, key: [pattern], "no_stop_trim": True}})
    assert kept.status_code == 200, kept.text
    assert kept.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert kept.json()["text"].startswith(whole[:pos + len(stop)]) and whole.startswith(kept.json()["text"])
    cut = client.post("/generate", json={**body, "sampling_params": {**sp, key: [pattern], "no_stop_trim": False}})
    assert cut.json()["text"] == whole[:pos]  # trimmed at the match; output_ids keep every token (SGLang)
    assert cut.json()["output_ids"] == kept.json()["output_ids"]
    bad = client.post("/generate", json={**body, "sampling_params": {**sp, "stop_regex": "("}})
    assert bad.status_code in (400, 422) and "stop_regex" in bad.text


def test_routed_experts_are_refused_with_400_naming_the_field(client: httpx.Client) -> None:
    r = replay(client, "slime_generate_routing_replay")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "return_routed_experts" and "return_routed_experts" in err["message"]


def test_slime_drain_abort_all_then_loads_reports_idle(engine: EngineProc, client: httpx.Client) -> None:
    body = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(httpx.post, f"{engine.url}/generate", json=body, timeout=60) for _ in range(3)]
        deadline = time.monotonic() + 20
        while client.get("/get_load").json()[0]["num_reqs"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        loads = client.get("/v1/loads", params={"include": "core,disagg,queues"}).json()
        assert loads["loads"][0]["num_running_reqs"] + loads["loads"][0]["num_waiting_reqs"] == 3
        assert replay(client, "slime_abort_all").status_code == 200
        for f in futs:
            assert f.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    load = client.get("/v1/loads", params={"include": "core,disagg,queues"}).json()["loads"][0]
    busy = load["num_running_reqs"] + load["num_waiting_reqs"] + sum(load["queues"].values())
    assert busy == 0 and load["dp_rank"] == 0 and 0 <= load["token_usage"] <= 1
    assert client.get("/v1/loads", params={"include": "bogus"}).status_code == 400
    prom = client.get("/v1/loads", params={"format": "prometheus"}).text
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in prom


def test_native_text_request_matches_reference_and_detokenizes(engine: EngineProc, client: httpx.Client,
                                                               local: Any) -> None:
    tok = load_tokenizer(engine.model_dir)
    r = replay(client, "sglang_native_text")
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode("The capital of France is")
    ref = greedy_ignore_eos(local, ids, len(body["output_ids"]))
    assert body["output_ids"] == ref
    fr = body["meta_info"]["finish_reason"]
    shown = body["output_ids"][:-1] if fr["type"] == "stop" else body["output_ids"]  # stop token trimmed
    assert body["text"] == tok.decode(shown, skip_special_tokens=True)


def test_stream_sends_cumulative_sse_chunks_then_done(client: httpx.Client) -> None:
    fx = fixture("sglang_native_stream")
    whole = client.post("/generate", json={**fx["body"], "stream": False}).json()
    chunks: list[dict[str, Any]] = []
    with client.stream("POST", "/generate", json=fx["body"]) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        assert ln.startswith("data: ")
        chunks.append(json.loads(ln[6:]))
    n = len(whole["output_ids"])
    assert len(chunks) >= min(n, 2)  # token by token, not one blob
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_batch_and_parallel_sampling_return_one_object_per_sample(client: httpx.Client, engine: EngineProc,
                                                                  local: Any) -> None:
    r = replay(client, "sglang_batch_text")
    assert r.status_code == 200, r.text
    out = r.json()
    tok = load_tokenizer(engine.model_dir)
    assert [o["meta_info"]["id"] for o in out] == ["batch-a", "batch-b"]
    for o, prompt in zip(out, ["abc", "hello world"], strict=True):
        assert o["output_ids"] == greedy_ignore_eos(local, tok.encode(prompt), len(o["output_ids"]))
    par = replay(client, "sglang_parallel_n").json()
    assert isinstance(par, list) and len(par) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in par] == [3, 3, 2, 2]  # grouped by prompt
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 5 for o in par)
    assert len({o["meta_info"]["id"] for o in par}) == 4
    single_n = client.post("/generate", json={"input_ids": [30, 31], "sampling_params": {"n": 3, "max_new_tokens": 2}})
    assert isinstance(single_n.json(), list) and len(single_n.json()) == 3


def test_top_logprobs_have_sglang_shape_and_reference_values(client: httpx.Client, engine: EngineProc,
                                                             local: Any) -> None:
    r = replay(client, "sglang_logprobs_top")
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    ids = load_tokenizer(engine.model_dir).encode("abc")
    out = r.json()["output_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(local(torch.tensor([ids + out])).logits[0].float(), -1)
    top = meta["output_top_logprobs"]
    assert len(top) == len(out) and all(len(pos) == 3 for pos in top)
    for j, pos in enumerate(top):
        want = lp[len(ids) - 1 + j].topk(3)
        assert [e[1] for e in pos] == want.indices.tolist()
        assert all(abs(e[0] - v) < 1e-4 for e, v in zip(pos, want.values.tolist(), strict=True))
        assert all(isinstance(e[2], str) for e in pos)  # return_text_in_logprobs
        assert pos[0][1] == out[j]  # greedy: the sampled token is the top one
    itop = meta["input_top_logprobs"]
    assert itop[0] is None and len(itop) == len(ids)
    assert [e[1] for e in itop[1]] == lp[0].topk(3).indices.tolist()
    tid = meta["output_token_ids_logprobs"]
    assert [[e[1] for e in pos] for pos in tid] == [[5, 6]] * len(out)
    assert abs(tid[0][0][0] - lp[len(ids) - 1, 5].item()) < 1e-4


def test_penalties_min_p_bias_and_min_new_tokens_change_what_is_generated(client: httpx.Client,
                                                                          local: Any) -> None:
    ids = [20, 21, 22, 23]

    def gen(**sp: Any) -> dict[str, Any]:
        r = client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                           "sampling_params": {"temperature": 0, "max_new_tokens": 12, **sp}})
        assert r.status_code == 200, r.text
        return dict(r.json())

    plain = gen(ignore_eos=True)["output_ids"]
    assert plain == greedy_ignore_eos(local, ids, 12)
    # frequency/presence: a repeated token is pushed away (the greedy plain output repeats tokens)
    if len(set(plain)) < len(plain):
        assert gen(ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)["output_ids"] != plain
    # logit_bias forces one token everywhere
    forced = gen(ignore_eos=True, logit_bias={"77": 100.0})["output_ids"]
    assert forced == [77] * 12
    # repetition_penalty only weighs generated tokens: the first token is unchanged, repeats are not
    rep = gen(ignore_eos=True, repetition_penalty=2.0)["output_ids"]
    assert rep[0] == plain[0] and (rep != plain or len(set(plain)) == len(plain))
    # min_new_tokens: the stop token cannot end the request early
    stop_tok = plain[1]
    early = gen(stop_token_ids=[stop_tok], ignore_eos=True)
    assert early["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    late = gen(stop_token_ids=[stop_tok], ignore_eos=True, min_new_tokens=6)
    assert len(late["output_ids"]) >= 6 and stop_tok not in late["output_ids"][:6]
    # min_p = 1 keeps only the most likely token: sampling at T=1 becomes greedy
    sampled = gen(ignore_eos=True, temperature=1.0, min_p=1.0)["output_ids"]
    assert sampled == plain
    # null means default, as in SGLang
    assert gen(ignore_eos=True, top_p=None, top_k=None, min_p=None)["output_ids"] == plain


def test_refused_fields_are_400_naming_each(client: httpx.Client) -> None:
    for case in fixture("sglang_refused")["cases"]:
        r = client.post("/generate", json=case["body"])
        assert r.status_code == 400, (case, r.text)
        assert r.json()["error"]["param"] == case["field"], r.text
    assert client.post("/generate", json={"text": "hi", "no_such_field": 1}).status_code == 422


def test_accepted_bookkeeping_fields(client: httpx.Client) -> None:
    body = {"text": "abc", "session_id": "s-1", "rid": "bk-1", "log_metrics": False, "custom_labels": {"a": "b"},
            "routing_key": "k", "conversation_id": "c", "extra_key": "e", "cache_salt": "salt", "no_logs": True,
            "routed_dp_rank": 0, "external_trace_header": {}, "received_time": 1.0,
            "sampling_params": {"max_new_tokens": 2, "stream_interval": 1, "custom_params": {"x": 1}}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert client.post("/generate", json={**body, "routed_dp_rank": 1}).json()["error"]["param"] == "routed_dp_rank"


def _wait_running(client: httpx.Client) -> None:
    """Until one request is in the running batch (pinned to the weights it started on)."""
    def running() -> bool:
        load = client.get("/get_load").json()[0]
        return bool(load["num_reqs"] - load["num_waiting_reqs"] >= 1)

    wait_for(running, 60, "a running request", why=lambda: str(client.get("/get_load").json()), period=0.01)


def test_weight_update_waits_for_in_flight_requests_so_each_response_has_one_version(
        engine: EngineProc, client: httpx.Client) -> None:
    engine.reset("fx-1")
    body = {"input_ids": [33, 34, 35], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(httpx.post, f"{engine.url}/generate", json=body, timeout=120)
        _wait_running(client)  # running, not only queued: a queued request starts on the new weights
        up = replay(client, "sglang_update_weights_from_disk", engine)
        assert up.status_code == 200 and up.json()["success"] is True, up.text
        meta = fut.result().json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length"  # finished, not cut
    assert meta["output_token_versions"] == ["fx-1"] * 300 and meta["weight_version"] == "fx-1"
    assert client.get("/get_weight_version").json()["weight_version"] == "fx-2"
    assert client.get("/get_model_info").json()["model_path"] == str(engine.second_dir)
    # abort_all_requests: in-flight requests are aborted instead of awaited
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(httpx.post, f"{engine.url}/generate", json={**body, "sampling_params": {
            "max_new_tokens": 1500, "ignore_eos": True}}, timeout=120)
        _wait_running(client)
        up = client.post("/update_weights_from_disk", json={"model_path": str(engine.model_dir),
                                                            "weight_version": "fx-3", "abort_all_requests": True})
        assert up.json()["num_paused_requests"] == 1
        meta = fut.result().json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and set(meta["output_token_versions"]) == {"fx-2"}
    bad = client.post("/update_weights_from_disk", json={"model_path": str(engine.model_dir), "load_format": "pt"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "load_format"


def test_control_endpoints_answer_as_sglang(client: httpx.Client) -> None:
    assert client.get("/flush_cache").status_code == 200
    assert client.post("/flush_cache").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_type"] == "qwen3"
    assert client.get("/health_generate").status_code == 200
    load = client.get("/get_load").json()
    assert load[0]["dp_rank"] == 0 and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
