"""Several optimizer steps per batch (train.minibatches_per_batch, epochs_per_batch) in the learner, no Redis."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trainer_factory import SMALL_SPEC, VOCAB, batch

from services.trainer import learner as learner_module
from services.trainer.batching import build_rows, micro_batches, minibatches
from services.trainer.learner import Learner
from services.trainer.loss import token_logprobs
from services.trainer.parallel import Shard
from shared.config import TrainConfig
from shared.modeling import build_model

torch.set_num_threads(1)


def tiny_learner(**cfg: Any) -> Learner:
    model = build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0)
    return Learner(model, TrainConfig(**{"micro_batch_size": 3, "lr": 1e-2, **cfg}), pad_id=0)


def params(learner: Learner) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in learner.model.parameters()])


def two_steps(learner: Learner) -> dict[str, float]:
    first = learner.train_step([batch("b1"), batch("b2")], current_version=2)
    learner.train_step([batch("b3", version="1")], current_version=2)
    return first


# Recorded from the trainer before minibatches existed (one optimizer step per batch, same batches and model).
PINNED = {
    "clipped": ({"train/loss": 0.2759935394860804, "train/grad_norm": 0.15913145244121552,
                 "train/entropy": 4.596116840839386, "train/clip_frac": 0.5,
                 "train/train_rollout_logprob_abs_diff": 2.454186826944351}, 123.97797030615038, 378.73742319623125),
    "tis": ({"train/loss": -0.022502324543893337, "train/grad_norm": 0.18868188560009003,
             "train/entropy": 4.596116840839386, "train/clip_frac": 0.0,
             "train/train_rollout_logprob_abs_diff": 2.454186826944351}, 125.22433494093275, 377.58671505613165),
}


@pytest.mark.parametrize("loss", ["clipped", "tis"])
def test_the_defaults_give_the_numbers_of_the_one_step_trainer(loss: str) -> None:
    expected, param_sum, param_abs = PINNED[loss]
    learner = tiny_learner(**({"tis_cap": 2.0} if loss == "tis" else {}))
    metrics = two_steps(learner)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    p = params(learner).double()
    assert float(p.sum()) == pytest.approx(param_sum, rel=1e-6) and float(p.abs().sum()) == pytest.approx(param_abs, rel=1e-6)
    assert learner.optimizer_steps == learner.step == 2 and metrics["train/minibatches"] == 1


def test_one_minibatch_one_epoch_is_bit_for_bit_the_default_and_decoupled_is_tis_there() -> None:
    default, explicit = tiny_learner(), tiny_learner(minibatches_per_batch=1, epochs_per_batch=1)
    md, me = two_steps(default), two_steps(explicit)
    timings = ("train/tokens_per_s", "train/step_time_s")
    assert {k: v for k, v in md.items() if k not in timings} == {k: v for k, v in me.items() if k not in timings}
    assert torch.equal(params(default), params(explicit))
    decoupled, tis = tiny_learner(policy_loss="decoupled", behaviour_weight_cap=2.0), tiny_learner(tis_cap=2.0)
    md, mt = two_steps(decoupled), two_steps(tis)
    assert torch.equal(params(decoupled), params(tis)) and md["train/loss"] == mt["train/loss"]


def test_minibatches_partition_the_rows_longest_first_and_balanced() -> None:
    rows = build_rows([batch("b1", n_groups=3)], True, False).rows  # 12 rows
    for i in range(0, 12, 3):  # make lengths differ
        rows[i] = rows[i].__class__(rows[i].token_ids[:4], rows[i].mask[:4], rows[i].rollout_logprobs[:4], 0.5)
    parts = minibatches(rows, 4)
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    assert sorted(id(r) for p in parts for r in p) == sorted(map(id, rows))  # a partition
    assert [sum(len(r.token_ids) for r in p) for p in parts] == [sum(len(r.token_ids) for r in parts[0])] * 4
    assert [[r.token_ids for r in p] for p in minibatches(rows, 4)] == [[r.token_ids for r in p] for p in parts]
    assert len(minibatches(rows, 64)) == 12 and minibatches(rows, 1) == [sorted(rows, key=lambda r: -len(r.token_ids))]


def test_each_minibatch_is_one_optimizer_step_on_its_own_token_mean() -> None:
    # The clipped loss needs no proximal policy: M = 3 on a batch is three one-minibatch steps in a row.
    together, apart = tiny_learner(minibatches_per_batch=3), tiny_learner()
    b = batch("b1", n_groups=3)
    metrics = together.train_step([b])
    for mb in minibatches(build_rows([b], True, False).rows, 3):
        rows_per = apart.micro_batch_rows(len(mb))
        apart.train_shards([Shard(mb, sum(sum(r.mask) for r in mb), len(micro_batches(mb, rows_per)), rows_per)])
    assert torch.equal(params(together), params(apart))
    assert together.step == 1 and together.optimizer_steps == 3 and metrics["train/optimizer_steps"] == 3


def test_the_proximal_policy_is_the_weights_before_the_first_update(monkeypatch: pytest.MonkeyPatch) -> None:
    learner = tiny_learner(minibatches_per_batch=3, epochs_per_batch=2, policy_loss="decoupled")
    before = build_model(SMALL_SPEC, VOCAB, 0, 2, seed=0).eval()  # the same initial weights
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real = learner_module.policy_loss

    def spy(logp: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *args: Any) -> Any:
        proximal = args[-1]
        seen.append((logp.detach() if proximal is None else proximal, mask, logp.detach()))
        return real(logp, rollout, adv, mask, *args)

    monkeypatch.setattr(learner_module, "policy_loss", spy)
    inputs: list[torch.Tensor] = []
    real_collate = learner_module.collate

    def collate(*args: Any) -> Any:
        t = real_collate(*args)
        inputs.append(t.input_ids)
        return t

    monkeypatch.setattr(learner_module, "collate", collate)
    learner.train_step([batch("b1", n_groups=3)])
    loss_inputs = inputs[-len(seen):]  # the proximal pass collates first, then every loss forward
    assert len(seen) == 3 * 2 * 2  # minibatches x epochs x micro-batches (4 rows each, 3 per micro-batch)
    with torch.no_grad():
        for (proximal, mask, _), ids in zip(seen, loss_inputs, strict=True):
            expected = token_logprobs(before(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids)
            torch.testing.assert_close(proximal * mask, expected * mask, rtol=1e-5, atol=1e-5)
    assert any(not torch.allclose(c * m, p * m, atol=1e-4) for p, m, c in seen[2:])  # later steps moved the weights


def test_pre_update_diagnostics_do_not_depend_on_the_minibatch_count() -> None:
    one, four = tiny_learner(), tiny_learner(minibatches_per_batch=4, policy_loss="decoupled")
    m1, m4 = one.train_step([batch("b1"), batch("b2")]), four.train_step([batch("b1"), batch("b2")])
    for key in ("train/entropy", "train/train_rollout_logprob_abs_diff", "train/ess", "train/mismatch_kl",
                "train/behaviour_weight_truncated_frac"):
        assert m4[key] == pytest.approx(m1[key], rel=1e-5), key
    assert 0 < m4["train/ess"] <= 1 and m4["train/mismatch_kl"] > 0
    assert m4["train/minibatches"] == 4 and m4["train/clip_frac_minibatch_max"] >= m4["train/clip_frac_minibatch_mean"]


def test_the_decoupled_loss_clips_only_after_the_first_update() -> None:
    learner = tiny_learner(epochs_per_batch=3, policy_loss="decoupled", lr=0.1)
    first = learner.train_shards([_whole(learner, batch("b1"))])
    assert first.clip_fracs[0] == 0.0 and max(first.clip_fracs[1:]) > 0  # ratio 1 until the weights move
    assert len(first.grad_norms) == 3


def _whole(learner: Learner, b: Any) -> Shard:
    rows = build_rows([b], True, False).rows
    rows_per = learner.micro_batch_rows(len(rows))
    return Shard(rows, sum(sum(r.mask) for r in rows), len(micro_batches(rows, rows_per)), rows_per)


def test_the_lr_schedule_and_the_counters_advance_per_optimizer_step() -> None:
    learner = tiny_learner(minibatches_per_batch=4, warmup_steps=8)
    metrics = learner.train_step([batch("b1"), batch("b2")])
    assert (learner.step, learner.optimizer_steps, learner.scheduler.last_epoch) == (1, 4, 4)
    assert metrics["train/lr"] == pytest.approx(1e-2 * 4 / 9)  # the fourth optimizer step's warmup factor
    again = tiny_learner(minibatches_per_batch=4, warmup_steps=8)
    again.load_state_dict(learner.state_dict())
    assert (again.step, again.optimizer_steps) == (1, 4)
    assert again.scheduler.get_last_lr() == learner.scheduler.get_last_lr()


def test_bf16_mixed_trains_minibatches_over_fp32_master_weights() -> None:
    learner = tiny_learner(minibatches_per_batch=2, epochs_per_batch=2, policy_loss="decoupled",
                           precision="bf16-mixed")
    before = params(learner)
    metrics = learner.train_step([batch("b1"), batch("b2")])
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    assert not torch.equal(before, params(learner)) and learner.optimizer_steps == 4
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert 0 < metrics["train/ess"] <= 1
