"""Session recording (segments, masks, versions), TTL and limits; engine response parsing; routing."""

from __future__ import annotations

import asyncio

import pytest

from services.proxy.engine_client import parse_generate, rank_engines, redact
from services.proxy.errors import (
    InvalidRequest,
    OverCapacity,
    SessionConflict,
    SessionNotFound,
    UpstreamError,
)
from services.proxy.sessions import SessionStore, check_session_id
from shared.schemas import Sample


def store(ttl: float = 10.0, max_sessions: int = 10, max_turns: int = 10) -> SessionStore:
    return SessionStore(ttl, max_sessions, max_turns)


def test_turn_records_context_mask0_and_response_mask1_with_versions() -> None:
    s = store().open("s1", partial=True, now=0)
    s.record([1, 2, 3], [4, 5], [-0.1, -0.2], ["a", "a"], "stop")
    (sample,) = s.samples()
    Sample.model_validate(sample)  # the wire shape, exactly
    assert sample["traj_id"] == "s1" and sample["segment_index"] == 0
    assert sample["token_ids"] == [1, 2, 3, 4, 5]
    assert sample["loss_mask"] == [0, 0, 0, 1, 1]
    assert sample["logprobs"] == [0.0, 0.0, 0.0, -0.1, -0.2]
    assert sample["token_versions"] == ["-1", "-1", "-1", "a", "a"]
    assert sample["version_spans"] == [{"start": 0, "end": 3, "version": "-1"}, {"start": 3, "end": 5, "version": "a"}]
    assert (sample["start_version"], sample["end_version"], sample["partial_rollout"]) == ("a", "a", False)
    assert sample["reward"] == 0.0 and sample["finish_reason"] == "stop"


def test_extending_turn_appends_only_the_context_delta() -> None:
    s = store().open("s1", partial=True, now=0)
    s.record([1, 2], [3], [-0.5], ["a"], "stop")
    s.record([1, 2, 3, 9, 9], [7, 8], [-0.1, -0.1], [" b ", "b"], "length")
    (sample,) = s.samples()
    assert sample["token_ids"] == [1, 2, 3, 9, 9, 7, 8]
    assert sample["loss_mask"] == [0, 0, 1, 0, 0, 1, 1]
    assert sample["token_versions"] == ["-1", "-1", "a", "-1", "-1", "b", "b"]  # " b " normalised
    assert (sample["start_version"], sample["end_version"], sample["partial_rollout"]) == ("a", "b", True)
    assert sample["finish_reason"] == "length" and s.versions == ["a", "b"]


def test_rewritten_history_starts_a_new_segment() -> None:
    s = store().open("s1", partial=True, now=0)
    s.record([1, 2], [3], [-0.5], ["a"], "stop")
    s.record([1, 5, 3, 4], [6], [-0.5], ["a"], "stop")  # does not extend [1, 2, 3]
    s.record([1, 5, 3, 4, 6, 7], [8], [-0.5], ["a"], "stop")  # extends the new segment
    samples = s.samples()
    assert [x["segment_index"] for x in samples] == [0, 1]
    assert samples[1]["token_ids"] == [1, 5, 3, 4, 6, 7, 8]
    assert samples[1]["loss_mask"] == [0, 0, 0, 0, 1, 0, 1]
    assert s.turns == 3 and s.summary()["num_segments"] == 2


def test_non_real_versions_are_context_labels_and_never_count() -> None:
    s = store().open("s1", partial=True, now=0)
    s.record([1], [2, 3], [-0.1, -0.1], ["unknown", "a"], "stop")
    (sample,) = s.samples()
    assert sample["token_versions"] == ["-1", "-1", "a"] and s.versions == ["a"]


def test_unaligned_record_is_refused() -> None:
    s = store().open("s1", partial=True, now=0)
    with pytest.raises(ValueError):
        s.record([1], [2, 3], [-0.1], ["a", "a"], "stop")


def test_ttl_expires_idle_sessions_but_not_a_running_turn() -> None:
    st = store(ttl=5)
    idle = st.open("idle", partial=True, now=0)
    busy = st.open("busy", partial=True, now=0)
    assert idle is not None

    async def flow() -> None:
        async with busy.lock:  # a turn in progress
            assert st.expire(now=6) == ["idle"]
            with pytest.raises(SessionNotFound):
                st.get("idle", now=6)
            assert st.get("busy", now=6) is busy
        assert st.expire(now=6) == ["busy"]  # once the turn is over it may go

    asyncio.run(flow())


def test_session_limits_finalized_mode_and_turns() -> None:
    st = store(max_sessions=1, max_turns=1)
    s = st.open("s1", partial=True, now=0)
    with pytest.raises(OverCapacity) as cap:
        st.open("s2", partial=True, now=0)
    assert cap.value.headers["Retry-After"]
    with pytest.raises(SessionConflict):
        st.open("s1", partial=False, now=0)  # mode fixed by the first request
    s.record([1], [2], [-0.1], ["a"], "stop")
    with pytest.raises(SessionConflict):
        st.open("s1", partial=True, now=0)  # max_turns
    s.finalized = True
    with pytest.raises(SessionConflict):
        st.open("s1", partial=True, now=0)
    assert st.delete("s1") and not st.delete("s1")


@pytest.mark.parametrize("bad", ["", "-lead", "has space", "x" * 257, "a/b", "é"])
def test_bad_session_ids_are_refused_naming_where_they_came_from(bad: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_session_id(bad, "X-Session-Id")
    assert info.value.detail()["field"] == "X-Session-Id"


def test_parse_generate_per_token_versions_and_fallback() -> None:
    meta = {"finish_reason": {"type": "abort"}, "weight_version": "b",
            "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]], "output_token_versions": ["a", "b"]}
    c = parse_generate({"output_ids": [7, 8], "meta_info": meta})
    assert (c.output_ids, c.logprobs, c.versions, c.aborted) == ([7, 8], [-0.1, -0.2], ["a", "b"], True)
    meta.pop("output_token_versions")
    meta["finish_reason"] = {"type": "stop"}
    c = parse_generate({"meta_info": meta})  # ids recovered from the logprob entries
    assert (c.output_ids, c.versions, c.aborted, c.finish_type) == ([7, 8], ["b", "b"], False, "stop")


@pytest.mark.parametrize("body", [[], {"output_ids": [1], "meta_info": {"output_token_logprobs": []}},
                                  {"output_ids": ["x"], "meta_info": {}}, {"meta_info": "no"}])
def test_parse_generate_refuses_malformed_bodies(body: object) -> None:
    with pytest.raises(UpstreamError):
        parse_generate(body)


def test_rendezvous_ranking_moves_only_the_sessions_of_a_removed_engine() -> None:
    engines = ["http://e1", "http://e2", "http://e3"]
    keys = [f"s{i}" for i in range(200)]
    before = {k: rank_engines(engines, k)[0] for k in keys}
    after = {k: rank_engines(engines[:2], k)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "http://e3" for k in moved)


def test_redact_drops_credentials_from_engine_urls() -> None:
    assert redact("http://user:secret@host:30000/x") == "http://host:30000/x"
    assert redact("http://host:1") == "http://host:1"
