"""Training precision: the lr bound of each weight dtype, the config check, and what each mode keeps or loses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paths import REPO
from trainer_factory import SMALL_SPEC, VOCAB, batch, changed_fraction

from services.trainer.learner import Learner
from services.trainer.precision import cast_floating
from shared.config import TrainConfig, load_config
from shared.errors import ConfigError
from shared.modeling import build_model
from shared.precision import WeightDtype, checkpoint_dtype, lr_problem, min_lr, ulp

torch.set_num_threads(1)
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- the bound (pure) ---


def test_ulp_is_the_spacing_of_the_dtype_at_that_magnitude() -> None:
    assert ulp(1.0, "bfloat16") == 2**-7 and ulp(1.0, "float32") == 2**-23 and ulp(1.0, "float16") == 2**-10
    assert ulp(1e-2, "bfloat16") == 2**-14  # 1e-2 = 1.28 * 2**-7
    assert min_lr("bfloat16") == pytest.approx(3.05e-5, rel=1e-3)
    assert min_lr("float32") == pytest.approx(4.66e-10, rel=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("magnitude", [1e-3, 1e-2, 0.05, 0.1, 1.0])
def test_min_lr_is_where_torch_starts_to_keep_an_update(dtype: WeightDtype, magnitude: float) -> None:
    w = torch.tensor(magnitude, dtype=TORCH[dtype])
    bound = min_lr(dtype, float(w))
    assert torch.tensor(float(w) + 0.99 * bound, dtype=TORCH[dtype]) == w  # rounded away
    assert torch.tensor(float(w) + 1.01 * bound, dtype=TORCH[dtype]) != w  # kept


def test_lr_problem_names_the_key_and_the_dtype_only_when_the_weights_cannot_move() -> None:
    problem = lr_problem(1e-6, "bf16-pure")
    assert problem is not None and "train.lr=1e-06" in problem and "bfloat16" in problem
    assert lr_problem(1e-6, "bf16-mixed") is None and lr_problem(1e-6, "fp32") is None
    assert lr_problem(1e-4, "bf16-pure") is None
    assert lr_problem(1e-10, "fp32") is not None


def test_checkpoint_dtype_auto_is_the_compute_dtype() -> None:
    assert checkpoint_dtype("fp32") == "float32"
    assert checkpoint_dtype("bf16-mixed") == "bfloat16" == checkpoint_dtype("bf16-pure")
    assert checkpoint_dtype("bf16-mixed", "float32") == "float32"


# --- the config ---


def test_a_too_small_lr_for_the_weight_dtype_is_refused_naming_train_lr() -> None:
    with pytest.raises(ConfigError, match=r"train\.lr=1e-06 is too small for bfloat16 weights"):
        load_config(None, env={"DRESSAGE_TRAIN_PRECISION": "bf16-pure", "DRESSAGE_TRAIN_LR": "1e-6"})
    assert load_config(None, env={"DRESSAGE_TRAIN_PRECISION": "bf16-mixed",
                                  "DRESSAGE_TRAIN_LR": "1e-6"}).train.precision == "bf16-mixed"


def test_the_deprecated_dtype_key_still_sets_the_precision() -> None:
    assert TrainConfig(dtype="float32").precision == "fp32"
    assert TrainConfig(dtype="bfloat16").precision == "bf16-pure"
    with pytest.raises(ValueError, match=r"set by train\.dtype=bfloat16"):
        TrainConfig(dtype="bfloat16", lr=1e-6)
    with pytest.raises(ValueError, match="contradicts train.precision=bf16-mixed"):
        TrainConfig(dtype="bfloat16", precision="bf16-mixed")
    with pytest.raises(ValueError, match="float16"):
        TrainConfig(dtype="float16")
    again = TrainConfig.model_validate(TrainConfig(dtype="bfloat16").model_dump())  # a dumped config reloads
    assert again.precision == "bf16-pure"


# --- what the learner keeps ---


def gpu_train_config() -> TrainConfig:
    """configs/gpu.yaml's trainer (lr 1e-6 and its precision), on this machine's CPU."""
    cfg = load_config(REPO / "configs" / "gpu.yaml", env={"REDIS_PASSWORD": "a-test-only-password"})
    return cfg.train.model_copy(update={"device": "cpu"})


def test_the_shipped_gpu_config_keeps_the_updates_that_bf16_weights_lose() -> None:
    kept = changed_fraction(gpu_train_config(), steps=10)
    # The same steps on bf16 weights without a master copy (what train.dtype: bfloat16 trained): the start-up
    # check refuses this lr for bf16-pure, so the config is built past it to show what it would lose.
    pure = TrainConfig(precision="bf16-pure").model_copy(update={"lr": gpu_train_config().lr})
    lost = changed_fraction(pure, steps=10)
    assert kept > 0.99, kept
    assert lost < 0.1, lost


def test_bf16_mixed_trains_fp32_weights_and_publishes_bf16_with_the_master_in_the_state() -> None:
    model = build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0)
    torch.nn.Module.to(model, torch.bfloat16)  # e.g. a bf16 checkpoint
    learner = Learner(model, TrainConfig(precision="bf16-mixed", micro_batch_size=8), pad_id=0)
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    learner.train_step([batch("b1")])
    assert {s["exp_avg"].dtype for s in learner.optimizer.state.values()} == {torch.float32}
    weights, state = learner.export()
    assert weights is not None and {t.dtype for t in weights.values()} == {torch.bfloat16}
    master = state["master_weights"]
    assert all(torch.equal(master[k], v) for k, v in learner.model.state_dict().items())
    resumed = Learner(build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0),
                      TrainConfig(precision="bf16-mixed", micro_batch_size=8), pad_id=0)
    resumed.load_state_dict(state)  # from the master weights, not from the bf16 copy the engines load
    assert all(torch.equal(resumed.model.state_dict()[k], v) for k, v in master.items())


def test_bf16_checkpoints_say_bfloat16_and_load_as_published(tmp_path: Path) -> None:
    import json

    from safetensors import safe_open

    from services.trainer.modeldir import WEIGHTS_FILE, ModelDirWriter
    from shared.modeling import build_tokenizer, load_model

    learner = Learner(build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0), TrainConfig(precision="bf16-mixed"), pad_id=0)
    writer = ModelDirWriter(learner.model, build_tokenizer(64))
    for version in (1, 2):  # a full save, then the fast path that links config.json from the first
        learner.train_step([batch(f"b{version}")])
        weights, _ = learner.export()
        out = tmp_path / f"v{version}"
        out.mkdir()
        writer.write(out, weights)
        writer.finished(out)
        config = json.loads((out / "config.json").read_text())
        assert config["dtype"] == config["torch_dtype"] == "bfloat16"
        with safe_open(str(out / WEIGHTS_FILE), framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        loaded = load_model(out, dtype="bfloat16").state_dict()
        assert weights is not None and all(torch.equal(loaded[k], v) for k, v in weights.items())


def test_fp32_publishes_the_weights_as_they_are() -> None:
    learner = Learner(build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0), TrainConfig(), pad_id=0)
    weights, state = learner.export()
    assert weights is None and "master_weights" not in state


def test_cast_floating_keeps_tied_tensors_one_tensor() -> None:
    shared = torch.ones(2, 2)
    out = cast_floating({"embed": shared, "head": shared, "ids": torch.arange(3)}, torch.bfloat16)
    assert out["embed"] is out["head"] and out["embed"].dtype == torch.bfloat16
    assert out["ids"].dtype == torch.int64
