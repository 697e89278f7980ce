"""How off-policy a run's training data was, from the trainer's per-step diagnostics (pure: metric rows in).

The trainer reports, per step, how far the behaviour policy (the engine that sampled each token) is
from the proximal one (the weights before the step's first optimizer step), over the step's loss
tokens (docs/metrics.md, "Off-policy diagnostics"):

* ``train/ess``: normalised effective sample size of the importance weights
  ``w = exp(logp_prox - logp_behaviour)``, ``(sum w)^2 / (n sum w^2)`` in (0, 1]; 1 on-policy;
* ``train/behaviour_weight_truncated_frac``: share of those weights above the cap;
* ``train/clip_frac_minibatch_mean`` / ``_max``: the PPO clip fraction of each of the step's optimizer
  steps, averaged / maximised over them;
* ``train/mismatch_kl``: the k3 estimate of KL(behaviour || proximal);
* ``train/proximal_approx_abs_err``: how far AReaL's log-linear estimate of the proximal log-probabilities
  is from the recomputed ones (only under ``train.proximal_logprobs: recompute`` with several optimizer
  steps and a loss that reads the proximal policy).

Per run (a row of ``summary.csv``, lines of ``dressage report``), each is the mean over the steps that
report it, and ``ess_min`` the lowest step: a collapse shows as a low minimum before it shows in the mean.
Runs from before the diagnostics existed have none: every column is empty, every line "-".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tools.reports.series import Row, number, trainer_rows

ESS = "train/ess"
TRUNCATED = "train/behaviour_weight_truncated_frac"
CLIP_MB_MEAN = "train/clip_frac_minibatch_mean"
CLIP_MB_MAX = "train/clip_frac_minibatch_max"
MISMATCH_KL = "train/mismatch_kl"
APPROX_ERR = "train/proximal_approx_abs_err"
COLUMNS = ("ess_mean", "ess_min", "truncated_frac_mean", "clip_frac_mb_mean", "clip_frac_mb_max", "mismatch_kl_mean",
           "prox_approx_err_mean")


@dataclass(frozen=True)
class OffPolicy:
    steps: int = 0  # trainer steps that report the diagnostics
    ess_mean: float | None = None
    ess_min: float | None = None
    truncated_frac: float | None = None
    clip_frac_mb_mean: float | None = None  # mean over steps of the step's mean over its optimizer steps
    clip_frac_mb_max: float | None = None  # mean over steps of the step's max over its optimizer steps
    mismatch_kl: float | None = None
    approx_err: float | None = None  # log-linear estimate vs recomputed proximal logprobs, nats per token

    def columns(self) -> dict[str, float | None]:
        return dict(zip(COLUMNS, (self.ess_mean, self.ess_min, self.truncated_frac, self.clip_frac_mb_mean,
                                  self.clip_frac_mb_max, self.mismatch_kl, self.approx_err), strict=True))


def split(rows: Sequence[Row]) -> OffPolicy:
    trainer = trainer_rows(rows)
    seen = {name: [v for v in (number(r.get(name)) for r in trainer) if v is not None]
            for name in (ESS, TRUNCATED, CLIP_MB_MEAN, CLIP_MB_MAX, MISMATCH_KL, APPROX_ERR)}
    mean = {name: sum(vs) / len(vs) if vs else None for name, vs in seen.items()}
    return OffPolicy(steps=len(seen[ESS]), ess_mean=mean[ESS], ess_min=min(seen[ESS], default=None),
                     truncated_frac=mean[TRUNCATED], clip_frac_mb_mean=mean[CLIP_MB_MEAN],
                     clip_frac_mb_max=mean[CLIP_MB_MAX], mismatch_kl=mean[MISMATCH_KL], approx_err=mean[APPROX_ERR])


def summary_pairs(s: OffPolicy) -> list[tuple[str, str]]:
    """Lines for ``dressage report``."""
    def f(v: float | None, digits: int = 3) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    return [("ESS of the behaviour weights (normalised): mean / lowest step", f"{f(s.ess_mean)} / {f(s.ess_min)}"),
            ("behaviour weights above the cap (share of loss tokens), mean", f(s.truncated_frac, 4)),
            ("clip fraction per optimizer step: mean / max within a step (mean over steps)",
             f"{f(s.clip_frac_mb_mean)} / {f(s.clip_frac_mb_max)}"),
            ("mismatch KL(behaviour || proximal), k3, mean", f(s.mismatch_kl, 4)),
            ("log-linear proximal estimate's error (nats per token), mean", f(s.approx_err, 4))]
