"""GRPO loss on hand-computed cases: advantages, masks, clipping, TIS, KL, logprob diff."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import (
    STD_EPS,
    LossConfig,
    entropy_sum,
    group_advantages,
    kl_k3,
    offpolicy_sums,
    policy_loss,
    sample_advantages,
    token_logprobs,
    train_masks,
    trajectory_rewards,
)
from shared.schemas import Sample
from shared.staleness import sample_version_fields

torch.set_num_threads(1)


def sample(traj: str, seg: int = 0, reward: float = 0.0, mask: list[int] | None = None,
           versions: list[str] | None = None) -> Sample:
    mask = mask if mask is not None else [0, 1, 1]
    versions = versions if versions is not None else ["-1"] + ["0"] * (len(mask) - 1)
    return Sample(traj_id=traj, segment_index=seg, token_ids=list(range(len(mask))), loss_mask=mask,
                  logprobs=[0.0] * len(mask), token_versions=versions, reward=reward,
                  **sample_version_fields(mask, versions))


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


# --- advantages ---


def test_advantages_are_mean_centred_without_std() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=False) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 2.0, 3.0], std_normalize=False) == [-1.0, 0.0, 1.0]


def test_advantages_divide_by_sample_std() -> None:
    # centred [0.5, -0.5, -0.5, 0.5]; sample std = sqrt(1 / 3)
    got = group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True)
    want = 0.5 / (math.sqrt(1 / 3) + STD_EPS)
    assert got == pytest.approx([want, -want, -want, want], rel=1e-9)
    assert group_advantages([1.0, 2.0, 3.0], True) == pytest.approx([-1 / (1 + STD_EPS), 0.0, 1 / (1 + STD_EPS)])


def test_equal_rewards_and_single_trajectory_give_zero_advantage() -> None:
    assert group_advantages([0.7, 0.7, 0.7], std_normalize=True) == [0.0, 0.0, 0.0]
    assert group_advantages([0.3], std_normalize=True) == [0.0]
    assert group_advantages([], std_normalize=True) == []


def test_multi_segment_trajectory_takes_its_last_segment_reward_for_every_segment() -> None:
    # Trajectory "a": segment 1 (listed first) holds the reward 1.0; segment 0 carries 0.0 on the wire.
    samples = [sample("a", seg=1, reward=1.0), sample("b", reward=0.0), sample("a", seg=0, reward=0.0)]
    assert trajectory_rewards(samples) == [1.0, 0.0]
    assert sample_advantages(samples, std_normalize=False) == [0.5, -0.5, 0.5]


def test_segment_tie_is_won_by_the_later_sample() -> None:
    samples = [sample("a", seg=0, reward=0.0), sample("a", seg=0, reward=1.0), sample("b", reward=0.0)]
    assert trajectory_rewards(samples) == [1.0, 0.0]


# --- masks ---


def test_train_mask_never_puts_loss_on_position_zero() -> None:
    assert train_masks([sample("a", mask=[1, 1, 0, 1])], mask_nonlast=False) == [[0, 1, 0, 1]]


def test_nonlast_version_tokens_are_masked_as_in_the_reference() -> None:
    s = sample("a", mask=[0, 1, 1, 0, 1], versions=["-1", "v0", "v1", "-1", "v1"])
    assert train_masks([s], mask_nonlast=True) == [[0, 0, 1, 0, 1]]
    assert train_masks([s], mask_nonlast=False) == [[0, 1, 1, 0, 1]]
    single = sample("b", mask=[0, 1, 1], versions=["-1", "v2", "v2"])
    assert train_masks([single], mask_nonlast=True) == [[0, 1, 1]]


def test_nonlast_masking_spans_all_segments_of_a_trajectory() -> None:
    seg0 = sample("a", seg=0, mask=[0, 1, 1], versions=["-1", "1", "1"])
    seg1 = sample("a", seg=1, mask=[0, 1, 1], versions=["-1", "2", "2"], reward=1.0)
    other = sample("b", seg=0, mask=[0, 1, 1], versions=["-1", "1", "1"])
    # Listed out of order on purpose: segment order decides which version is last.
    assert train_masks([seg1, other, seg0], mask_nonlast=True) == [[0, 1, 1], [0, 1, 1], [0, 0, 0]]


# --- token quantities ---


def test_token_logprobs_shift_by_one_and_zero_position_zero() -> None:
    logits = torch.zeros((1, 3, 4))  # uniform over 4 tokens
    logits[0, 1, 2] = math.log(3.0)  # position 1 predicts token 2 with p = 3 / 6
    ids = torch.tensor([[0, 1, 2]])
    got = token_logprobs(logits, ids)
    assert got[0, 0] == 0.0
    assert got[0, 1] == pytest.approx(math.log(1 / 4))
    assert got[0, 2] == pytest.approx(math.log(1 / 2))


def test_entropy_is_summed_over_loss_tokens_only() -> None:
    logits = torch.zeros((1, 3, 4))  # position 0 predicts token 1: uniform, entropy log 4
    logits[0, 1] = torch.tensor([0.0, 0.0, -1e9, -1e9])  # position 1 predicts token 2: two choices, log 2
    assert entropy_sum(logits, t([0.0, 1.0, 1.0])) == pytest.approx(math.log(4) + math.log(2), rel=1e-5)
    assert entropy_sum(logits, t([1.0, 0.0, 1.0])) == pytest.approx(math.log(2), rel=1e-5)


def test_kl_k3_is_zero_on_agreement_and_matches_the_formula() -> None:
    assert float(kl_k3(t([-1.0]), t([-1.0]))) == 0.0
    d = math.log(0.5)
    assert float(kl_k3(t([0.0]), t([d]))) == pytest.approx(math.exp(d) - d - 1)


# --- policy loss ---


def run_loss(ratio: float, adv: float, cfg: LossConfig) -> tuple[float, float, float]:
    """Loss, clip fraction and d loss / d logp for one loss token with the given ratio."""
    logp = torch.tensor([[0.0, math.log(ratio)]], requires_grad=True)
    parts = policy_loss(logp, t([0.0, 0.0]), torch.tensor([adv]), t([0.0, 1.0]), 1, cfg)
    parts.loss.backward()
    assert logp.grad is not None
    return float(parts.loss.detach()), parts.sums["clip_frac"], float(logp.grad[0, 1])


def test_positive_advantage_is_clipped_above_one_plus_eps() -> None:
    loss, clip, grad = run_loss(1.5, 1.0, LossConfig(clip_eps=0.2))
    assert (loss, clip, grad) == (pytest.approx(-1.2), 1.0, 0.0)
    loss, clip, grad = run_loss(0.5, 1.0, LossConfig(clip_eps=0.2))  # below 1 - eps: not clipped
    assert (loss, clip, grad) == (pytest.approx(-0.5), 0.0, pytest.approx(-0.5))


def test_negative_advantage_is_clipped_below_one_minus_eps() -> None:
    loss, clip, grad = run_loss(0.5, -1.0, LossConfig(clip_eps=0.2))
    assert (loss, clip, grad) == (pytest.approx(0.8), 1.0, 0.0)
    loss, clip, grad = run_loss(1.5, -1.0, LossConfig(clip_eps=0.2))  # above 1 + eps: not clipped
    assert (loss, clip, grad) == (pytest.approx(1.5), 0.0, pytest.approx(1.5))


def test_clip_eps_high_widens_the_upper_bound_only() -> None:
    assert run_loss(1.25, 1.0, LossConfig(clip_eps=0.2))[:2] == (pytest.approx(-1.2), 1.0)
    assert run_loss(1.25, 1.0, LossConfig(clip_eps=0.2, clip_eps_high=0.28))[:2] == (pytest.approx(-1.25), 0.0)
    assert run_loss(0.7, -1.0, LossConfig(clip_eps=0.2, clip_eps_high=0.28))[:2] == (pytest.approx(0.8), 1.0)


def test_loss_is_a_token_mean_over_the_step_and_ignores_masked_tokens() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -1.0, -3.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    cfg = LossConfig(clip_eps=10.0)  # no clipping: per-token loss = -ratio * A = -A (ratio 1)
    whole = policy_loss(logp, logp, adv, mask, 4, cfg)
    assert float(whole.loss) == pytest.approx((-1 - 1 + 2 + 2) / 4)
    parts = [policy_loss(logp[i : i + 1], logp[i : i + 1], adv[i : i + 1], mask[i : i + 1], 4, cfg) for i in (0, 1)]
    assert float(parts[0].loss + parts[1].loss) == pytest.approx(float(whole.loss))


def test_logprob_abs_diff_sums_over_loss_tokens_only() -> None:
    logp, rollout = t([0.0, -1.0, -2.0, -9.0]), t([0.0, -1.5, -1.0, 0.0])
    sums = offpolicy_sums(logp, rollout, t([0.0, 1.0, 1.0, 0.0]), cap=5.0)
    assert sums["logprob_abs_diff"] / 2 == pytest.approx(0.75)  # (0.5 + 1.0) / 2


def test_tis_weights_the_gradient_by_the_truncated_ratio_to_the_behaviour_policy() -> None:
    # current p = 0.5, behaviour p = 0.25: weight 2, truncated to the cap 1.5; ratio to itself is 1.
    logp = torch.tensor([[0.0, math.log(0.5)]], requires_grad=True)
    rollout = t([0.0, math.log(0.25)])
    parts = policy_loss(logp, rollout, torch.tensor([2.0]), t([0.0, 1.0]), 1, LossConfig(tis_cap=1.5))
    parts.loss.backward()
    assert float(parts.loss.detach()) == pytest.approx(-2.0 * 1.5)
    assert logp.grad is not None and float(logp.grad[0, 1]) == pytest.approx(-2.0 * 1.5)
    assert parts.sums["tis_weight"] == pytest.approx(1.5)
    uncapped = policy_loss(logp.detach(), rollout, torch.tensor([2.0]), t([0.0, 1.0]), 1, LossConfig(tis_cap=5.0))
    assert float(uncapped.loss) == pytest.approx(-2.0 * 2.0)


def test_kl_term_is_added_with_its_coefficient_and_needs_a_reference() -> None:
    logp, ref = t([0.0, 0.0]), t([0.0, math.log(0.5)])
    k3 = 0.5 - math.log(0.5) - 1
    parts = policy_loss(logp, logp, torch.tensor([0.0]), t([0.0, 1.0]), 1, LossConfig(kl_coef=0.1), ref_logp=ref)
    assert float(parts.loss) == pytest.approx(0.1 * k3)
    assert parts.sums["kl"] == pytest.approx(k3)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, torch.tensor([0.0]), t([0.0, 1.0]), 1, LossConfig(kl_coef=0.1))
