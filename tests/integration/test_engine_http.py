"""The engine as a real process on loopback: SGLang's HTTP API, aborts, pause, weight swaps, bad bodies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from paths import REPO
from reference_model import greedy_ignore_eos, save_perturbed
from waits import wait_for

from shared.modeling import ModelSpec, build_model_dir, load_model, load_tokenizer
from shared.redisproc import free_port

torch.set_num_threads(1)
LONG = 1500  # a generation that is always interrupted before it ends


@dataclass
class Engine:
    url: str
    model_dir: Path
    perturbed_dir: Path
    perturbed: Any  # the model saved in perturbed_dir (weights only, no tokenizer)
    proc: subprocess.Popen[bytes]
    client: httpx.Client
    pool: ThreadPoolExecutor

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return self.client.post(path, json=body)

    def background(self, body: dict[str, Any]) -> Future[httpx.Response]:
        return self.pool.submit(self.client.post, "/generate", json=body)

    def info(self) -> dict[str, Any]:
        return self.client.get("/get_server_info").json()

    def wait_tokens(self, more_than: int, timeout: float = 20) -> None:
        """Wait until the engine has produced `more_than` tokens beyond its count now."""
        start = self.info()["generated_tokens"]
        wait_for(lambda: self.info()["generated_tokens"] - start >= more_than, timeout, "engine tokens",
                 period=0.01)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("engine")
    model_dir, perturbed = root / "model", root / "step-1"
    build_model_dir(model_dir, "reverse", ModelSpec(max_position_embeddings=2048), seed=0)
    m = save_perturbed(model_dir, perturbed)
    port = free_port()
    env = {**os.environ, "DRESSAGE_ENGINE_NUM_THREADS": "1", "DRESSAGE_ENGINE_MAX_NEW_TOKENS_LIMIT": "1600",
           "DRESSAGE_ENGINE_MAX_BATCH_SIZE": "16", "DRESSAGE_TRAIN_CHECKPOINT_DIR": str(root)}  # weights load from root
    log = (root / "engine.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--model-path", str(model_dir),
                             "--port", str(port), "--weight-version", "v0"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, (root / "engine.log").read_text()
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "engine did not become healthy"
        time.sleep(0.2)
    eng = Engine(f"http://127.0.0.1:{port}", model_dir, perturbed, m, proc, client, ThreadPoolExecutor(16))
    yield eng
    eng.pool.shutdown(wait=True)
    client.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0, (root / "engine.log").read_text()  # graceful stop on SIGTERM


@pytest.fixture(scope="module")
def local(engine: Engine) -> Any:
    return load_model(engine.model_dir)


def gen(ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
    sp = {"max_new_tokens": n, "temperature": 0.0, **extra.pop("sampling", {})}
    return {"input_ids": ids, "sampling_params": sp, **extra}


def test_concurrent_greedy_requests_match_one_by_one_generate(engine: Engine, local: Any) -> None:
    version = engine.client.get("/get_weight_version").json()["weight_version"]
    prompts = [[5 + (i * 7 + j * 3) % 90 for j in range(3 + i)] for i in range(8)]
    futs = [engine.background(gen(p, 24, return_logprob=True, sampling={"ignore_eos": True})) for p in prompts]
    for p, fut in zip(prompts, futs, strict=True):
        r = fut.result()
        assert r.status_code == 200, r.text
        body, meta = r.json(), r.json()["meta_info"]
        ref = greedy_ignore_eos(local, p, 24)
        assert body["output_ids"] == ref
        with torch.no_grad():
            lp = torch.log_softmax(local(torch.tensor([p + ref])).logits[0], -1)
        for j, (logprob, tok, text) in enumerate(meta["output_token_logprobs"]):
            assert tok == ref[j] and text is None
            assert abs(logprob - lp[len(p) - 1 + j, tok].item()) < 1e-4
        assert meta["finish_reason"] == {"type": "length", "length": 24}
        assert meta["prompt_tokens"] == len(p) and meta["completion_tokens"] == 24
        assert meta["weight_version"] == version and meta["output_token_versions"] == [version] * 24
    assert engine.info()["prefills"] >= 1


def test_text_prompt_is_tokenized_and_output_detokenized(engine: Engine) -> None:
    tok = load_tokenizer(engine.model_dir)
    r = engine.post("/generate", {"text": "abc", "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                                  "return_logprob": True, "return_text_in_logprobs": True,
                                  "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["prompt_tokens"] == 3
    assert body["text"] == tok.decode(body["output_ids"], skip_special_tokens=True)
    assert [e[2] for e in body["meta_info"]["output_token_logprobs"]] == [tok.decode([t]) for t in body["output_ids"]]
    first = body["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in first] == tok.encode("abc") and first[0][0] is None and first[0][2] == "a"


def test_abort_mid_generation_returns_partial_tokens_at_once(engine: Engine) -> None:
    fut = engine.background(gen([10, 11, 12], LONG, rid="to-abort", sampling={"ignore_eos": True}))
    engine.wait_tokens(20)
    t0 = time.monotonic()
    assert engine.post("/abort_request", {"rid": "to-abort"}).json() == {"aborted": 1}
    r = fut.result(timeout=10)
    assert time.monotonic() - t0 < 2.0
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "to-abort"
    assert 0 < meta["completion_tokens"] == len(r.json()["output_ids"]) < LONG
    assert engine.post("/abort_request", {"rid": "to-abort"}).json() == {"aborted": 0}


def test_duplicate_in_flight_rid_is_rejected(engine: Engine) -> None:
    fut = engine.background(gen([10, 11], LONG, rid="dup", sampling={"ignore_eos": True}))
    engine.wait_tokens(5)
    r = engine.post("/generate", gen([3, 4], 2, rid="dup"))
    assert r.status_code == 400 and "dup" in r.json()["error"]["message"]
    engine.post("/abort_request", {"abort_all": True})
    assert fut.result(timeout=10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.post("/generate", gen([3, 4], 2, rid="dup")).status_code == 200  # free again


def test_pause_aborts_in_flight_and_holds_new_requests_until_continue(engine: Engine) -> None:
    running = engine.background(gen([20, 21], LONG, sampling={"ignore_eos": True}))
    engine.wait_tokens(5)
    r = engine.post("/pause_generation", {"mode": "abort"})
    assert r.status_code == 200 and r.json()["aborted"] >= 1
    assert running.result(timeout=10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    held = engine.background(gen([22, 23], 4))
    time.sleep(0.5)
    assert not held.done() and engine.info()["paused"] is True
    assert engine.post("/continue_generation").status_code == 200
    assert held.result(timeout=10).json()["meta_info"]["completion_tokens"] >= 1


def test_weight_update_mid_generation_changes_the_version_per_token(engine: Engine) -> None:
    """The opt-in extension: a request that may run across a swap tags every token with its version."""
    fut = engine.background(gen([30, 31, 32], LONG, sampling={"ignore_eos": True},
                                continue_across_weight_updates=True))
    engine.wait_tokens(10)
    r = engine.post("/update_weights_from_disk", {"model_path": str(engine.perturbed_dir), "weight_version": "v1"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    engine.wait_tokens(10)
    engine.post("/abort_request", {"abort_all": True})
    meta = fut.result(timeout=10).json()["meta_info"]
    versions = meta["output_token_versions"]
    n_old = versions.count("v0")
    assert n_old > 0 and versions == ["v0"] * n_old + ["v1"] * (len(versions) - n_old) and versions[-1] == "v1"
    assert meta["weight_version"] == "v1"
    assert engine.client.get("/get_weight_version").json() == {"weight_version": "v1"}
    assert engine.client.get("/model_info").json()["model_path"] == str(engine.perturbed_dir)
    # New requests run on the new weights.
    ref = greedy_ignore_eos(engine.perturbed, [40, 41, 42], 8)
    assert engine.post("/generate", gen([40, 41, 42], 8, sampling={"ignore_eos": True})).json()["output_ids"] == ref
    # A checkpoint that cannot be loaded is refused and the serving weights stay.
    bad = engine.post("/update_weights_from_disk", {"model_path": str(engine.perturbed_dir / "nope"),
                                                    "weight_version": "v9"})
    assert bad.status_code == 400 and bad.json()["success"] is False and "does not exist" in bad.json()["message"]
    assert engine.client.get("/get_weight_version").json() == {"weight_version": "v1"}
    back = engine.post("/update_weights_from_disk", {"model_path": str(engine.model_dir), "weight_version": 2})
    assert back.json()["weight_version"] == "2"


@pytest.mark.parametrize(("body", "field"), [
    ({"input_ids": [], "sampling_params": {}}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2, 100000]}, "input_ids"),
    ({"input_ids": [1] * 2048}, "input_ids"),
    ({"input_ids": [1], "text": "a"}, "text"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p"),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}}, "min_new_tokens"),
    ({"input_ids": [[1], []]}, "input_ids"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 1}, "logprob_start_len"),
])
def test_bad_generate_bodies_are_422_naming_the_field(engine: Engine, body: dict[str, Any], field: str) -> None:
    r = engine.post("/generate", body)
    assert r.status_code == 422, r.text
    assert field in r.text


def test_control_bodies_are_validated(engine: Engine) -> None:
    assert engine.post("/abort_request", {}).status_code == 422
    assert engine.post("/pause_generation", {"mode": "later"}).status_code == 422
    assert engine.post("/update_weights_from_disk", {"weight_version": "x"}).status_code == 422


def test_model_info_and_health(engine: Engine) -> None:
    info = engine.client.get("/model_info").json()
    assert info["is_generation"] is True and info["context_length"] == 2048 and "weight_version" in info
    health = engine.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert engine.client.get("/health_generate").json()["status"] == "ok"


def test_an_idle_keep_alive_connection_outlives_the_client_pool_expiry(engine: Engine) -> None:
    # httpx drops idle connections after 5 s; the server must keep them longer, or a POST sent on one
    # the server is closing at that instant fails with a read error (shared/serving.KEEP_ALIVE_S).
    host, port = engine.url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock, sock.makefile("rb") as stream:
        for _ in range(2):
            sock.sendall(request)
            assert stream.readline().startswith(b"HTTP/1.1 200")  # a closed socket reads b""
            headers = dict(line.rstrip(b"\r\n").split(b": ", 1) for line in iter(stream.readline, b"\r\n"))
            stream.read(int(headers[b"content-length"]))  # the whole answer: the next read is the next one's
            time.sleep(6)  # longer than uvicorn's default 5-s keep-alive
