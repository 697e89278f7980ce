"""The proxy's engine choice (services.proxy.balancer): least loaded for new sessions, sticky after, bounded."""

from __future__ import annotations

from services.proxy.balancer import Balancer, parse_load

E = ["http://e0", "http://e1", "http://e2"]


def test_new_sessions_go_to_the_least_loaded_engine() -> None:
    b = Balancer(E)
    picks = []
    for i in range(6):
        url = b.order(f"s{i}")[0]
        b.started(url)
        picks.append(url)
    assert sorted(picks.count(u) for u in E) == [2, 2, 2]
    b.set_remote("http://e0", 10)  # another proxy's load on e0
    assert b.order("new")[-1] == "http://e0"
    b.finished("http://e1")
    b.finished("http://e1")
    assert b.order("new")[0] == "http://e1"


def test_sessions_stick_to_their_engine_until_it_is_excluded() -> None:
    b = Balancer(E)
    b.assign("s", "http://e2")
    for _ in range(5):
        b.started("http://e2")  # busiest, still first for its own session
    assert b.order("s")[0] == "http://e2"
    assert b.order("s", {"http://e2"})[0] != "http://e2" and "http://e2" not in b.order("s", {"http://e2"})
    b.forget("s")
    assert b.order("s")[0] != "http://e2"


def test_ties_are_deterministic_per_session_and_the_sticky_map_is_bounded() -> None:
    b = Balancer(E, max_sessions=2)
    assert b.order("x") == Balancer(E).order("x")
    assert len({b.order(f"k{i}")[0] for i in range(30)}) == 3  # equal loads: spread by the session id
    for s in ("a", "b", "c"):
        b.assign(s, "http://e1")
    assert sum(v["sticky_sessions"] for v in b.snapshot().values()) == 2
    assert set(b.snapshot()) == {"engine-0", "engine-1", "engine-2"}  # never URLs


def test_parse_load_reads_sglang_get_load_and_v1_loads_shapes() -> None:
    assert parse_load([{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 9},
                       {"dp_rank": 1, "num_reqs": 2}]) == 5
    assert parse_load({"num_running_reqs": 2, "num_waiting_reqs": 4}) == 6
    assert parse_load("garbage") is None and parse_load([{"x": 1}]) is None
