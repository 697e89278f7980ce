"""Engine checkpoint reading and checking, and the left-padded KV cache's join/leave layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from services.engine.kv import PaddedKV
from services.engine.runner import ModelRunner
from services.engine.weights import WeightLoadError, check_state, read_checkpoint
from shared.modeling import ModelSpec, build_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    spec = ModelSpec(hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    return build_model(spec, vocab_size=40, pad_token_id=0, eos_token_id=2, seed=0)


def test_saved_checkpoint_reads_back_and_passes_the_check(model: PreTrainedModel, tmp_path: Path) -> None:
    model.save_pretrained(tmp_path, safe_serialization=True)
    state = read_checkpoint(tmp_path)
    assert "lm_head.weight" not in state  # tied to the embedding: absent on disk, still accepted
    check_state(model, state)


def test_check_names_the_offending_tensor(model: PreTrainedModel) -> None:
    good = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(WeightLoadError, match=name):
        check_state(model, {**good, name: torch.zeros(3, 3)})
    with pytest.raises(WeightLoadError, match="model.norm.weight"):
        check_state(model, {k: v for k, v in good.items() if k != "model.norm.weight"})
    with pytest.raises(WeightLoadError, match="extra.bias"):
        check_state(model, {**good, "extra.bias": torch.zeros(1)})


def test_missing_or_corrupt_checkpoints_are_named(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadError, match="does not exist"):
        read_checkpoint(tmp_path / "nope")
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        read_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightLoadError, match="cannot read"):
        read_checkpoint(tmp_path)


def test_sharded_checkpoints_are_merged(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert sorted(read_checkpoint(tmp_path)) == ["a", "b"]


def test_kv_join_and_leave_keep_the_left_padded_layout(model: PreTrainedModel) -> None:
    runner = ModelRunner(model)
    a = runner.prefill([[5, 6, 7], [8, 9]]).kv
    b = runner.prefill([[5, 6, 7, 8, 9, 10]]).kv
    kv = PaddedKV.concat(a, b)
    kv.check()
    assert kv.width == 6 and kv.lengths.tolist() == [3, 2, 6]
    runner.decode(kv, torch.tensor([11, 12, 13]))
    kv.check()
    kv.select([0, 1])  # the widest row leaves: columns nobody uses are trimmed
    kv.check()
    assert kv.width == 4 and kv.lengths.tolist() == [4, 3]
    kv.select([1])
    assert kv.width == 3 and kv.mask.tolist() == [[1, 1, 1]]


def test_padded_rows_give_the_same_logits_as_alone(model: PreTrainedModel) -> None:
    runner = ModelRunner(model)
    alone = runner.prefill([[8, 9]])
    together = runner.prefill([[5, 6, 7, 1, 3], [8, 9]])
    assert torch.allclose(alone.last_logits[0], together.last_logits[1], atol=1e-5)
    step_alone = runner.decode(alone.kv, torch.tensor([4]))
    step_together = runner.decode(together.kv, torch.tensor([4, 4]))
    assert torch.allclose(step_alone[0], step_together[1], atol=1e-5)
