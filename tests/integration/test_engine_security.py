"""The engine trusts no one by default (issue 16), as a real process on loopback.

Attacks replayed: unauthenticated /generate, /pause_generation, /abort_request and
/update_weights_from_disk; loading an all-zero checkpoint from outside the checkpoint root (also
through a symlink inside it) as version 999999; probing which paths exist from error messages;
2 MB bodies; 100k-deep JSON and lone surrogates giving a 500.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from paths import REPO
from proxy_support import wait_healthy

from shared.modeling import ModelSpec, build_model_dir, load_model
from shared.redisproc import free_port

KEY = "engine-key-for-tests-0123456789"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Path, Path]]:
    root = tmp_path_factory.mktemp("engine-sec")
    model_dir, ckpts, outside = root / "model", root / "checkpoints", root / "elsewhere" / "zeros"
    build_model_dir(model_dir, "reverse", ModelSpec(max_position_embeddings=256), seed=0)
    zeros = load_model(model_dir)
    with torch.no_grad():
        for p in zeros.parameters():
            p.zero_()
    zeros.save_pretrained(outside, safe_serialization=True)
    ckpts.mkdir()
    os.symlink(outside, ckpts / "step-999999")  # inside by name, outside once resolved
    port = free_port()
    env = {**os.environ, "DRESSAGE_ENGINE_NUM_THREADS": "1", "DRESSAGE_ENGINE_API_KEY": KEY,
           "DRESSAGE_ENGINE_MAX_BODY_BYTES": str(64 << 10), "DRESSAGE_TRAIN_CHECKPOINT_DIR": str(ckpts)}
    log = root / "engine.log"
    proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--model-path", str(model_dir), "--port",
                             str(port), "--weight-version", "0"], cwd=REPO, env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    wait_healthy(f"http://127.0.0.1:{port}", proc, log)
    try:
        yield client, ckpts, outside
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert KEY not in log.read_text()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
    ("/pause_generation", {}), ("/continue_generation", {}), ("/abort_request", {"abort_all": True}),
    ("/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "999999"}), ("/flush_cache", {}),
])
def test_every_route_but_health_needs_the_key(engine: tuple[httpx.Client, Path, Path], path: str,
                                              body: dict[str, object]) -> None:
    client, _, _ = engine
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 401 and KEY not in r.text, (path, r.status_code)
    assert client.get("/get_weight_version", headers=auth()).json()["weight_version"] == "0"
    assert client.get("/health").status_code == 200


def test_model_path_is_confined_and_errors_reveal_no_path(engine: tuple[httpx.Client, Path, Path]) -> None:
    client, ckpts, outside = engine
    answers = []
    for path in (str(outside), str(ckpts / "step-999999"), str(ckpts / ".." / "elsewhere" / "zeros"), "/etc",
                 "/definitely/not/here"):
        r = client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": "999999"},
                        headers=auth())
        assert r.status_code == 400 and r.json()["success"] is False, (path, r.text)
        answers.append(r.json()["message"])
    assert len(set(answers)) == 1 and "/" not in answers[0]  # same answer whether the path exists or not
    assert client.get("/get_weight_version", headers=auth()).json()["weight_version"] == "0"
    missing = client.post("/update_weights_from_disk", json={"model_path": str(ckpts / "step-5")}, headers=auth())
    assert missing.status_code == 400 and str(ckpts) not in missing.text


@pytest.mark.parametrize(("raw", "status", "words"), [
    (b'{"text": "' + b"x" * (2 << 20) + b'"}', 413, "max_body_bytes"),
    (b"[" * 30_000 + b"]" * 30_000, 400, "nested deeper"),
    (b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 1}}', 400, "surrogate"),
])
def test_bad_bodies_are_4xx_with_a_reason(engine: tuple[httpx.Client, Path, Path], raw: bytes, status: int,
                                          words: str) -> None:
    client, _, _ = engine
    r = client.post("/generate", content=raw, headers={**auth(), "content-type": "application/json"})
    assert r.status_code == status and words in r.text, r.text[:300]
    assert client.get("/health").status_code == 200
