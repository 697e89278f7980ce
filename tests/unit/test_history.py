"""History checker on fakeredis: each violation it claims to detect is detected, a clean run passes.

The checker lives beside the chaos tests that use it (tests/chaos/history.py)."""

from __future__ import annotations

import json
import sys

import fakeredis
import pytest
from paths import REPO
from rollout_factory import prompt_group, rollout_group

from shared.codec import encode_entry
from shared.keys import GROUP_ROLLOUT, GROUP_TRAINER, Keys
from shared.schemas import Batch, Window
from shared.streams import dead_letter_fields, ensure_group

sys.path.insert(0, str(REPO / "tests" / "chaos"))
import history  # noqa: E402
from history import History, collect, poll  # noqa: E402

K = Keys("h")
TRAINED = K.trainer_trained


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    r = fakeredis.FakeRedis()
    for stream, group in ((K.prompts, GROUP_ROLLOUT), (K.batches, GROUP_TRAINER)):
        ensure_group(r, stream, group)
    return r


def enqueue(r: fakeredis.FakeRedis, gid: str, attempt: int = 0, consume: bool = True) -> bytes:
    """Put an attempt on {p}:prompts; ``consume`` reads and acknowledges it (a worker handled it)."""
    eid: bytes = r.xadd(K.prompts, encode_entry(prompt_group(gid, attempt)))
    if consume:
        r.xreadgroup(GROUP_ROLLOUT, "w", {K.prompts: ">"})
        r.xack(K.prompts, GROUP_ROLLOUT, eid)
    return eid


def batch(r: fakeredis.FakeRedis, bid: str, *gids: str, train: bool = True, record_groups: bool = True) -> None:
    b = Batch(batch_id=bid, groups=[rollout_group(g, ["0"]) for g in gids], trainer_version="0",
              window=Window(keep_versions=0))
    eid = r.xadd(K.batches, encode_entry(b))
    r.xreadgroup(GROUP_TRAINER, "t", {K.batches: ">"})
    if train:
        r.xack(K.batches, GROUP_TRAINER, eid)
        fields = {"batch_ids": bid, "step": "1", "version": "1"}
        if record_groups:
            fields["group_ids"] = json.dumps(list(gids))
        r.xadd(TRAINED, fields)


def dead(r: fakeredis.FakeRedis, gid: str, reason: str = "retries_exhausted") -> None:
    fields = encode_entry(prompt_group(gid, 2))
    r.xadd(K.dead, dead_letter_fields(reason, "boom", K.prompts, "1-1", fields))


def test_a_clean_run_passes_with_its_figures(r: fakeredis.FakeRedis) -> None:
    for g in ("g1", "g2", "g3"):
        enqueue(r, g)
    enqueue(r, "g2", 1)
    enqueue(r, "g3", 1)
    enqueue(r, "g3", 2)
    batch(r, "b1", "g1", "g2")
    dead(r, "g3")
    r.xadd(K.dead, dead_letter_fields("malformed", "bad", K.prompts, "9-9", {b"body": b"\xff"}))
    h = collect(r, K, max_retries=2)
    s = h.summary()
    assert h.ok, h.render()
    assert (s["produced"], s["trained"], s["reenqueued"], s["dead_lettered"], s["poison"]) == (3, 2, 3, 1, 1)
    assert s["dead_by_reason"] == {"retries_exhausted": 1} and s["max_attempt"] == 2


def test_a_group_with_no_outcome_and_no_live_entry_is_lost(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1")
    h = collect(r, K)
    assert h.lost == ["g1"] and not h.ok


def test_a_pending_or_undelivered_group_is_in_flight_not_lost(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1", consume=False)  # undelivered
    r.xreadgroup(GROUP_ROLLOUT, "w", {K.prompts: ">"})  # now pending
    enqueue(r, "g2", consume=False)  # undelivered
    h = collect(r, K)
    assert h.lost == [] and h.in_flight == ["g1", "g2"]


def test_an_entry_delivered_after_the_snapshot_belongs_to_the_next_one(r: fakeredis.FakeRedis) -> None:
    # collect reads the streams, then each group's pending list: on a live stack an entry can be added and
    # delivered between the two reads; it is pending but not in the snapshot, and must not break the check.
    enqueue(r, "g1", consume=False)
    before = [history._s(i) for i, _ in r.xrange(K.prompts)]
    enqueue(r, "g2", consume=False)
    r.xreadgroup(GROUP_ROLLOUT, "w", {K.prompts: ">"})  # both pending now
    live, last = history._consumed(r, K.prompts, GROUP_ROLLOUT, before)
    assert live == set(before) and last is not None


def test_a_group_trained_twice_is_duplicated(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1")
    batch(r, "b1", "g1")
    r.xadd(TRAINED, {"batch_ids": "b1", "group_ids": json.dumps(["g1"])})
    assert collect(r, K).duplicated == ["g1"]


def test_a_group_in_two_batches_is_flagged_even_if_trained_once(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1")
    batch(r, "b1", "g1")
    batch(r, "b2", "g1", train=False)
    h = collect(r, K)
    assert h.in_two_batches == ["g1"] and h.duplicated == [] and not h.ok


def test_a_group_both_trained_and_dead_lettered_is_flagged(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1")
    batch(r, "b1", "g1")
    dead(r, "g1", "stale_retries_exhausted")
    h = collect(r, K)
    assert h.trained_and_dead == ["g1"] and not h.ok


def test_a_group_dead_lettered_twice_is_flagged(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1")
    dead(r, "g1")
    dead(r, "g1")
    assert collect(r, K).dead_twice == ["g1"]


def test_attempts_beyond_the_retry_budget_are_flagged(r: fakeredis.FakeRedis) -> None:
    for a in range(4):
        enqueue(r, "g1", a)
    dead(r, "g1")
    assert collect(r, K, max_retries=2).over_budget == ["g1"]
    assert collect(r, K, max_retries=3).over_budget == []


def test_trained_batch_ids_resolve_without_group_ids_in_any_order(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1")
    h = History()
    h.feed("trained", "1-1", {b"batch_ids": b"b1"})  # the record before its batch
    batch(r, "b1", "g1", train=False)
    collect(r, K, into=h)
    assert h.trained["g1"] == 1 and h.lost == []


def test_a_dead_lettered_batch_dead_letters_each_of_its_groups(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1")
    enqueue(r, "g2")
    b = Batch(batch_id="b1", groups=[rollout_group("g1", ["0"]), rollout_group("g2", ["0"])], window=Window(keep_versions=0))
    r.xadd(K.dead, dead_letter_fields("invalid_batch", "too long", K.batches, "5-0", encode_entry(b)))
    h = collect(r, K)
    assert h.dead == {"g1": ["invalid_batch"], "g2": ["invalid_batch"]} and h.poison == 0 and h.ok


def test_recorded_entries_that_redis_lost_are_missing_and_their_groups_lost(r: fakeredis.FakeRedis) -> None:
    h, cursors = History(), dict[str, str]()
    enqueue(r, "g1")
    enqueue(r, "g2", consume=False)
    assert poll(r, K, h, cursors) == 2
    assert poll(r, K, h, cursors) == 0  # incremental: nothing new
    r.flushall()  # a restart without persistence
    collect(r, K, into=h)
    assert h.missing == {"prompts": 2} and h.lost == ["g1", "g2"] and not h.ok


def test_feeding_the_same_entry_twice_counts_it_once(r: fakeredis.FakeRedis) -> None:
    enqueue(r, "g1")
    batch(r, "b1", "g1")
    h = collect(r, K)
    collect(r, K, into=h)
    assert h.trained["g1"] == 1 and h.batched["g1"] == 1


def test_cli_exit_code_says_whether_the_law_holds(r: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(history.redis.Redis, "from_url", staticmethod(lambda url: r))
    enqueue(r, "g1")
    assert history.main(["--prefix", "h"]) == 1
    assert "lost groups: g1" in capsys.readouterr().out
    batch(r, "b1", "g1")
    assert history.main(["--prefix", "h", "--max-retries", "2"]) == 0


def test_a_trimmed_prefix_is_missing_unless_trimming_is_allowed(r: fakeredis.FakeRedis) -> None:
    h, cursors = History(), dict[str, str]()
    enqueue(r, "g1")
    second = enqueue(r, "g2")
    enqueue(r, "g3")
    poll(r, K, h, cursors)
    r.xtrim(K.prompts, minid=second, approximate=False)  # what trim_acked does: drop a delivered, acknowledged prefix
    assert collect(r, K, into=h).missing == {"prompts": 1}
    assert collect(r, K, into=h, allow_trimmed=True).missing == {}


def test_entries_gone_from_the_middle_or_undelivered_are_missing_even_with_trimming(r: fakeredis.FakeRedis) -> None:
    h, cursors = History(), dict[str, str]()
    enqueue(r, "g1")
    middle = enqueue(r, "g2")
    enqueue(r, "g3")
    tail = enqueue(r, "g4", consume=False)
    poll(r, K, h, cursors)
    r.xdel(K.prompts, middle, tail)
    assert collect(r, K, into=h, allow_trimmed=True).missing == {"prompts": 2}
