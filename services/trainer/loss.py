"""GRPO loss, pure: advantages, loss masks, clipped / decoupled / naive policy gradient, TIS, KL, staleness
weights, and the off-policy diagnostics of a batch.

Nothing here touches Redis, files or the model; every function maps plain values or tensors to
values or tensors, so each one is checked on hand-computed cases (tests/unit/test_loss.py).

Conventions (one per token position ``t`` of a padded ``[B, T]`` batch):
* ``logp[b, t]`` is the current policy's log-probability of ``token_ids[b, t]`` given the tokens
  before it; position 0 has no prediction and is never a loss token.
* ``mask[b, t]`` is 1.0 on tokens that carry loss, 0.0 elsewhere (padding included).
* ``advantages[b]`` is one scalar per sequence, broadcast over its tokens.

Invariant: the loss is a token-level mean over *all* loss tokens of an optimizer step; the
caller passes that count as ``n_tokens`` so micro-batches add up to exactly the full-batch loss.
Staleness weights (``staleness_weight``) scale a sequence's tokens inside that sum and leave the
denominator alone: a stale trajectory contributes less, a fresh one never more than unweighted.

Three log-probabilities per loss token: ``logp`` (the policy being stepped, with gradient), the
*behaviour* ``rollout_logp`` (recorded by the engine that sampled the token) and the *proximal*
``proximal_logp`` (the policy before the batch's first optimizer step, without gradient). With one
optimizer step per batch the proximal policy is ``logp`` itself, detached; with several
(``train.minibatches_per_batch``/``epochs_per_batch``) the learner computes it once before the first
update and passes it in. The decoupled loss (and TIS, which is the same objective) takes the PPO ratio
against the proximal policy and corrects for the behaviour policy with the truncated importance weight
``min(exp(proximal_logp - rollout_logp), cap)``; ``offpolicy_sums`` measures that weight. With
``train.proximal_logprobs: loglinear`` the learner skips that forward and ``loglinear_proximal``
approximates the proximal log-probabilities from the behaviour ones and the current ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from shared.schemas import Sample
from shared.staleness import mask_nonlast_version_tokens

STD_EPS = 1e-6  # added to the group std before dividing (a group of equal rewards stays at 0)


# --- advantages -----------------------------------------------------------------------------


def group_advantages(rewards: Sequence[float], std_normalize: bool) -> list[float]:
    """GRPO advantages of one group: ``r - mean(r)``, divided by ``std(r) + eps`` when asked.

    The std is the sample std (n - 1 in the denominator, as ``torch.std``); a group of one
    trajectory has advantage 0.
    """
    n = len(rewards)
    if n == 0 or max(rewards) == min(rewards):
        return [0.0] * n  # exactly 0, not float noise amplified by 1 / eps
    mean = math.fsum(rewards) / n
    centred = [float(r) - mean for r in rewards]
    if not std_normalize:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (n - 1)) if n > 1 else 0.0
    return [c / (std + STD_EPS) for c in centred]


def _last_segment_rewards(samples: Sequence[Sample]) -> dict[str, float]:
    """traj_id -> reward of its last segment (highest ``segment_index``; a later sample wins a tie)."""
    last: dict[str, tuple[tuple[int, int], float]] = {}
    for order, s in enumerate(samples):
        pos = (s.segment_index, order)
        if s.traj_id not in last or last[s.traj_id][0] <= pos:
            last[s.traj_id] = (pos, float(s.reward))
    return {traj: reward for traj, (_, reward) in last.items()}


def sample_advantages(samples: Sequence[Sample], std_normalize: bool) -> list[float]:
    """One advantage per sample of a GRPO group (same order as ``samples``).

    A trajectory's reward is the reward of its last segment; every segment of the trajectory
    gets that trajectory's advantage (earlier segments carry reward 0.0 on the wire).
    """
    rewards = _last_segment_rewards(samples)
    adv = dict(zip(rewards, group_advantages(list(rewards.values()), std_normalize), strict=True))
    return [adv[s.traj_id] for s in samples]


def trajectory_rewards(samples: Sequence[Sample]) -> list[float]:
    """The reward of each trajectory (its last segment's), in order of first appearance."""
    return list(_last_segment_rewards(samples).values())


# --- masks ----------------------------------------------------------------------------------


def train_masks(samples: Sequence[Sample], mask_nonlast: bool) -> list[list[int]]:
    """Per-sample loss masks: ``loss_mask`` with position 0 off, optionally non-last versions off.

    With ``mask_nonlast`` the segments of one trajectory are joined in ``segment_index`` order and
    ``shared.staleness.mask_nonlast_version_tokens`` keeps loss only on the tokens of the
    trajectory's last real version (docs/architecture.md#loss-mask, applied to the whole trajectory).
    """
    masks = [[0, *s.loss_mask[1:]] if s.loss_mask else [] for s in samples]
    if not mask_nonlast:
        return masks
    by_traj: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_traj.setdefault(s.traj_id, []).append(i)
    for idxs in by_traj.values():
        idxs.sort(key=lambda i: (samples[i].segment_index, i))
        joined_mask = [m for i in idxs for m in masks[i]]
        joined_versions = [v for i in idxs for v in samples[i].token_versions]
        kept = mask_nonlast_version_tokens(joined_mask, joined_versions)
        start = 0
        for i in idxs:
            n = len(masks[i])
            masks[i] = kept[start : start + n]
            start += n
    return masks


# --- token-level quantities -----------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probability of each token given its prefix (position 0 is 0.0).

    ``logits[b, t]`` predicts ``input_ids[b, t + 1]``. Computed as ``logit - logsumexp`` in float32,
    which keeps no ``[B, T, vocab]`` log-softmax alive for the backward pass.
    """
    shifted = logits[:, :-1].float()
    picked = shifted.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)


@torch.no_grad()
def entropy_sum(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Sum over loss tokens of the entropy of the distribution that predicted each token.

    Only the masked positions are expanded to full-vocabulary probabilities (memory stays small
    for real vocabularies).
    """
    picked = logits[:, :-1][mask[:, 1:] > 0].float()  # [n_loss_tokens, vocab]
    logp = torch.log_softmax(picked, dim=-1)
    return float(-(logp.exp() * logp).sum())


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): ``exp(d) - d - 1`` with ``d = ref - logp``.

    Non-negative, zero where the two agree, unbiased for the KL under samples from the policy.
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


# --- staleness weights ------------------------------------------------------------------------

STALENESS_WEIGHTS = ("off", "exp", "inverse")  # the families of train.staleness_weight


def staleness_weight(gap: int, family: str, lam: float) -> float:
    """Loss weight of a trajectory ``gap`` versions behind the policy being trained.

    ``off``: 1. ``exp``: ``exp(-lam * gap)``. ``inverse``: ``1 / (1 + lam * gap)``. Both families are
    1 at gap 0, non-increasing in ``gap`` and in ``lam``, and stay in (0, 1]; a gap <= 0 (fresh, or a
    version the trainer cannot order) weighs 1, so no trajectory is ever up-weighted.
    """
    if family not in STALENESS_WEIGHTS:
        raise ValueError(f"train.staleness_weight must be one of {STALENESS_WEIGHTS}, got {family!r}")
    if family == "off" or gap <= 0:
        return 1.0
    return math.exp(-lam * gap) if family == "exp" else 1.0 / (1.0 + lam * gap)


@dataclass(frozen=True)
class LossConfig:
    """The knobs of the policy loss (mirrors ``train.*`` in the config)."""

    clip_eps: float = 0.2  # ratio clipped to [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: float | None = None  # None = clip_eps (symmetric)
    tis_cap: float | None = None  # truncated importance-sampling cap; None = off
    kl_coef: float = 0.0  # weight of the k3 KL to the reference; 0 = off
    naive: bool = False  # no clipping, no behaviour-policy correction (train.policy_loss = "naive")
    decoupled: bool = False  # ratio to the proximal policy, truncated behaviour weight (train.policy_loss = "decoupled")
    behaviour_weight_cap: float = 5.0  # the decoupled loss's cap on exp(proximal_logp - rollout_logp)
    # truncate: a weight above the cap counts as the cap (TIS); mask: its token gets no loss (AReaL's filter)
    behaviour_weight_mode: Literal["truncate", "mask"] = "truncate"

    def __post_init__(self) -> None:
        if self.naive and (self.tis_cap is not None or self.decoupled):
            raise ValueError("train.policy_loss 'naive' has no behaviour-policy correction: tis_cap must be unset")
        if self.decoupled and self.tis_cap is not None:
            raise ValueError("train.policy_loss 'decoupled' caps its weight with train.behaviour_weight_cap: "
                             "tis_cap must be unset")
        if self.behaviour_weight_mode not in ("truncate", "mask"):
            raise ValueError(f"train.behaviour_weight_mode must be truncate or mask, got {self.behaviour_weight_mode!r}")

    @property
    def weight_cap(self) -> float | None:
        """Cap of the truncated behaviour weight this loss applies; None: the loss applies none."""
        return self.behaviour_weight_cap if self.decoupled else self.tis_cap


@dataclass
class LossParts:
    """Loss of one micro-batch (a share of the step's token mean) and its metric sums."""

    loss: torch.Tensor  # scalar with grad: sum over this micro-batch's loss tokens / n_tokens
    sums: dict[str, float]  # token-summed metrics (divide by the step's loss tokens)


def policy_loss(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    n_tokens: int,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    proximal_logp: torch.Tensor | None = None,
) -> LossParts:
    """Policy-gradient loss of one micro-batch (``weights``: one staleness weight per sequence).

    ``clipped`` (no cap): the PPO ratio is taken against the behaviour policy,
    ``r = exp(logp - rollout_logp)``, and the per-token loss is ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)``.
    ``decoupled`` (or ``clipped`` with ``tis_cap``, the same objective, as slime's TIS): the ratio is
    taken against the proximal policy, ``r = exp(logp - proximal_logp)``, clipped alike, and the token
    loss is multiplied by the (gradient-free) truncated behaviour weight
    ``min(exp(proximal_logp - rollout_logp), cap)``; with ``behaviour_weight_mode`` ``mask`` a weight above
    the cap zeroes its token instead (AReaL's filter). ``proximal_logp`` None means ``logp`` detached: the
    first optimizer step of a batch, where the policy being stepped *is* the proximal one. With
    ``kl_coef`` > 0, ``kl_coef * k3`` is added.
    The naive loss (``cfg.naive``) treats every token as on-policy: ``-A * exp(logp - sg(logp))``,
    which is ``-A`` in value and ``-A * grad logp`` in gradient -- no ratio to the behaviour policy and
    no clipping, the loss under which staleness is expected to hurt. ``weights`` (``[B]``) multiply
    each sequence's token losses (KL included).
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(-1).expand_as(logp)
    cap = cfg.weight_cap
    proximal = proximal_logp if proximal_logp is not None else logp.detach()
    if cfg.naive:
        per_token = -torch.exp(logp - logp.detach()) * adv
        clipped = torch.zeros_like(logp)
    else:
        old = proximal if cap is not None else rollout_logp
        ratio = torch.exp(logp - old)
        high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
        clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + high)
        surr, surr_clipped = ratio * adv, clipped_ratio * adv
        per_token = -torch.minimum(surr, surr_clipped)
        clipped = (surr_clipped < surr).to(logp.dtype)
    sums: dict[str, float] = {}
    if cap is not None:
        weight = torch.exp(proximal - rollout_logp)
        weight = weight.clamp(max=cap) if cfg.behaviour_weight_mode == "truncate" else \
            torch.where(weight > cap, torch.zeros_like(weight), weight)
        per_token = per_token * weight
        sums["tis_weight"] = float((weight * mask).sum())
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (a reference model)")
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + cfg.kl_coef * kl
        sums["kl"] = float((kl.detach() * mask).sum())
    if weights is not None:
        w = weights.to(logp.dtype).unsqueeze(-1).expand_as(logp)
        per_token = per_token * w
        sums["staleness_weight"] = float((w * mask).sum())
    denom = max(int(n_tokens), 1)
    loss = (per_token * mask).sum() / denom
    sums["clip_frac"] = float((clipped * mask).sum())
    return LossParts(loss=loss, sums=sums)


@torch.no_grad()
def loglinear_proximal(logp: torch.Tensor, rollout_logp: torch.Tensor, gaps: torch.Tensor,
                       progress: float) -> torch.Tensor:
    """AReaL's log-linear approximation of the proximal log-probabilities, without a forward pass.

    A token sampled ``gap`` versions before the proximal policy (version ``v``) sits on a line of
    versions from its behaviour policy (``v - gap``) to the policy being stepped, which has moved
    ``progress`` of the way from ``v`` to ``v + 1`` (``u / U`` at the batch's ``u``-th of ``U`` optimizer
    steps). Interpolating the log-probability along that line, ``alpha = gap / (gap + progress)`` and
    ``proximal = rollout_logp + alpha * (logp - rollout_logp)``: a token of the proximal version itself
    (``gap`` 0) gets its behaviour log-probability, a very stale one nearly ``logp``. ``progress`` must be
    above 0 (at the first optimizer step the policy being stepped *is* the proximal one).
    """
    if progress <= 0:
        raise ValueError(f"progress must be above 0, got {progress}")
    g = gaps.to(logp.dtype).clamp(min=0)
    alpha = g / (g + progress)
    return rollout_logp + alpha * (logp.detach() - rollout_logp)


# --- off-policy diagnostics -------------------------------------------------------------------

OFFPOLICY_SUMS = ("logprob_abs_diff", "is_weight", "is_weight_sq", "is_truncated", "mismatch_kl")


@torch.no_grad()
def offpolicy_sums(proximal_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                   cap: float) -> dict[str, float]:
    """Sums over loss tokens of how far the behaviour policy is from the proximal one (``OFFPOLICY_SUMS``).

    With ``d = proximal_logp - rollout_logp`` and the importance weight ``w = exp(d)`` (untruncated):
    ``logprob_abs_diff`` = sum ``|d|``; ``is_weight`` / ``is_weight_sq`` = sum ``w`` / ``w**2`` (for the
    effective sample size, ``ess``); ``is_truncated`` = tokens with ``w > cap``; ``mismatch_kl`` = sum of
    the k3 estimator of KL(behaviour || proximal), ``w - d - 1``, unbiased under the behaviour samples the
    batch holds and never negative. Sums, so micro-batches and ranks add up; the weights in float64
    (``exp`` of a large gap overflows float32 long before it does float64).
    """
    on = mask > 0
    behaviour, proximal = rollout_logp[on].double(), proximal_logp[on].double()
    w = torch.exp(proximal - behaviour)
    return {"logprob_abs_diff": float(logprob_abs_diff_sum(proximal_logp, rollout_logp, mask)),
            "is_weight": float(w.sum()), "is_weight_sq": float((w * w).sum()), "is_truncated": float((w > cap).sum()),
            "mismatch_kl": float(kl_k3(behaviour, proximal).sum())}


def ess(weight_sum: float, weight_sq_sum: float, n: float) -> float:
    """Normalised effective sample size ``(sum w)^2 / (n sum w^2)`` of ``n`` importance weights, in (0, 1].

    1 when every weight is equal (on-policy data: every ``w`` = 1); ``1/n`` when one weight dominates,
    which is also what an overflowed sum means. No weights (``n`` = 0) count as 1.
    """
    if n <= 0:
        return 1.0
    if not math.isfinite(weight_sq_sum) or not math.isfinite(weight_sum):
        return 1.0 / n
    if weight_sq_sum <= 0:
        return 1.0
    return min(1.0, weight_sum * weight_sum / (n * weight_sq_sum))


def logprob_abs_diff_sum(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over loss tokens of ``|logp - rollout_logp|`` (divide by the loss tokens for the mean)."""
    return ((logp - rollout_logp).abs() * mask.to(logp.dtype)).sum()
