"""One load-generating client process for test_chaos_proxy_load.py (run as a script, not collected).

``python load_client.py URL API_KEY SECRET N CONCURRENCY SEED OUT.json``: sends N requests to the
proxy over ``CONCURRENCY`` keep-alive connections — mostly valid one- or two-token chat completions,
plus requests without or with a wrong bearer token, oversized bodies and invalid fields — and writes
per-kind status counts, 503 reasons, latencies and how many responses contained a secret.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from typing import Any

import httpx

KINDS = [("valid", 80), ("no_auth", 5), ("wrong_auth", 3), ("oversized", 4), ("invalid", 8)]
INVALID = [{"messages": [{"role": "user", "content": "reverse 12"}], "max_tokens": -1},
           {"max_tokens": 1},
           {"messages": [{"role": "user", "content": "reverse 12"}], "max_tokens": 1, "temperature": "hot"},
           {"messages": "reverse 12", "max_tokens": 1}]


def request(kind: str, rng: random.Random, key: str) -> tuple[dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    body: Any = {"model": "policy", "messages": [{"role": "user", "content": f"reverse {rng.randrange(10, 999)}"}],
                 "max_tokens": rng.choice([1, 2]), "temperature": 1.0}
    if kind == "no_auth":
        del headers["Authorization"]
    elif kind == "wrong_auth":
        headers["Authorization"] = f"Bearer {key[:-2]}xx"
    elif kind == "oversized":
        body["messages"][0]["content"] = "9" * 8192
    elif kind == "invalid":
        body = rng.choice(INVALID)
    return headers, json.dumps(body).encode()


async def run(url: str, key: str, secret: str, n: int, concurrency: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    kinds = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS], k=n)
    status: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    leaks, latencies, errors = 0, [], Counter[str]()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for k in kinds:
        queue.put_nowait(k)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal leaks
        while not queue.empty():
            kind = queue.get_nowait()
            headers, body = request(kind, rng, key)
            t0 = time.perf_counter()
            try:
                resp = await client.post(f"{url}/v1/chat/completions", content=body, headers=headers)
            except httpx.HTTPError as exc:  # a crashed or hung proxy shows up here
                errors[type(exc).__name__] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            status[f"{kind}:{resp.status_code}"] += 1
            text = resp.text
            leaks += (key in text) or (secret in text) or any(key in v or secret in v for v in resp.headers.values())
            if resp.status_code == 503:
                try:
                    reasons[str(resp.json()["detail"]["error"])] += 1
                except (ValueError, KeyError, TypeError):
                    reasons["unparsed"] += 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    latencies.sort()
    return {"status": dict(status), "reasons_503": dict(reasons), "leaks": leaks, "errors": dict(errors),
            "p50_s": latencies[len(latencies) // 2] if latencies else None,
            "p99_s": latencies[int(len(latencies) * 0.99)] if latencies else None}


def main() -> None:
    url, key, secret, n, conc, seed, out = sys.argv[1:8]
    result = asyncio.run(run(url, key, secret, int(n), int(conc), int(seed)))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
