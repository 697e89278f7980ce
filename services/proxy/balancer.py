"""Which engine serves a session: the least loaded one for a new session, the same one after (sticky).

Pure bookkeeping, no I/O (the runtime feeds it the engines' load answers: ``/get_load``, or
``/v1/loads``' per-rank ``loads`` for SGLang 0.5.21+).

Invariants:
* a session stays on the engine that served its last chunk while that engine is routable (its
  KV / prefix cache stays warm); it moves only when that engine is excluded (down, or behind the
  published weights). Correctness never depends on it: every chunk carries all its tokens;
* a new session (or a moved one) goes to the routable engine with the lowest load; equal loads
  are broken by the rendezvous rank of the session id (deterministic, spreads ties evenly);
* an engine's load is the larger of the requests this proxy has in flight there and the engine's
  own count (SGLang ``/get_load``: ``num_reqs`` summed over dp ranks; ``/v1/loads``' ``num_running_reqs
  + num_waiting_reqs`` is the same figure) — several proxies sharing engines see each other's load
  through the second, and a stale poll never hides this proxy's own requests;
* ``order`` lists every routable engine (sticky one first, then by load): the caller fails over
  along it; the sticky map keeps the newest ``max_sessions`` sessions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from services.proxy.engine_client import rank_engines


def parse_load(body: Any) -> int | None:
    """Requests an engine holds, from SGLang's ``/get_load`` (list per dp rank, or one object); None if unreadable."""
    ranks = body if isinstance(body, list) else [body]
    total = 0
    for rank in ranks:
        if not isinstance(rank, dict):
            return None
        n = rank.get("num_reqs")
        if n is None and "num_running_reqs" in rank:  # /v1/loads shape
            n = int(rank.get("num_running_reqs") or 0) + int(rank.get("num_waiting_reqs") or 0)
        if not isinstance(n, int | float):
            return None
        total += int(n)
    return total


class Balancer:
    def __init__(self, engines: Iterable[str], max_sessions: int = 100_000) -> None:
        self.engines = list(engines)
        self.max_sessions = max_sessions
        self.local: dict[str, int] = dict.fromkeys(self.engines, 0)  # this proxy's requests in flight
        self.remote: dict[str, int] = dict.fromkeys(self.engines, 0)  # the engine's own count (last poll)
        self._sticky: OrderedDict[str, str] = OrderedDict()

    def load(self, url: str) -> int:
        return max(self.local.get(url, 0), self.remote.get(url, 0))

    def order(self, session_id: str, excluded: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Routable engines for ``session_id``: its sticky engine first, then least loaded first."""
        routable = [u for u in self.engines if u not in excluded]
        if len(routable) <= 1:
            return routable
        tie = {u: i for i, u in enumerate(rank_engines(routable, session_id))}
        ranked = sorted(routable, key=lambda u: (self.load(u), tie[u]))
        sticky = self._sticky.get(session_id)
        if sticky in routable:
            ranked.remove(sticky)
            ranked.insert(0, sticky)
        return ranked

    def started(self, url: str) -> None:
        self.local[url] = self.local.get(url, 0) + 1

    def finished(self, url: str) -> None:
        self.local[url] = max(0, self.local.get(url, 0) - 1)

    def assign(self, session_id: str, url: str) -> None:
        """``url`` served ``session_id``: its next chunks go there while it is routable."""
        self._sticky[session_id] = url
        self._sticky.move_to_end(session_id)
        while len(self._sticky) > self.max_sessions:
            self._sticky.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self._sticky.pop(session_id, None)

    def set_remote(self, url: str, load: int | None) -> None:
        if load is not None and url in self.remote:
            self.remote[url] = load

    def snapshot(self) -> dict[str, Any]:
        sessions: dict[str, int] = dict.fromkeys(self.engines, 0)
        for url in self._sticky.values():
            sessions[url] = sessions.get(url, 0) + 1
        # Named engine-<i> (its index in proxy.engines), like everywhere a client can see: URLs stay internal.
        return {f"engine-{i}": {"in_flight": self.local[url], "engine_load": self.remote[url],
                                "sticky_sessions": sessions[url]} for i, url in enumerate(self.engines)}
