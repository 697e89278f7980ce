"""Non-finite rewards/logprobs and absurd attempt numbers are malformed at the edge (issue 16).

Before, a NaN reward or +-inf logprob was accepted and a step still published a version, and
``attempt = 2**63`` was rolled out and trained. Decoding such an entry now raises ``MalformedEntry``
(the consumers' poison path dead-letters it) and building one in process is a validation error.
"""

from __future__ import annotations

import math

import msgpack
import pytest
from pydantic import ValidationError
from rollout_factory import prompt_group

from shared import packed
from shared.codec import decode_entry, encode_entry
from shared.errors import MalformedEntry
from shared.schemas import MAX_ATTEMPT, PromptGroup, RolloutGroup, Sample


def sample(**over: object) -> dict[str, object]:
    base: dict[str, object] = {"traj_id": "t", "token_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
                               "logprobs": [0.0, -0.5, -1.0], "token_versions": ["-1", "0", "0"], "reward": 1.0}
    return {**base, **over}


@pytest.mark.parametrize("over", [{"reward": math.nan}, {"reward": math.inf}, {"logprobs": [0.0, -math.inf, -1.0]},
                                  {"logprobs": [0.0, math.nan, -1.0]}])
def test_non_finite_values_are_refused(over: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Sample.model_validate(sample(**over))


def test_absurd_attempts_are_malformed_on_the_wire() -> None:
    good = prompt_group("g", 0)
    fields = encode_entry(good)
    assert decode_entry(fields, PromptGroup).attempt == 0
    body = msgpack.unpackb(fields["body"], raw=False)
    for attempt in (2**63, MAX_ATTEMPT + 1, -1):
        forged = {**fields, "body": msgpack.packb({**body, "attempt": attempt})}
        with pytest.raises(MalformedEntry):
            decode_entry(forged, PromptGroup)


def test_a_nan_reward_on_the_wire_is_malformed() -> None:
    group = RolloutGroup(group_id="g", prompt_id="p", attempt=0, status="completed",
                         samples=[Sample.model_validate(sample())])
    fields = encode_entry(group)
    assert decode_entry(fields, RolloutGroup).samples[0].reward == 1.0
    body = msgpack.unpackb(fields["body"], raw=False)
    assert isinstance(body["samples"][0]["reward"], float)
    body["samples"][0]["reward"] = math.nan
    with pytest.raises(MalformedEntry):
        decode_entry({**fields, "body": msgpack.packb(body)}, RolloutGroup)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_packed_logprob_on_the_wire_is_malformed(bad: float) -> None:
    group = RolloutGroup(group_id="g", prompt_id="p", attempt=0, status="completed",
                         samples=[Sample.model_validate(sample(logprobs=[0.0, -0.5, -1e30]))])
    fields = encode_entry(group)
    assert decode_entry(fields, RolloutGroup).samples[0].logprobs[2] == pytest.approx(-1e30, rel=1e-6)
    good = pack_f32([0.0, -0.5, -1e30])
    assert good in fields["body"]
    forged = {**fields, "body": fields["body"].replace(good, pack_f32([0.0, bad, -1.0]))}
    with pytest.raises(MalformedEntry, match="logprobs"):
        decode_entry(forged, RolloutGroup)


def pack_f32(values: list[float]) -> bytes:
    return packed.pack(values, "f")
