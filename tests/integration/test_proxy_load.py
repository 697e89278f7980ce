"""Proxy under load (issue 7, security and limits): 10,000 requests from many concurrent client
processes, a mix of valid and bad ones, against ``dressage proxy`` as a real process.

It must never crash; every accepted request reaches an engine exactly once (the engine sees each
accepted session's rid once, and no rejected session at all); rejected requests get
401/413/422/503 only; memory stays bounded. The engine here is an instant SGLang-shaped stub that
logs every rid (a real model could not answer 10,000 requests within the test's time).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
import yaml
from proxy_support import REPO, free_port, wait_healthy
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from shared.keys import Keys
from shared.modeling import build_tokenizer, save_tokenizer
from shared.redisproc import RedisProcess

KEY = "load-test-key-abcdef0123"
TOTAL, PROCS, CONCURRENCY = 10_000, 4, 24  # requests, client processes, requests in flight per process


class RidLog:
    """Instant engine: answers 4 tokens at once and logs the rid of every /generate it receives."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.app = Starlette(routes=[Route("/generate", self.generate, methods=["POST"]),
                                     Route("/get_weight_version", self.version, methods=["GET"]),
                                     Route("/health", self.version, methods=["GET"])])

    async def generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.rids.append(body["rid"])
        await asyncio.sleep(0.002)  # a little service time, so requests overlap
        meta = {"finish_reason": {"type": "length"}, "weight_version": "0", "output_token_versions": ["0"] * 4,
                "output_token_logprobs": [[-0.1, t, None] for t in (10, 11, 12, 13)]}
        return JSONResponse({"text": "", "output_ids": [10, 11, 12, 13], "meta_info": meta})

    async def version(self, request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": "0", "status": "ok"})


def request_for(i: int) -> tuple[str, dict[str, str], Any]:
    """The i-th request of the mix: (kind, headers, json body or raw bytes)."""
    auth = {"Authorization": f"Bearer {KEY}", "X-Session-Id": f"load-{i}"}
    kind = ("valid", "valid", "valid", "valid", "valid", "valid", "unauth", "big", "invalid", "bad_json")[i % 10]
    msg = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
    if kind == "unauth":
        return kind, {**auth, "Authorization": "Bearer wrong"}, msg
    if kind == "big":
        return kind, auth, {"messages": [{"role": "user", "content": "x" * 5000}]}
    if kind == "invalid":
        return kind, auth, {**msg, "max_tokens": 10_000}
    if kind == "bad_json":
        return kind, auth, b"{not json"
    return kind, auth, msg


def client_proc(url: str, indices: list[int], out: Any) -> None:
    async def main() -> list[tuple[int, str, int]]:
        results: list[tuple[int, str, int]] = []
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=CONCURRENCY)) as c:
            async def one(i: int) -> None:
                kind, headers, body = request_for(i)
                kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
                async with sem:
                    r = await c.post("/v1/chat/completions", headers=headers, **kw)
                results.append((i, kind, r.status_code))
            await asyncio.gather(*(one(i) for i in indices))
        return results
    out.put(asyncio.run(main()))


@pytest.fixture
def stub_engine() -> Iterator[tuple[str, RidLog]]:
    log = RidLog()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(log.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", log
    server.should_exit = True
    thread.join(10)


def test_ten_thousand_mixed_requests_never_crash_and_accepted_ones_reach_the_engine_once(
        stub_engine: tuple[str, RidLog], redis_server: RedisProcess, keys: Keys, tmp_path: Path) -> None:
    engine_url, rid_log = stub_engine
    save_tokenizer(build_tokenizer(), tmp_path / "tok")
    port = free_port()
    cfg = {"redis": {"url": redis_server.url, "prefix": keys.prefix},
           "model": {"path": str(tmp_path / "tok")},
           "proxy": {"port": port, "engines": [engine_url], "api_key": KEY, "max_body_bytes": 4096,
                     "max_tokens_limit": 64, "max_concurrency": 48, "follow_versions": False}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    log_path = tmp_path / "proxy.log"
    proc = subprocess.Popen([sys.executable, "-m", "services.proxy", "--config", str(tmp_path / "cfg.yaml")],
                            cwd=REPO, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path)
        rss_before = psutil.Process(proc.pid).memory_info().rss
        q: Any = mp.get_context("spawn").Queue()
        clients = [mp.get_context("spawn").Process(target=client_proc, args=(url, list(range(k, TOTAL, PROCS)), q))
                   for k in range(PROCS)]
        for c in clients:
            c.start()
        results = [r for _ in clients for r in q.get(timeout=120)]
        for c in clients:
            c.join(10)
        assert proc.poll() is None, "proxy crashed"
        assert httpx.get(f"{url}/health").status_code == 200
        rss_growth_mb = (psutil.Process(proc.pid).memory_info().rss - rss_before) / 2**20
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0 and KEY not in log_path.read_text()
    assert len(results) == TOTAL
    by_kind = Counter((kind, status) for _, kind, status in results)
    expected = {"valid": {200, 503}, "unauth": {401}, "big": {413}, "invalid": {422}, "bad_json": {422}}
    assert all(status in expected[kind] for kind, status in by_kind), by_kind
    accepted = {f"load-{i}" for i, _, status in results if status == 200}
    seen = Counter(rid.split("-", 1)[1].rsplit("-", 1)[0] for rid in rid_log.rids)  # rid = dressage-<sid>-<hex>
    assert set(seen) == accepted and set(seen.values()) == {1}  # each accepted once; no rejected one
    assert len(accepted) >= TOTAL * 0.6 * 0.5  # most valid requests got through
    assert rss_growth_mb < 200, f"proxy grew by {rss_growth_mb:.0f} MiB"
