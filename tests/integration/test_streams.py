"""Stream helpers on a real redis-server: hand-off atomicity, pending-first reads, reclaim, dead letters, trimming."""

from __future__ import annotations

import pytest
import redis

from shared.codec import decode_entry, encode_entry
from shared.keys import Keys
from shared.schemas import DeadLetter, PromptGroup
from shared.stats import add_dead_letter
from shared.streams import GroupReader, ensure_group, handoff, reclaim, trim_acked


def pg(i: int) -> PromptGroup:
    return PromptGroup(group_id=f"g{i}", prompt_id=f"p{i}", task="reverse", prompt="reverse 12",
                       reference="21", n_samples=2, enqueued_at=1.0)


def test_ensure_group_is_idempotent(redis_client: redis.Redis, keys: Keys) -> None:
    ensure_group(redis_client, keys.prompts, "rollout")
    ensure_group(redis_client, keys.prompts, "rollout")
    assert [g["name"] for g in redis_client.xinfo_groups(keys.prompts)] == [b"rollout"]


def test_handoff_adds_output_and_acks_input_together(redis_client: redis.Redis, keys: Keys) -> None:
    ensure_group(redis_client, keys.prompts, "rollout")
    redis_client.xadd(keys.prompts, encode_entry(pg(1)))
    reader = GroupReader(redis_client, keys.prompts, "rollout", "w1")
    [entry] = reader.read(count=10, block_ms=10)
    assert redis_client.xpending(keys.prompts, "rollout")["pending"] == 1
    handoff(redis_client, keys.prompts, "rollout", entry.id, keys.rollouts, {"x": "1"})
    assert redis_client.xpending(keys.prompts, "rollout")["pending"] == 0
    assert redis_client.xlen(keys.rollouts) == 1


def test_handoff_error_is_raised_not_swallowed(redis_client: redis.Redis, keys: Keys) -> None:
    ensure_group(redis_client, keys.prompts, "rollout")
    redis_client.xadd(keys.prompts, encode_entry(pg(1)))
    [entry] = GroupReader(redis_client, keys.prompts, "rollout", "w1").read(count=1, block_ms=10)
    redis_client.set(keys.rollouts, "not a stream")  # an operator replaced the output stream by a string
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        handoff(redis_client, keys.prompts, "rollout", entry.id, keys.rollouts, {"x": "1"})


def test_restart_reads_own_pending_first_then_new(redis_client: redis.Redis, keys: Keys) -> None:
    ensure_group(redis_client, keys.prompts, "rollout")
    for i in range(3):
        redis_client.xadd(keys.prompts, encode_entry(pg(i)))
    first = GroupReader(redis_client, keys.prompts, "rollout", "w1").read(count=2, block_ms=10)
    assert [decode_entry(e.fields, PromptGroup).group_id for e in first] == ["g0", "g1"]
    # "Restart": a new reader under the same consumer name sees g0, g1 again before g2.
    again = GroupReader(redis_client, keys.prompts, "rollout", "w1")
    got = again.read(count=10, block_ms=10) + again.read(count=10, block_ms=10)
    assert [decode_entry(e.fields, PromptGroup).group_id for e in got] == ["g0", "g1", "g2"]


def test_reclaim_takes_idle_entries_of_a_dead_consumer(redis_client: redis.Redis, keys: Keys) -> None:
    ensure_group(redis_client, keys.prompts, "rollout")
    for i in range(5):
        redis_client.xadd(keys.prompts, encode_entry(pg(i)))
    GroupReader(redis_client, keys.prompts, "rollout", "dead").read(count=5, block_ms=10)
    assert reclaim(redis_client, keys.prompts, "rollout", "alive", min_idle_ms=60_000) == []
    claimed = reclaim(redis_client, keys.prompts, "rollout", "alive", min_idle_ms=0, count=2)  # loops the cursor
    assert [decode_entry(e.fields, PromptGroup).group_id for e in claimed] == [f"g{i}" for i in range(5)]
    consumers = {c["name"]: c["pending"] for c in redis_client.xinfo_consumers(keys.prompts, "rollout")}
    assert consumers[b"alive"] == 5 and consumers[b"dead"] == 0


def test_reclaim_acks_entries_deleted_while_pending(redis_client: redis.Redis, keys: Keys) -> None:
    ensure_group(redis_client, keys.prompts, "rollout")
    eid = redis_client.xadd(keys.prompts, encode_entry(pg(1)))
    GroupReader(redis_client, keys.prompts, "rollout", "dead").read(count=1, block_ms=10)
    redis_client.xdel(keys.prompts, eid)
    assert reclaim(redis_client, keys.prompts, "rollout", "alive", min_idle_ms=0) == []
    assert redis_client.xpending(keys.prompts, "rollout")["pending"] == 0


def test_dead_letter_keeps_bytes_and_acks(redis_client: redis.Redis, keys: Keys) -> None:
    ensure_group(redis_client, keys.rollouts, "collector")
    eid = redis_client.xadd(keys.rollouts, {"schema": "1", "body": b"\xff\xfe\x00"})
    GroupReader(redis_client, keys.rollouts, "collector", "c").read(count=1, block_ms=10)
    pipe = redis_client.pipeline(transaction=True)
    add_dead_letter(pipe, keys, "malformed", "body: not msgpack " + "x" * 5000, keys.rollouts, eid,
                    redis_client.xrange(keys.rollouts)[0][1], "poison_dead_lettered")
    pipe.xack(keys.rollouts, "collector", eid)
    pipe.execute()
    assert redis_client.xpending(keys.rollouts, "collector")["pending"] == 0
    [(_, fields)] = redis_client.xrange(keys.dead)
    assert fields[b"reason"] == b"malformed"
    letter = decode_entry(fields, DeadLetter)
    assert letter.fields["body"] == b"\xff\xfe\x00" and letter.source_id == eid.decode()
    assert len(letter.error) == 1000 and redis_client.hget(keys.stats, "poison_dead_lettered") == b"1"


def test_trim_never_removes_pending_or_undelivered_entries(redis_client: redis.Redis, keys: Keys) -> None:
    ensure_group(redis_client, keys.prompts, "rollout")
    ids = [redis_client.xadd(keys.prompts, encode_entry(pg(i))) for i in range(10)]
    reader = GroupReader(redis_client, keys.prompts, "rollout", "w")
    got = reader.read(count=6, block_ms=10)
    redis_client.xack(keys.prompts, "rollout", *[e.id for e in got[:2]] + [got[4].id])  # ack 0,1,4; 2,3,5 pending
    trim_acked(redis_client, keys.prompts, ["rollout"])
    left = [e[0] for e in redis_client.xrange(keys.prompts)]
    assert left == ids[2:]  # the oldest pending (index 2) bounds the trim; 6..9 are undelivered
    redis_client.xack(keys.prompts, "rollout", got[2].id, got[3].id, got[5].id)
    trim_acked(redis_client, keys.prompts, ["rollout"])
    assert [e[0] for e in redis_client.xrange(keys.prompts)] == ids[6:]


def test_trim_skips_streams_with_a_missing_group(redis_client: redis.Redis, keys: Keys) -> None:
    redis_client.xadd(keys.prompts, {"a": "1"})
    assert trim_acked(redis_client, keys.prompts, ["rollout"]) == 0
    assert redis_client.xlen(keys.prompts) == 1
