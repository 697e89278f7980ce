"""prompt-buffer Redis shell on fakeredis: paced emission, atomic cursor, restarts, backpressure."""

from __future__ import annotations

import fakeredis
import pytest

from services.prompt_buffer.buffer import PromptBuffer
from services.prompt_buffer.pacing import PacingPolicy
from services.prompt_buffer.schedule import Schedule
from shared.codec import decode_entry
from shared.config import PromptBufferConfig
from shared.errors import DressageError
from shared.keys import Keys
from shared.schemas import PromptGroup, WeightVersion
from shared.versionbus import publish_version

ROWS = [{"prompt_id": f"r{i}", "task": "reverse", "prompt": f"reverse {i}", "reference": str(i)[::-1]}
        for i in range(10)]


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def buffer(r: fakeredis.FakeRedis, eta: int | None = 0, gpv: int = 3, epochs: int | None = 2,
           max_in_flight: int = 100, max_stream_len: int = 1000, chunk: int = 64) -> PromptBuffer:
    return PromptBuffer(r, Keys("t"), ROWS, Schedule(len(ROWS), 0, epochs), PacingPolicy(eta, gpv, max_in_flight),
                        # model_copy skips the bound (>= 100) so a handful of rows can reach the stream cap
                        PromptBufferConfig(n_samples=4).model_copy(update={"max_stream_len": max_stream_len}),
                        consumer="pb", burst=True, chunk=chunk, clock=lambda: 42.0)


def emitted(r: fakeredis.FakeRedis) -> list[PromptGroup]:
    return [decode_entry(f, PromptGroup) for _, f in r.xrange("t:prompts")]


def publish(r: fakeredis.FakeRedis, v: int) -> None:
    publish_version(r, Keys("t"), WeightVersion(version=str(v), path=f"/ckpt/{v}", step=v, published_at=1.0))


def test_waits_for_the_first_published_version(r: fakeredis.FakeRedis) -> None:
    assert buffer(r).run() == 0
    assert r.xlen("t:prompts") == 0


def test_emits_capacity_with_counter_and_cursor(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    assert buffer(r, eta=0, gpv=3).run() == 0
    groups = emitted(r)
    assert len(groups) == 3
    assert all(g.attempt == 0 and g.n_samples == 4 and g.enqueued_at == 42.0 for g in groups)
    assert r.hget("t:stats", "groups_produced") == b"3"
    assert r.hgetall("t:prompt_buffer:cursor")[b"position"] == b"3"
    # η = 0: nothing more until version 1 is published, even once the trainer consumed them.
    r.hset("t:stats", "groups_trained", 3)
    buffer(r, eta=0, gpv=3).run()
    assert r.xlen("t:prompts") == 3
    publish(r, 1)
    buffer(r, eta=0, gpv=3).run()
    assert r.xlen("t:prompts") == 6


def test_restarts_neither_skip_nor_duplicate_across_epochs(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    for _ in range(30):  # many short-lived buffers, each emitting a little
        buffer(r, eta=None, max_in_flight=1000, chunk=3).step()
    ids = [(g.meta["epoch"], g.meta["dataset_index"]) for g in emitted(r)]
    assert len(ids) == 20 and len(set(ids)) == 20  # 2 epochs × 10 rows, each exactly once
    assert sorted(i for e, i in ids if e == 0) == list(range(10))
    assert len({g.group_id for g in emitted(r)}) == 20


def test_two_buffers_racing_on_the_cursor_never_duplicate(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    a, b = buffer(r, eta=None, chunk=2), buffer(r, eta=None, chunk=2)
    for _ in range(6):
        a.emit(2)
        b.emit(2)
    gids = [g.group_id for g in emitted(r)]
    assert len(gids) == 20 and len(set(gids)) == 20


def test_prompt_stream_length_caps_emission(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    buffer(r, eta=None, max_stream_len=4).run()
    assert r.xlen("t:prompts") == 4


def test_dead_letters_release_slots(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    buffer(r, eta=0, gpv=3).run()
    r.hset("t:stats", "groups_dead_lettered", 2)
    buffer(r, eta=0, gpv=3).run()
    assert r.xlen("t:prompts") == 5


def test_corrupt_cursor_is_reported_with_its_key(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    r.hset("t:prompt_buffer:cursor", "position", "abc")
    with pytest.raises(DressageError, match="t:prompt_buffer:cursor.position"):
        buffer(r).step()


def lags(r: fakeredis.FakeRedis) -> list[float]:
    rows = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange("t:metrics")]
    return [float(row["prompt_buffer/admit_lag_s"]) for row in rows if "prompt_buffer/admit_lag_s" in row]


def test_the_first_admission_under_a_version_reports_its_lag_after_the_publication(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)  # published at 1.0; the buffer's clock says 42.0
    pb = buffer(r, eta=0, gpv=3, chunk=2)
    assert pb.step() == 2 and pb.step() == 1  # version 0's three groups, in two emissions
    assert lags(r) == [41.0]  # only the first admission under version 0 measures the reaction
    assert pb.step() == 0 and lags(r) == [41.0]  # nothing admitted: nothing measured
    r.hset("t:stats", "groups_trained", 3)
    publish_version(r, Keys("t"), WeightVersion(version="1", path="/ckpt/1", step=1, published_at=41.75))
    assert pb.step() == 2
    assert lags(r) == [41.0, 0.25]


def test_a_pacing_step_reads_its_inputs_in_one_round_trip(r: fakeredis.FakeRedis) -> None:
    publish(r, 0)
    pb = buffer(r, eta=0, gpv=3)
    calls: list[str] = []
    execute = r.execute_command

    def counting(*args, **kwargs):
        calls.append(str(args[0]))
        return execute(*args, **kwargs)

    r.execute_command = counting  # single commands; pipelines go through their own path
    assert pb.step() == 3
    # the inputs: one pipeline; the emission: its transaction. Outside them only the metrics report
    # (and, with the brake on, the Redis clock: a cluster client cannot pipeline TIME)
    assert "GET" not in calls and "XLEN" not in calls and "HMGET" not in calls and "TIME" not in calls
