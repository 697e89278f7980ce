"""Trainer core without Redis: batch checks, rows/tensors, learner step, resume plan, fault specs."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_factory import SMALL_SPEC, VOCAB, batch, group

from services.trainer.batching import (
    InvalidBatch,
    build_rows,
    collate,
    micro_batches,
    validate_batch,
    version_gap,
)
from services.trainer.checkpoint import CheckpointInfo
from services.trainer.faults import parse_faults
from services.trainer.learner import Learner
from services.trainer.resume import plan_resume
from shared.config import TrainConfig
from shared.modeling import build_model
from shared.schemas import RolloutGroup, WeightVersion
from shared.versions import VersionFormatError

torch.set_num_threads(1)


# --- batching ---


def test_validate_batch_names_the_bad_field() -> None:
    b = batch("b1")
    validate_batch(b, VOCAB, 64)
    b.groups[1].samples[2].token_ids[3] = VOCAB + 5
    with pytest.raises(InvalidBatch, match=r"groups\[1\]\.samples\[2\]\.token_ids: id 105"):
        validate_batch(b, VOCAB, 64)
    with pytest.raises(InvalidBatch, match="exceed the model context 4"):
        validate_batch(batch("b2"), VOCAB, 4)


def test_batch_without_completed_samples_is_invalid() -> None:
    b = batch("b1", n_groups=1)
    b.groups[0] = RolloutGroup(group_id="g", prompt_id="p", attempt=0, status="failed", error="x")
    with pytest.raises(InvalidBatch, match="no completed group"):
        validate_batch(b, VOCAB, 64)


def test_build_rows_carries_advantages_masks_and_skips_failed_groups() -> None:
    b = batch("b1", n_groups=2)
    b.groups.append(RolloutGroup(group_id="gf", prompt_id="p", attempt=0, status="failed", error="x"))
    data = build_rows([b], std_normalize=False, mask_nonlast=False)
    assert (data.n_groups, data.n_failed_groups, len(data.rows)) == (2, 1, 8)
    assert [r.advantage for r in data.rows[:4]] == [-0.5, 0.5, -0.5, 0.5]  # rewards 0, 1, 0, 1
    assert data.rows[0].mask == [0] * 5 + [1] * 4
    assert data.loss_tokens == 8 * 4 and data.rewards == [0.0, 1.0] * 4


def test_micro_batches_cover_every_row_once_longest_first() -> None:
    rows = build_rows([batch("b1", n_groups=3)], True, False).rows
    chunks = micro_batches(rows, 5)
    assert [len(c) for c in chunks] == [5, 5, 2]
    assert sorted(id(r) for c in chunks for r in c) == sorted(id(r) for r in rows)


def test_collate_pads_on_the_right() -> None:
    rows = build_rows([batch("b1", n_groups=1)], True, False).rows
    short = rows[0].__class__(rows[0].token_ids[:3], [0, 1, 1], [0.0, -1.0, -2.0], 1.5)
    t = collate([rows[0], short], pad_id=0)
    assert t.input_ids.shape == (2, 9)
    assert t.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert t.mask[1].tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0]
    assert t.rollout_logp[1, :3].tolist() == [0.0, -1.0, -2.0] and t.advantages.tolist()[1] == 1.5


def test_version_gap_is_current_minus_each_trajectory_end_version() -> None:
    rng = random.Random(0)
    b = batch("b1", n_groups=0)
    b.groups = [group("g1", rng, n_samples=2, version="1"), group("g2", rng, n_samples=2, version="3")]
    assert version_gap([b], 4) == (2.0, 3)
    assert version_gap([batch("b2", version="v-label")], 4) is None


# --- learner ---


def tiny_learner(**cfg: Any) -> Learner:
    model = build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0)
    return Learner(model, TrainConfig(micro_batch_size=3, lr=1e-2, **cfg), pad_id=0)


def params(learner: Learner) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in learner.model.parameters()])


def test_train_step_updates_weights_and_reports_metrics() -> None:
    learner = tiny_learner()
    before = params(learner)
    m = learner.train_step([batch("b1"), batch("b2")])
    assert learner.step == 1
    assert not torch.equal(before, params(learner))
    assert m["train/groups"] == 4 and m["train/samples"] == 16 and m["train/loss_tokens"] == 64
    assert m["train/grad_norm"] > 0 and m["train/entropy"] > 0 and m["train/tokens_per_s"] > 0
    # Random rollout logprobs vs a random model: the diff is large and positive.
    assert m["train/train_rollout_logprob_abs_diff"] > 0.5


def test_equal_rewards_give_zero_gradient_and_unchanged_weights() -> None:
    learner = tiny_learner()
    b = batch("b1")
    for g in b.groups:
        for s in g.samples:
            s.reward = 0.5
    before = params(learner)
    m = learner.train_step([b])
    assert m["train/grad_norm"] == 0.0 and m["train/loss"] == 0.0
    assert torch.equal(before, params(learner))


def test_micro_batch_size_does_not_change_the_step() -> None:
    a, b = tiny_learner(), tiny_learner()
    b.cfg = b.cfg.model_copy(update={"micro_batch_size": 16})
    ma, mb = a.train_step([batch("b1")]), b.train_step([batch("b1")])
    assert ma["train/loss"] == pytest.approx(mb["train/loss"], rel=1e-4)
    assert torch.allclose(params(a), params(b), atol=1e-6)


def test_grad_accum_cuts_the_step_finer_without_changing_it() -> None:
    a, b = tiny_learner(), tiny_learner(grad_accum=4)  # micro_batch_size 3 vs at least 4 chunks of 8 rows
    ma, mb = a.train_step([batch("b1")]), b.train_step([batch("b1")])
    assert (ma["train/micro_batches"], mb["train/micro_batches"]) == (3, 4)
    assert torch.allclose(params(a), params(b), atol=1e-6)


def test_learner_state_round_trips() -> None:
    a = tiny_learner(warmup_steps=5)
    a.train_step([batch("b1")])
    b = tiny_learner(warmup_steps=5)
    b.load_state_dict(a.state_dict())
    assert b.step == 1 and b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    assert b.optimizer.state_dict()["state"].keys() == a.optimizer.state_dict()["state"].keys()


def test_kl_needs_a_reference_model() -> None:
    with pytest.raises(ValueError, match="reference model"):
        tiny_learner(kl_coef=0.1)


# --- resume plan ---


def ckpt(version: int) -> CheckpointInfo:
    return CheckpointInfo(version, version * 10, Path(f"/ckpt/v{version:08d}"))


def published(version: str) -> WeightVersion:
    return WeightVersion(version=version, path=f"/elsewhere/{version}", step=1, published_at=0.0)


def test_fresh_start_writes_and_publishes_v0() -> None:
    plan = plan_resume(None, None, Path("/model"))
    assert plan.write_initial and plan.version == -1 and plan.weights_from == Path("/model")


def test_unpublished_newest_checkpoint_is_announced_on_resume() -> None:
    plan = plan_resume(ckpt(3), published("2"), Path("/model"))
    assert plan.publish == ckpt(3) and plan.version == 3 and plan.checkpoint == ckpt(3)
    assert plan_resume(ckpt(0), None, Path("/model")).publish == ckpt(0)


def test_next_version_is_above_both_checkpoint_and_publication() -> None:
    assert plan_resume(ckpt(3), published("3"), Path("/m")).version == 3
    plan = plan_resume(ckpt(3), published("7"), Path("/m"))
    assert plan.version == 7 and plan.publish is None and plan.weights_from == ckpt(3).path
    lost = plan_resume(None, published("5"), Path("/m"), published_complete=True)
    assert lost.version == 5 and not lost.write_initial and lost.weights_from == Path("/elsewhere/5")


def test_foreign_version_label_is_refused() -> None:
    with pytest.raises(VersionFormatError, match="'v3'"):
        plan_resume(None, published("v3"), Path("/m"))


# --- fault specs ---


def test_fault_spec_parses_points_and_counts() -> None:
    assert parse_faults("after_checkpoint:2, after_step") == {"after_checkpoint": 2, "after_step": 1}
    assert parse_faults(None) == {}
    with pytest.raises(ValueError, match="unknown fault point 'nowhere'"):
        parse_faults("nowhere:1")
    with pytest.raises(ValueError, match="integer"):
        parse_faults("after_ack:x")


# --- entry points ---


def test_entry_points_refuse_a_bad_config_with_exit_code_2(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from services.eval_worker.main import main as eval_main
    from services.trainer.main import main as trainer_main

    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  clip_eps: -1\n")
    small_lr = tmp_path / "small-lr.yaml"  # bf16 weights cannot take lr 1e-6 (shared.precision)
    small_lr.write_text("train:\n  precision: bf16-pure\n  lr: 0.000001\n")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # the mains install their own log handler
    try:
        assert trainer_main(["--config", str(bad)]) == 2
        assert eval_main(["--config", str(tmp_path / "missing.yaml")]) == 2
        assert trainer_main(["--config", str(small_lr)]) == 2
    finally:
        root.handlers[:], root.level = handlers, level
    assert "cannot start: invalid configuration: train: Value error, train.lr=1e-06 is too small for bfloat16 " \
           "weights (train.precision=bf16-pure)" in capfd.readouterr().err


def test_version_gap_hist_counts_trajectories_per_gap() -> None:
    from services.trainer.batching import version_gap_hist

    b = batch("b1")
    gaps = [4 - int(v) for g in b.groups for v in g.end_versions if v.isdigit()]
    assert version_gap_hist([b], 4) == {str(k): gaps.count(k) for k in sorted(set(gaps))}
    assert sum(version_gap_hist([b], 4).values()) == len(gaps) > 0


def test_version_span_hist_counts_trajectories_per_number_of_versions_they_span() -> None:
    from services.trainer.batching import version_span_hist
    from shared.staleness import sample_version_fields

    b = batch("b1", n_groups=2)  # 2 groups x 4 one-version trajectories
    assert version_span_hist([b]) == {"1": 8}
    s = b.groups[0].samples[0]  # resumed across two updates: versions 0, 1, 2 over its response tokens
    versions = ["-1"] * 5 + ["0", "1", "1", "2"]
    s.token_versions, s.loss_mask = versions, [0] * 5 + [1] * 4
    for k, v in sample_version_fields(s.loss_mask, versions).items():
        setattr(s, k, v)
    assert version_span_hist([b]) == {"1": 7, "3": 1}


def test_a_frozen_commit_copy_does_not_follow_the_next_optimizer_step() -> None:
    from services.trainer.loop import _frozen

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    weights, state = _frozen(model.state_dict()), _frozen({"optimizer": opt.state_dict(), "step": 1})
    before = {k: v.clone() for k, v in weights.items()}
    moment = state["optimizer"]["state"][0]["exp_avg"].clone()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # what the loop does while the commit thread writes
    assert all(torch.equal(weights[k], before[k]) for k in before)
    assert not torch.equal(model.weight, weights["weight"])
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], moment) and state["step"] == 1


def straddling_batch() -> Any:
    """b1 with two of its samples resumed across updates: response tokens of versions 0, 0, 1, 1."""
    from shared.staleness import sample_version_fields

    b = batch("b1")
    for s in (b.groups[0].samples[0], b.groups[1].samples[2]):
        s.token_versions = ["-1"] * 5 + ["0", "0", "1", "1"]
        for k, v in sample_version_fields(s.loss_mask, s.token_versions).items():
            setattr(s, k, v)
    return b


def test_the_version_mask_reports_the_diff_over_every_response_token_too() -> None:
    # Two learners with the same initial weights see the same batch; the diff is taken before the update.
    plain = tiny_learner().train_step([straddling_batch()], current_version=2)
    masked = tiny_learner(mask_nonlast_version_tokens=True).train_step([straddling_batch()], current_version=2)
    assert "train/train_rollout_logprob_abs_diff_all" not in plain
    assert masked["train/loss_tokens"] == plain["train/loss_tokens"] - 2 * 2  # two old-version tokens each
    # Over every response token, the masked run's diff is the unmasked run's diff ...
    assert masked["train/train_rollout_logprob_abs_diff_all"] == pytest.approx(
        plain["train/train_rollout_logprob_abs_diff"], rel=1e-5)
    # ... while its loss-token diff leaves the masked tokens out, so it differs.
    assert masked["train/train_rollout_logprob_abs_diff"] != pytest.approx(
        plain["train/train_rollout_logprob_abs_diff"], rel=1e-3)
