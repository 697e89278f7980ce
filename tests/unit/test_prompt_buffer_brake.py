"""Dead-letter brake (issue 14): pure policy, and the buffer pausing / resuming on fakeredis."""

from __future__ import annotations

import time

import fakeredis
import pytest

from services.prompt_buffer.brake import BrakePolicy, why
from services.prompt_buffer.buffer import PromptBuffer
from services.prompt_buffer.pacing import PacingPolicy
from services.prompt_buffer.schedule import Schedule
from shared.config import PromptBufferConfig
from shared.keys import Keys
from shared.schemas import WeightVersion
from shared.telemetry import read_metrics
from shared.versionbus import publish_version

K = Keys("t")
ROWS = [{"prompt_id": f"r{i}", "task": "reverse", "prompt": f"reverse {i}", "reference": str(i)[::-1]}
        for i in range(50)]


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def test_policy_engages_at_the_limit_and_releases_at_half() -> None:
    p = BrakePolicy(per_min=30, window_s=60)
    assert p.limit == 30
    assert not p.engaged(False, 29) and p.engaged(False, 30)
    assert p.engaged(True, 16) and not p.engaged(True, 15)  # hysteresis: released at <= limit // 2
    assert BrakePolicy(per_min=0.5, window_s=10).limit == 1  # never 0: one dead letter can engage it
    off = BrakePolicy(per_min=None, window_s=60)
    assert not off.enabled and not off.engaged(True, 10_000)
    with pytest.raises(ValueError, match="dead_letter_brake_per_min"):
        BrakePolicy(per_min=-1, window_s=60)


def test_why_names_the_count_the_knob_and_the_commonest_reasons() -> None:
    line = why(["retries_exhausted", "malformed", "retries_exhausted"], 3, BrakePolicy(per_min=3, window_s=60))
    assert line.startswith("3 dead letters in the last 60s") and "retries_exhausted x2" in line
    assert "pacing.dead_letter_brake_per_min=3" in line


def dead(r: fakeredis.FakeRedis, n: int, age_s: float = 0.0, reason: str = "stale_retries_exhausted") -> None:
    now_ms = int(time.time() * 1000 - age_s * 1000)
    for i in range(n):
        r.xadd(K.dead, {"reason": reason, "error": "x"}, id=f"{now_ms}-{i + 1}")


def buffer(r: fakeredis.FakeRedis) -> PromptBuffer:
    return PromptBuffer(r, K, ROWS, Schedule(len(ROWS), 0, 1), PacingPolicy(None, 4, 100),
                        PromptBufferConfig(n_samples=2), consumer="pb", burst=True, chunk=4, brake=BrakePolicy(per_min=6, window_s=30))


def test_buffer_pauses_while_groups_die_fast_shows_why_and_resumes_by_itself(r: fakeredis.FakeRedis) -> None:
    publish_version(r, K, WeightVersion(version="0", path="/c/0", step=0, published_at=1.0))
    dead(r, 2, age_s=120)  # old dead letters, outside the window: no brake
    pb = buffer(r)
    assert pb.step() == 4
    dead(r, 3)  # limit = 6 * 30 / 60 = 3 within the window
    assert pb.step() == 0 and pb.braked
    brake = {k.decode(): v.decode() for k, v in r.hgetall("t:prompt_buffer:brake").items()}
    assert brake["engaged"] == "1" and "stale_retries_exhausted x3" in brake["why"]
    assert read_metrics(r, K, "prompt-buffer")[-1]["prompt_buffer/brake_engaged"] == 1
    assert pb.step() == 0  # stays paused while the cause lasts
    r.delete(K.dead)
    dead(r, 1)  # the window ages: 1 <= limit // 2
    assert pb.step() == 4 and not pb.braked
    assert r.hget("t:prompt_buffer:brake", "engaged") == b"0"


def test_brake_off_never_pauses(r: fakeredis.FakeRedis) -> None:
    publish_version(r, K, WeightVersion(version="0", path="/c/0", step=0, published_at=1.0))
    dead(r, 100)
    pb = PromptBuffer(r, K, ROWS, Schedule(len(ROWS), 0, 1), PacingPolicy(None, 4, 100),
                      PromptBufferConfig(n_samples=2), consumer="pb", burst=True, chunk=4)
    assert pb.step() == 4 and not r.exists("t:prompt_buffer:brake")
