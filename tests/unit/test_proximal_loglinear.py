"""train.proximal_logprobs: the recomputed proximal policy against AReaL's log-linear estimate, no Redis."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError
from trainer_factory import SMALL_SPEC, VOCAB, batch

from services.trainer import learner as learner_module
from services.trainer.batching import build_rows, token_gaps
from services.trainer.learner import Learner
from services.trainer.loss import loglinear_proximal
from shared.config import TrainConfig
from shared.modeling import build_model

torch.set_num_threads(1)


def tiny_learner(**cfg: Any) -> Learner:
    model = build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0)
    return Learner(model, TrainConfig(**{"micro_batch_size": 3, "lr": 1e-2, **cfg}), pad_id=0)


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor([values])


def test_the_estimate_interpolates_by_version_gap_and_progress() -> None:
    logp, behaviour = t([-1.0, -1.0, -1.0, -1.0]), t([-3.0, -3.0, -3.0, -3.0])
    out = loglinear_proximal(logp, behaviour, t([0.0, 1.0, 8.0, -2.0]), progress=0.5)
    # gap 0: the behaviour policy is the proximal one; gap 1: alpha 1/1.5; gap 8: 8/8.5; a negative gap counts as 0
    expected = [-3.0, -3.0 + 2.0 * (1 / 1.5), -3.0 + 2.0 * (8 / 8.5), -3.0]
    torch.testing.assert_close(out, t(expected))
    assert not out.requires_grad
    nearly_done = loglinear_proximal(logp, behaviour, t([2.0, 2.0, 2.0, 2.0]), progress=0.75)
    torch.testing.assert_close(nearly_done, t([-3.0 + 2.0 * (2 / 2.75)] * 4))
    with pytest.raises(ValueError, match="progress"):
        loglinear_proximal(logp, behaviour, t([1.0] * 4), progress=0.0)


def test_token_gaps_count_versions_behind_and_zero_for_labels_without_a_number() -> None:
    assert token_gaps(["-1", "3", "5", "v2", "7", " 4 "], 5) == [0, 2, 0, 0, 0, 1]
    assert token_gaps(["-1", "3"], None) == [0, 0]
    rows = build_rows([batch("b1", version="1")], True, False, current_version=4, with_gaps=True).rows
    assert all(set(r.gaps or []) <= {0, 3} and 3 in (r.gaps or []) for r in rows)
    assert build_rows([batch("b1")], True, False, current_version=4).rows[0].gaps is None


def count_forwards(learner: Learner) -> list[int]:
    calls = [0]
    learner.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_loglinear_runs_no_proximal_pass() -> None:
    recompute = tiny_learner(minibatches_per_batch=3, policy_loss="decoupled")
    loglinear = tiny_learner(minibatches_per_batch=3, policy_loss="decoupled", proximal_logprobs="loglinear")
    counts = count_forwards(recompute), count_forwards(loglinear)
    b = batch("b1", n_groups=3, version="0")  # 12 rows: 3 minibatches of 4, 2 micro-batches each
    m_re, m_ll = recompute.train_step([b], current_version=3), loglinear.train_step([b], current_version=3)
    assert counts[0][0] == 2 * 2 + 3 * 2 and counts[1][0] == 3 * 2  # the proximal pass covers minibatches 1 and 2
    assert recompute.optimizer_steps == loglinear.optimizer_steps == 3
    err = m_re["train/proximal_approx_abs_err"]
    assert err > 0 and torch.isfinite(torch.tensor(err)) and "train/proximal_approx_abs_err" not in m_ll
    for key in ("train/ess", "train/mismatch_kl", "train/entropy", "train/train_rollout_logprob_abs_diff"):
        assert torch.isfinite(torch.tensor(m_ll[key])), key


def test_the_loss_gets_the_estimate_after_the_first_update(monkeypatch: pytest.MonkeyPatch) -> None:
    learner = tiny_learner(minibatches_per_batch=3, epochs_per_batch=2, policy_loss="decoupled",
                           proximal_logprobs="loglinear")
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    real = learner_module.policy_loss

    def spy(logp: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *args: Any) -> Any:
        seen.append((logp.detach(), rollout, mask, args[-1]))
        return real(logp, rollout, adv, mask, *args)

    monkeypatch.setattr(learner_module, "policy_loss", spy)
    learner.train_step([batch("b1", n_groups=3, version="1")], current_version=5)  # every reply token 4 behind
    assert len(seen) == 3 * 2 * 2  # minibatches x epochs x micro-batches
    first_epoch_mb0 = seen[0:2]
    assert all(prox is None for *_, prox in first_epoch_mb0)  # the policy being stepped is the proximal one
    for u, i in ((1, 2), (2, 4), (4, 8), (5, 10)):  # minibatches 1 and 2 of each epoch: estimated at progress u/6
        logp, rollout, mask, prox = seen[i]
        assert prox is not None
        alpha = 4 / (4 + u / 6)
        torch.testing.assert_close(prox * mask, (rollout + alpha * (logp - rollout)) * mask)
    assert all(prox is not None for *_, prox in seen[6:8])  # epoch 2, minibatch 0: its exact first-epoch values


def test_fresh_tokens_get_their_behaviour_logprobs_as_proximal(monkeypatch: pytest.MonkeyPatch) -> None:
    learner = tiny_learner(minibatches_per_batch=2, policy_loss="decoupled", proximal_logprobs="loglinear")
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    real = learner_module.policy_loss

    def spy(logp: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *args: Any) -> Any:
        seen.append((rollout, mask, args[-1]))
        return real(logp, rollout, adv, mask, *args)

    monkeypatch.setattr(learner_module, "policy_loss", spy)
    learner.train_step([batch("b1", version="3")], current_version=3)
    later = [(r, m, p) for r, m, p in seen if p is not None]
    assert later and all(torch.equal(p * m, r * m) for r, m, p in later)


def test_loglinear_needs_a_loss_that_reads_a_proximal_policy() -> None:
    with pytest.raises(ValidationError, match="train.proximal_logprobs"):
        TrainConfig(proximal_logprobs="loglinear")
    with pytest.raises(ValidationError, match="proximal_logprobs"):
        TrainConfig(proximal_logprobs="exact")  # type: ignore[arg-type]  # a value the Literal refuses
    assert TrainConfig(proximal_logprobs="loglinear", tis_cap=2.0).proximal_logprobs == "loglinear"
    one_step = tiny_learner(policy_loss="decoupled", proximal_logprobs="loglinear")
    assert "train/proximal_approx_abs_err" not in one_step.train_step([batch("b1")], current_version=1)
