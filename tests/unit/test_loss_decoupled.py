"""The decoupled objective and the off-policy diagnostics on hand-computed cases (no Redis, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import LossConfig, ess, offpolicy_sums, policy_loss
from shared.config import load_config
from shared.errors import ConfigError

torch.set_num_threads(1)


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def one_token(current: float, proximal: float | None, behaviour: float, adv: float,
              cfg: LossConfig) -> tuple[float, float, float]:
    """Loss, clipped tokens and d loss / d logp for one loss token (probabilities given, not logs)."""
    logp = torch.tensor([[0.0, math.log(current)]], requires_grad=True)
    prox = None if proximal is None else t([0.0, math.log(proximal)])
    parts = policy_loss(logp, t([0.0, math.log(behaviour)]), torch.tensor([adv]), t([0.0, 1.0]), 1, cfg,
                        proximal_logp=prox)
    parts.loss.backward()
    assert logp.grad is not None
    return float(parts.loss.detach()), parts.sums["clip_frac"], float(logp.grad[0, 1])


def test_decoupled_clips_the_ratio_to_the_proximal_policy_and_weighs_by_the_behaviour_ratio() -> None:
    cfg = LossConfig(clip_eps=0.2, decoupled=True, behaviour_weight_cap=5.0)
    # current 0.55, proximal 0.5: ratio 1.1 inside the clip range; weight proximal / behaviour = 0.5 / 0.25 = 2
    loss, clipped, grad = one_token(0.55, 0.5, 0.25, 1.0, cfg)
    assert (loss, clipped, grad) == (pytest.approx(-1.1 * 2), 0.0, pytest.approx(-1.1 * 2))
    # current 0.7: ratio 1.4, clipped at 1.2 (no gradient), however far the behaviour policy is (ratio 2.8 to it)
    loss, clipped, grad = one_token(0.7, 0.5, 0.25, 1.0, cfg)
    assert (loss, clipped, grad) == (pytest.approx(-1.2 * 2), 1.0, 0.0)


def test_the_behaviour_weight_is_truncated_at_the_cap() -> None:
    cfg = LossConfig(decoupled=True, behaviour_weight_cap=1.5)
    loss, _, grad = one_token(0.5, 0.5, 0.1, 2.0, cfg)  # weight 5, cut to 1.5; ratio 1
    assert (loss, grad) == (pytest.approx(-2.0 * 1.5), pytest.approx(-2.0 * 1.5))


def test_mask_mode_drops_a_token_whose_behaviour_weight_exceeds_the_cap() -> None:
    cfg = LossConfig(decoupled=True, behaviour_weight_cap=1.5, behaviour_weight_mode="mask")
    assert one_token(0.5, 0.5, 0.1, 2.0, cfg)[::2] == (0.0, 0.0)  # weight 5 > 1.5: no loss, no gradient
    loss, _, grad = one_token(0.5, 0.5, 0.4, 2.0, cfg)  # weight 1.25 <= 1.5: kept as it is, not truncated
    assert (loss, grad) == (pytest.approx(-2.0 * 1.25), pytest.approx(-2.0 * 1.25))
    with pytest.raises(ValueError, match="behaviour_weight_mode"):
        LossConfig(decoupled=True, behaviour_weight_mode="clip")  # type: ignore[arg-type]  # the runtime check


def test_clipped_ignores_the_proximal_policy_and_clips_against_the_behaviour_policy() -> None:
    # the same token as above: ratio to the behaviour policy 0.55 / 0.25 = 2.2, clipped at 1.2
    loss, clipped, grad = one_token(0.55, 0.5, 0.25, 1.0, LossConfig(clip_eps=0.2))
    assert (loss, clipped, grad) == (pytest.approx(-1.2), 1.0, 0.0)


def test_without_proximal_logprobs_the_decoupled_loss_is_tis_on_the_current_policy() -> None:
    # first optimizer step of a batch: the proximal policy is the current one (ratio 1, never clipped), and the
    # decoupled loss is exactly clipped + tis_cap, the same objective under its older spelling
    decoupled = one_token(0.5, None, 0.25, 1.0, LossConfig(decoupled=True, behaviour_weight_cap=3.0))
    tis = one_token(0.5, None, 0.25, 1.0, LossConfig(tis_cap=3.0))
    assert decoupled == tis == (pytest.approx(-2.0), 0.0, pytest.approx(-2.0))


def test_two_caps_are_refused_in_the_loss_and_in_the_config_naming_the_keys() -> None:
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        LossConfig(decoupled=True, tis_cap=2.0)
    with pytest.raises(ConfigError, match=r"train\.tis_cap"):
        load_config(None, env={}, overrides={"train": {"policy_loss": "decoupled", "tis_cap": 2.0}})


@pytest.mark.parametrize(("key", "value"), [("minibatches_per_batch", 0), ("epochs_per_batch", 0),
                                            ("behaviour_weight_cap", 0.5), ("minibatches_per_batch", 5000)])
def test_minibatch_epoch_and_cap_bounds_are_refused_naming_the_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"train\.{key}"):
        load_config(None, env={}, overrides={"train": {key: value}})


def test_the_defaults_are_one_optimizer_step_per_batch_under_the_clipped_loss() -> None:
    train = load_config(None, env={}).train
    assert (train.minibatches_per_batch, train.epochs_per_batch, train.policy_loss) == (1, 1, "clipped")
    assert train.behaviour_weight_cap == 5.0


# --- diagnostics ---


def test_offpolicy_sums_are_hand_computed_over_loss_tokens_only() -> None:
    # loss tokens 1 and 2: proximal - behaviour = log 2 and log 0.5; token 3 is masked (and far off)
    proximal = t([0.0, math.log(0.5), math.log(0.25), 0.0])
    behaviour = t([0.0, math.log(0.25), math.log(0.5), -20.0])
    sums = offpolicy_sums(proximal, behaviour, t([0.0, 1.0, 1.0, 0.0]), cap=1.5)
    assert sums["logprob_abs_diff"] == pytest.approx(2 * math.log(2))
    assert sums["is_weight"] == pytest.approx(2.5) and sums["is_weight_sq"] == pytest.approx(4.25)
    assert sums["is_truncated"] == 1.0  # the weight 2 is above the cap 1.5
    k3 = (2 - math.log(2) - 1) + (0.5 + math.log(2) - 1)  # w - d - 1 per token
    assert sums["mismatch_kl"] == pytest.approx(k3)
    assert ess(sums["is_weight"], sums["is_weight_sq"], 2) == pytest.approx(2.5**2 / (2 * 4.25))


def test_on_policy_data_has_full_ess_no_truncation_and_zero_mismatch() -> None:
    logp = t([0.0, -1.0, -2.0, -3.0])
    sums = offpolicy_sums(logp, logp, t([0.0, 1.0, 1.0, 1.0]), cap=1.0)
    assert ess(sums["is_weight"], sums["is_weight_sq"], 3) == pytest.approx(1.0)
    assert sums["is_truncated"] == 0.0 and sums["mismatch_kl"] == pytest.approx(0.0, abs=1e-12)


def test_ess_falls_to_one_over_n_when_one_weight_dominates_or_overflows() -> None:
    assert ess(1e6 + 3, 1e12 + 3, 4) == pytest.approx(0.25, rel=1e-5)
    assert ess(math.inf, math.inf, 4) == 0.25
    assert ess(0.0, 0.0, 0) == 1.0


def test_diagnostics_add_up_over_micro_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    proximal, behaviour = -torch.rand(4, 6, generator=gen) * 3, -torch.rand(4, 6, generator=gen) * 3
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    whole = offpolicy_sums(proximal, behaviour, mask, cap=2.0)
    halves = [offpolicy_sums(proximal[i : i + 2], behaviour[i : i + 2], mask[i : i + 2], cap=2.0) for i in (0, 2)]
    for key, value in whole.items():
        assert halves[0][key] + halves[1][key] == pytest.approx(value, rel=1e-6)
