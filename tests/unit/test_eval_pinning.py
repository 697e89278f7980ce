"""A checkpoint with an evaluation queued is pinned until the job ends, whatever its outcome."""

from __future__ import annotations

import fakeredis
import pytest

from shared.evaluation import enqueue_eval, pinned_checkpoints, run_eval_job
from shared.modeling.loading import ModelNotFound


def test_enqueue_pins_and_a_failed_job_unpins(tmp_path) -> None:
    r = fakeredis.FakeRedis()
    ckpt = str(tmp_path / "v00000003")
    enqueue_eval(r, "q", ckpt, "3", 3, "data/reverse/test.jsonl", 4, "pfx")
    assert pinned_checkpoints(r, "pfx") == [ckpt]
    with pytest.raises(ModelNotFound):  # the directory holds no model: the job fails...
        run_eval_job(ckpt, "3", 3, "data/reverse/test.jsonl", 4, "pfx", r=r)
    assert pinned_checkpoints(r, "pfx") == []  # ...and still releases the pin
