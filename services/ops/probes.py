"""Samples of the engine's and the proxy's own clocks, for the run's time decomposition.

``dressage up`` reports them every few seconds as service ``ops`` rows in ``{p}:metrics``:
``engine/busy_s`` (the engine scheduler's cumulative seconds with a forward pass running,
summed over the run's engines) and ``proxy/weight_update_s`` / ``proxy/weight_updates`` (the
proxy's cumulative weight-publication pause: pause, engine loads, resume). Differences between
two samples divided by the time between them give the busy and pause fractions
(``services.ops.timing``). A probe that fails returns nothing: telemetry never stops a run.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)
TIMEOUT_S = 2.0


def _get_json(url: str, token: str | None) -> dict[str, Any] | None:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:  # noqa: S310 (loopback URLs of this run)
            body = json.loads(resp.read())
    except (OSError, ValueError, urllib.error.URLError) as exc:
        log.debug("probe %s failed: %s", url, exc)
        return None
    return body if isinstance(body, dict) else None


class ServiceProbe:
    """``sample()`` -> the newest cumulative clocks of the engines and the proxy (absent when unreachable)."""

    def __init__(self, engines: Sequence[str], proxy: str | None, proxy_token: str | None = None,
                 engine_token: str | None = None) -> None:
        self.engines = [e.rstrip("/") for e in engines]
        self.proxy = proxy.rstrip("/") if proxy else None
        self.proxy_token, self.engine_token = proxy_token, engine_token

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        busy = [b for b in (_get_json(f"{e}/health", self.engine_token) for e in self.engines) if b is not None]
        if busy and len(busy) == len(self.engines) and all("busy_s" in b for b in busy):
            out["engine/busy_s"] = round(sum(float(b["busy_s"]) for b in busy), 4)
        if self.proxy:
            state = _get_json(f"{self.proxy}/v1/rollout/state", self.proxy_token)
            if state is not None and "weight_update_seconds_total" in state:
                out["proxy/weight_update_s"] = float(state["weight_update_seconds_total"])
                out["proxy/weight_updates"] = float(state.get("weight_updates_total", 0))
        return out
