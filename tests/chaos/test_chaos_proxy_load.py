"""The proxy under load (issue 7, security and limits): the real proxy in front of the real engine.

``CHAOS_PROXY_REQUESTS`` requests (default 10,000) from four client processes over 32 keep-alive
connections on loopback against a proxy with an API key, ``max_concurrency`` 8, a 4 KiB body limit
and a Redis password: mostly valid one- or two-token chat completions, plus requests without or with
a wrong bearer token, oversized bodies and invalid fields (``load_client.py``). The proxy never
crashes or drops a connection; every accepted request (200) reached the engine exactly once (the
engine's own request counter); every rejected one got 401/413/422/429/503; no response and no log
line carries the API key or the Redis password; the proxy's RSS after warm-up stays under 2×.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from harness import Cluster, Engine

N_REQUESTS = int(os.environ.get("CHAOS_PROXY_REQUESTS", "10000"))
WARMUP = 500
CLIENTS, CONCURRENCY = 4, 8
CLIENT = Path(__file__).with_name("load_client.py")
REJECTED = {401, 413, 422, 429, 503}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def load(url: str, key: str, secret: str, n: int, clients: int, out: Path, seed: int) -> list[dict[str, object]]:
    """Run ``clients`` client processes sharing ``n`` requests; their merged reports."""
    procs = [subprocess.Popen([sys.executable, str(CLIENT), url, key, secret, str(n // clients + (i < n % clients)),
                               str(CONCURRENCY), str(seed + i), str(out / f"client{seed + i}.json")])
             for i in range(clients)]
    for p in procs:
        assert p.wait(600) == 0
    return [json.loads((out / f"client{seed + i}.json").read_text()) for i in range(clients)]


def test_proxy_under_load_never_crashes_passes_each_accepted_request_once_and_rejects_the_rest_cleanly(
        make_cluster: Callable[..., Cluster], engine: Engine, tmp_path: Path) -> None:
    key, password = f"sk-{secrets.token_hex(16)}", f"pw-{secrets.token_hex(12)}"
    with make_cluster(rows=1, password=password, overrides={"proxy": {
            "max_concurrency": 8, "max_body_bytes": 4096, "session_ttl_s": 5.0, "partial_rollout": False}}) as c:
        proxy = c.start("proxy", env={"DRESSAGE_PROXY_API_KEY": key})
        c.wait_up("proxy")
        before = int(engine.counters()["requests"])
        reports = load(c.proxy_url, key, password, WARMUP, 1, tmp_path, seed=100)
        warm = rss_kib(proxy.pid)
        peak = [warm]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.25):
                peak.append(rss_kib(proxy.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        reports += load(c.proxy_url, key, password, N_REQUESTS - WARMUP, CLIENTS, tmp_path, seed=0)
        seconds = time.monotonic() - t0
        done.set()
        sampler.join()
        engine_requests = int(engine.counters()["requests"]) - before
        c.assert_alive("proxy")
        status: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        for r in reports:
            status.update(r["status"])  # type: ignore[call-overload]  # a Counter-shaped dict from the JSON report
            reasons.update(r["reasons_503"])  # type: ignore[call-overload]  # a Counter-shaped dict from the JSON report
            assert r["errors"] == {} and r["leaks"] == 0, r
        assert sum(status.values()) == N_REQUESTS, status
        by_code = Counter({int(k.split(":")[1]): v for k, v in status.items()})
        accepted = by_code[200]
        assert set(by_code) <= {200} | REJECTED, by_code
        assert accepted > 0 and engine_requests == accepted, (engine_requests, by_code)
        # Each kind of bad request is refused for its own reason, never passed on.
        for kind, code in (("no_auth", 401), ("wrong_auth", 401), ("oversized", 413), ("invalid", 422)):
            assert {k for k in status if k.startswith(kind + ":")} == {f"{kind}:{code}"}, status
        assert set(reasons) <= {"over_capacity"}, reasons  # the engine itself never refused
        log = proxy.tail(10**7)
        assert key not in log and password not in log
        assert max(peak) < 2 * warm, (warm, max(peak))
        c.record_figures("proxy_load", requests=N_REQUESTS, seconds=round(seconds, 1), accepted=accepted,
                         engine_requests=engine_requests, codes=dict(by_code), rss_warm_kib=warm,
                         rss_peak_kib=max(peak))
