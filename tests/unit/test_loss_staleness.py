"""Soft staleness weights and the naive loss: hand-computed cases and properties (no Redis)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from trainer_factory import SMALL_SPEC, VOCAB, batch, group

from services.trainer.batching import build_rows, collate
from services.trainer.learner import Learner
from services.trainer.loss import LossConfig, policy_loss, staleness_weight
from shared.config import TrainConfig, load_config
from shared.errors import ConfigError
from shared.modeling import build_model

torch.set_num_threads(1)


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def test_staleness_weight_families_on_hand_computed_cases() -> None:
    assert staleness_weight(2, "exp", 0.5) == pytest.approx(math.exp(-1.0))  # 0.3679
    assert staleness_weight(3, "exp", 1.0) == pytest.approx(0.049787, rel=1e-4)
    assert staleness_weight(2, "inverse", 0.5) == pytest.approx(0.5)
    assert staleness_weight(4, "inverse", 0.25) == pytest.approx(0.5)
    assert staleness_weight(0, "exp", 3.0) == 1.0 and staleness_weight(-2, "inverse", 3.0) == 1.0  # never up-weighted
    assert staleness_weight(7, "off", 3.0) == 1.0 and staleness_weight(5, "exp", 0.0) == 1.0
    with pytest.raises(ValueError, match="train.staleness_weight"):
        staleness_weight(1, "linear", 0.5)


@given(st.sampled_from(["exp", "inverse"]), st.integers(-3, 50), st.integers(0, 50), st.floats(0, 20),
       st.floats(0, 20))
def test_staleness_weight_is_in_0_1_and_non_increasing_in_gap_and_lambda(family: str, g1: int, g2: int,
                                                                           l1: float, l2: float) -> None:
    lo, hi = sorted((g1, g2))
    small, big = sorted((l1, l2))
    w = staleness_weight(hi, family, big)
    assert 0.0 <= w <= 1.0
    assert staleness_weight(hi, family, small) >= w and staleness_weight(lo, family, big) >= w


def test_weights_scale_each_sequence_and_keep_the_token_denominator() -> None:
    # ratio 1 (logp = rollout), A = [1, -2], one loss token each, n_tokens = 2.
    logp = torch.tensor([[0.0, -1.0], [0.0, -2.0]], requires_grad=True)
    rollout = logp.detach().clone()
    adv, mask = torch.tensor([1.0, -2.0]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    plain = policy_loss(logp, rollout, adv, mask, 2, LossConfig())
    assert float(plain.loss.detach()) == pytest.approx((-1.0 + 2.0) / 2)
    weighted = policy_loss(logp, rollout, adv, mask, 2, LossConfig(), weights=torch.tensor([1.0, 0.5]))
    assert float(weighted.loss.detach()) == pytest.approx((-1.0 * 1.0 + 2.0 * 0.5) / 2)  # = 0.0
    weighted.loss.backward()
    assert logp.grad is not None
    assert logp.grad[:, 1].tolist() == pytest.approx([-0.5, 0.5])  # d/dlogp of -A w r / n
    assert weighted.sums["staleness_weight"] == pytest.approx(1.5)


def test_naive_loss_ignores_the_behaviour_policy_and_never_clips() -> None:
    # Current policy 2x as likely as the behaviour policy, A = 1: the clipped loss stops at 1.2 with no gradient.
    rollout = t([0.0, math.log(0.25)])
    logp = t([0.0, math.log(0.5)]).requires_grad_(True)
    clipped = policy_loss(logp, rollout, torch.tensor([1.0]), t([0.0, 1.0]), 1, LossConfig(clip_eps=0.2))
    assert float(clipped.loss.detach()) == pytest.approx(-1.2) and clipped.sums["clip_frac"] == 1.0
    clipped.loss.backward()
    assert logp.grad is not None and float(logp.grad[0, 1]) == 0.0
    logp.grad = None
    naive = policy_loss(logp, rollout, torch.tensor([1.0]), t([0.0, 1.0]), 1, LossConfig(naive=True))
    assert float(naive.loss.detach()) == pytest.approx(-1.0) and naive.sums["clip_frac"] == 0.0  # -A, whatever the ratio
    naive.loss.backward()
    assert logp.grad is not None and float(logp.grad[0, 1]) == pytest.approx(-1.0)  # -A * d logp
    other = policy_loss(logp.detach(), t([0.0, -9.0]), torch.tensor([1.0]), t([0.0, 1.0]), 1, LossConfig(naive=True))
    assert float(other.loss) == float(naive.loss.detach())  # the behaviour logprobs play no part


def test_naive_loss_with_tis_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="naive"):
        LossConfig(naive=True, tis_cap=2.0)
    with pytest.raises(ConfigError, match="train.*tis_cap"):
        load_config(None, env={"DRESSAGE_TRAIN_POLICY_LOSS": "naive", "DRESSAGE_TRAIN_TIS_CAP": "2"})
    with pytest.raises(ConfigError, match="train.staleness_weight"):
        load_config(None, env={"DRESSAGE_TRAIN_STALENESS_WEIGHT": "linear"})


def test_rows_carry_the_weight_of_their_trajectorys_gap() -> None:
    rng = random.Random(0)
    b = batch("b1", n_groups=0)
    b.groups = [group("fresh", rng, n_samples=2, version="5"), group("stale", rng, n_samples=2, version="3")]
    weigh = lambda gap: staleness_weight(gap, "exp", 0.5)  # noqa: E731
    rows = build_rows([b], True, False, current_version=5, weight=weigh).rows
    assert [r.weight for r in rows] == pytest.approx([1.0, 1.0, math.exp(-1.0), math.exp(-1.0)])
    assert collate(rows, 0).weights.tolist() == pytest.approx([r.weight for r in rows])
    assert {r.weight for r in build_rows([b], True, False).rows} == {1.0}  # off: unweighted


def learner(**cfg: Any) -> Learner:
    model = build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0)
    return Learner(model, TrainConfig(micro_batch_size=4, lr=1e-2, **cfg), pad_id=0)


def test_learner_reports_the_mean_weight_and_a_stale_batch_moves_the_weights_less() -> None:
    plain, weighted = learner(), learner(staleness_weight="exp", staleness_lambda=1.0)
    stale = batch("b1", version="0")
    m_plain = plain.train_step([stale], current_version=3)
    m_weighted = weighted.train_step([stale], current_version=3)
    assert "train/staleness_weight_mean" not in m_plain
    assert m_weighted["train/staleness_weight_mean"] == pytest.approx(math.exp(-3.0), rel=1e-5)
    assert m_weighted["train/loss"] == pytest.approx(m_plain["train/loss"] * math.exp(-3.0), rel=1e-4)


def test_learner_with_the_naive_loss_trains_and_reports_no_clipping() -> None:
    m = learner(policy_loss="naive").train_step([batch("b1")])
    assert m["train/clip_frac"] == 0.0 and m["train/grad_norm"] > 0
