"""Codec: round-trips, plain fields, and poison inputs that must raise MalformedEntry only."""

from __future__ import annotations

from collections.abc import Mapping

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.codec import decode_body, decode_entry, encode_body, encode_entry, entry_ids
from shared.errors import MalformedEntry, UnsupportedSchema
from shared.schemas import Batch, DeadLetter, Message, PromptGroup, RetryRecord, RolloutGroup, Sample, Window


def make_sample(traj: str = "t0", n: int = 6, version: str = "3", seg: int = 0, reward: float = 0.5) -> Sample:
    return Sample(traj_id=traj, segment_index=seg, token_ids=list(range(n)), loss_mask=[0, 0] + [1] * (n - 2),
                  logprobs=[0.0, 0.0] + [-0.25] * (n - 2), token_versions=["-1", "-1"] + [version] * (n - 2),
                  end_version=version, start_version=version, reward=reward)


def make_group(n: int = 3, attempt: int = 0) -> RolloutGroup:
    return RolloutGroup(group_id="g1", prompt_id="p1", attempt=attempt, status="completed",
                        samples=[make_sample(f"t{i}", reward=i / 2) for i in range(n)], meta={"task": "reverse"})


def test_prompt_group_round_trip_with_chat_messages() -> None:
    pg = PromptGroup(group_id="g", prompt_id="p", task="guess", prompt=[Message(role="user", content="hi")],
                     reference={"n": 3}, n_samples=4, attempt=2, enqueued_at=1.5)
    fields = encode_entry(pg)
    assert fields["kind"] == b"prompt_group" and fields["attempt"] == b"2" and fields["n_samples"] == b"4"
    assert decode_entry(fields, PromptGroup) == pg


def test_rollout_group_round_trip_keeps_token_arrays() -> None:
    group = make_group()
    fields = encode_entry(group)
    back = decode_entry(fields, RolloutGroup)
    assert back.samples[1].token_ids == group.samples[1].token_ids
    assert back.samples[1].logprobs == pytest.approx(group.samples[1].logprobs)
    assert back.samples[1].token_versions == group.samples[1].token_versions
    assert fields["end_versions"] == b"3,3,3"
    assert float(fields["reward_mean"]) == pytest.approx(0.5)


def test_token_arrays_travel_as_raw_little_endian_bytes() -> None:
    body = msgpack.unpackb(encode_body(make_group(1)), raw=False)
    sample = body["samples"][0]
    assert isinstance(sample["token_ids"], bytes) and len(sample["token_ids"]) == 4 * 6
    assert sample["token_ids"][:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert isinstance(sample["logprobs"], bytes) and len(sample["logprobs"]) == 4 * 6


def test_lists_are_accepted_for_token_arrays() -> None:
    body = make_group(1).model_dump()
    raw = msgpack.packb(body, use_bin_type=True)
    assert decode_body(raw, RolloutGroup).samples[0].token_ids == list(range(6))


def test_batch_round_trip_and_plain_fields() -> None:
    batch = Batch(batch_id="b1", groups=[make_group(), make_group(attempt=1)], trainer_version="4",
                  window=Window(keep_versions=2, current_version="4", cutoff_version="3"))
    fields = encode_entry(batch)
    assert fields["n_groups"] == b"2" and fields["versions"] == b"3" and fields["trainer_version"] == b"4"
    assert decode_entry(fields, Batch) == batch


def test_dead_letter_keeps_original_bytes() -> None:
    letter = DeadLetter(reason="malformed", error="bad", source_stream="s", source_id="1-0",
                        fields={"body": b"\xff\x00junk"})
    assert decode_entry(encode_entry(letter), DeadLetter).fields["body"] == b"\xff\x00junk"


@pytest.mark.parametrize("mutate, needle", [
    (lambda f: f.pop("schema"), "schema"),
    (lambda f: f.update(schema=b"3"), "schema"),
    (lambda f: f.update(kind=b"batch"), "kind"),
    (lambda f: f.pop("body"), "body"),
    (lambda f: f.update(body=f["body"][:-7]), "msgpack"),
    (lambda f: f.update(body=b"\xc1"), "msgpack"),
    (lambda f: f.update(group_id=b"other"), "group_id"),
])
def test_poison_entries_raise_malformed_entry_naming_the_problem(mutate, needle) -> None:
    fields = dict(encode_entry(make_group()))
    mutate(fields)
    with pytest.raises(MalformedEntry) as info:
        decode_entry(fields, RolloutGroup)
    assert needle in str(info.value)


def test_schema_violations_name_the_field() -> None:
    body = make_group(1).model_dump()
    body["samples"][0]["loss_mask"] = [0, 1, 2, 1, 1, 1]
    with pytest.raises(MalformedEntry, match="loss_mask"):
        decode_body(msgpack.packb(body, use_bin_type=True), RolloutGroup)
    body = make_group(1).model_dump()
    del body["status"]
    with pytest.raises(MalformedEntry, match="status"):
        decode_body(msgpack.packb(body, use_bin_type=True), RolloutGroup)
    body = make_group(1).model_dump()
    body["attempt"] = "many"
    with pytest.raises(MalformedEntry, match="attempt"):
        decode_body(msgpack.packb(body, use_bin_type=True), RolloutGroup)


def test_misaligned_token_bytes_are_rejected() -> None:
    body = msgpack.unpackb(encode_body(make_group(1)), raw=False)
    body["samples"][0]["token_ids"] = body["samples"][0]["token_ids"][:-1]
    with pytest.raises(MalformedEntry, match="token_ids"):
        decode_body(msgpack.packb(body, use_bin_type=True), RolloutGroup)


def test_entry_ids_never_raise_on_garbage() -> None:
    assert entry_ids({b"group_id": b"\xff\xfe", b"attempt": b"1"}) == {"attempt": "1"}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_malformed_entry(raw: bytes) -> None:
    for kind in (PromptGroup, RolloutGroup, Batch, DeadLetter):
        try:
            decode_entry({b"schema": b"1", b"kind": b"x", b"body": raw}, kind)
        except MalformedEntry:
            pass
        try:
            decode_body(raw, kind)
        except MalformedEntry:
            pass


_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
                     | st.binary(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["group_id", "prompt_id", "attempt", "status", "samples", "meta", "error",
                                        "task", "n_samples", "prompt", "batch_id", "groups", "window"]), _json))
def test_structured_garbage_only_ever_raises_malformed_entry(body: dict) -> None:
    raw = msgpack.packb(body, use_bin_type=True)
    for kind in (PromptGroup, RolloutGroup, Batch):
        try:
            decode_body(raw, kind)
        except MalformedEntry:
            pass


def v1_entry(kind: str, body: Mapping[str, object], **plain: str) -> dict[bytes, bytes]:
    """An entry as a schema-1 producer wrote it (plain fields + msgpack body)."""
    fields = {b"schema": b"1", b"kind": kind.encode(), **{k.encode(): v.encode() for k, v in plain.items()}}
    fields[b"body"] = msgpack.packb(body, use_bin_type=True)
    return fields


V1_PROMPT = {"group_id": "g1", "prompt_id": "p1", "task": "reverse", "prompt": "reverse 12", "reference": "21",
             "n_samples": 2, "attempt": 2, "enqueued_at": 5.0,
             "meta": {"epoch": 1, "retry_history": [{"attempt": 0, "error": "trajectory_timeout: slow"},
                                                    {"attempt": 1, "reason": "stale", "error": "stale", "at": 4.0}]}}


def test_v1_prompt_group_decodes_with_its_retry_history_typed() -> None:
    pg = decode_entry(v1_entry("prompt_group", V1_PROMPT, group_id="g1"), PromptGroup)
    assert pg.meta == {"epoch": 1} and pg.retry_history == [
        RetryRecord(attempt=0, reason="failed", error="trajectory_timeout: slow", at=0.0),
        RetryRecord(attempt=1, reason="stale", error="stale", at=4.0)]
    assert encode_entry(pg)["schema"] == b"2"  # re-encoded as v2


def test_v1_rollout_group_decodes_with_prompt_code_and_retryable() -> None:
    body = {"group_id": "g1", "prompt_id": "p1", "attempt": 2, "status": "failed",
            "error": "trajectory_version_changed: v3 -> v4 (session s)", "samples": [],
            "meta": {"prompt_group": V1_PROMPT, "worker": "w1"}}
    rg = decode_entry(v1_entry("rollout_group", body, group_id="g1"), RolloutGroup)
    assert rg.error_code == "trajectory_version_changed" and rg.retryable and rg.meta == {"worker": "w1"}
    assert rg.prompt_group is not None and rg.prompt_group.attempt == 2 and len(rg.prompt_group.retry_history) == 2


def test_v1_failed_group_a_v1_worker_already_handled_is_unsupported() -> None:
    body = {"group_id": "g1", "prompt_id": "p1", "attempt": 0, "status": "failed", "error": "x", "samples": [],
            "meta": {"handled": "reenqueued", "prompt_group": V1_PROMPT}}
    with pytest.raises(UnsupportedSchema, match="already reenqueued"):
        decode_entry(v1_entry("rollout_group", body, group_id="g1"), RolloutGroup)


def test_v1_batch_decodes_without_prompt_groups() -> None:
    group = {"group_id": "g1", "prompt_id": "p1", "attempt": 0, "status": "completed", "samples": [],
             "meta": {"prompt_group": V1_PROMPT}}
    body = {"batch_id": "b1", "groups": [group], "window": {"keep_versions": 1}, "meta": {}}
    batch = decode_entry(v1_entry("batch", body, group_id="b1"), Batch)
    assert [g.prompt_group for g in batch.groups] == [None] and batch.groups[0].meta == {}
