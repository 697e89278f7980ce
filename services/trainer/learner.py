"""The learner: policy model + optimizer + LR schedule; ``train_step(batches)`` is one trainer step.

No Redis and no files here: the loop feeds decoded batches in and writes checkpoints out.

One trainer step trains one batch (one published version per batch, as the loop counts them) in
``train.minibatches_per_batch × train.epochs_per_batch`` optimizer steps; the defaults (1 × 1) make it
exactly one. The batch's rows (GRPO advantages computed over whole groups first) are dealt to the
minibatches longest first (``batching.minibatches``); each minibatch is cut into micro-batches of at
most ``train.micro_batch_size`` rows, and at least ``train.grad_accum`` of them; each micro-batch runs
forward + backward and its gradient accumulates; then the gradient norm is clipped, the optimizer steps
once and the lr schedule advances once (it counts optimizer steps). How a minibatch is cut never
changes its gradient (token-level mean over the minibatch's loss tokens). Every epoch steps the same
minibatches in the same order, so a batch retrained after a crash is trained exactly as before.

Invariants:
* the *proximal* policy of a step is the weights before its first optimizer step. With one optimizer
  step the loss forward *is* that policy, so nothing extra runs (bit for bit the one-step trainer).
  With several, the proximal log-probabilities of minibatches 1.. are computed once, without gradient,
  before the first update, and minibatch 0's come from its own first forward (also before any update):
  one extra forward over (M − 1)/M of the batch, none per epoch;
* every pre-update quantity (``train/train_rollout_logprob_abs_diff`` (docs/architecture.md#logprob-diff),
  its ``_all`` form under the non-last-version mask, entropy, and the off-policy diagnostics of
  ``loss.offpolicy_sums``) is measured once per token on the proximal policy, whatever the loss, so arms
  with different losses or minibatch counts report comparable numbers; per-update quantities (loss,
  clip fraction, grad norm, TIS weight, KL) are averaged over the step's optimizer steps;
* the decoupled loss (and TIS) takes its ratio against those proximal log-probabilities; with
  ``train.proximal_logprobs: loglinear`` there is no proximal pass: minibatches 1.. (and every later epoch's
  minibatches but the first) estimate them from their own forward (``loss.loglinear_proximal``), and the
  batch's pre-update diagnostics of minibatch k come from its own first forward, k updates later. Under
  ``recompute`` the estimate is still computed beside the exact values, as ``train/proximal_approx_abs_err``;
* a gradient that is not finite skips its optimizer step (weights unchanged) and says so.

Under ``torchrun`` (``services.trainer.parallel``) rank 0's ``train_step`` deals each minibatch's rows to
every rank and each rank runs ``train_shards`` on its parts; every rank runs the same optimizer steps
over the same number of micro-batches (and proximal forwards), gradients are reduced by DDP / FSDP2 and
the metrics' sums by one all-reduce after every rank's last optimizer step of the trainer step.

``train.precision`` (``services.trainer.precision``) decides the dtype of the weights the optimizer
steps (the model is cast to it here) and whether forward and loss run in bf16; ``export`` casts the
published weights to ``train.checkpoint_dtype`` and keeps the fp32 master weights in the trainer
state when that cast loses bits.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel

from services.trainer.batching import Tensors, TrainRow, build_rows, collate, micro_batches, validate_batch
from services.trainer.faults import fault_point
from services.trainer.loss import (
    OFFPOLICY_SUMS,
    LossConfig,
    entropy_sum,
    ess,
    loglinear_proximal,
    logprob_abs_diff_sum,
    offpolicy_sums,
    policy_loss,
    staleness_weight,
    token_logprobs,
)
from services.trainer.parallel import Parallel, Shard, split_step
from services.trainer.precision import autocast, bf16_compute, cast_floating, weights_dtype
from shared.config import TrainConfig
from shared.modeling import parse_dtype
from shared.precision import checkpoint_dtype
from shared.schemas import Batch
from shared.toolcalls import tool_call_metrics

log = logging.getLogger(__name__)

SUM_KEYS = ("entropy", "clip_frac", "logprob_abs_diff_all", "kl", "tis_weight", "staleness_weight",
            "proximal_approx_abs_err", "proximal_approx_tokens", *OFFPOLICY_SUMS)  # reduced over ranks


@dataclass
class StepOutcome:
    """One trainer step on this rank, its sums reduced over every rank."""

    sums: dict[str, float]  # token sums (the loss: the sum of each optimizer step's token mean)
    grad_norms: list[float]  # one per optimizer step, before clipping
    clip_fracs: list[float]  # one per optimizer step: its clipped tokens / its loss tokens (all ranks)
    lr: float  # the learning rate of the last optimizer step
    skipped: int  # optimizer steps whose gradient was not finite (weights unchanged by them)


def _warmup(steps: int) -> Any:
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / (steps + 1)) if steps > 0 else 1.0

    return factor


class Learner:
    """Owns the trainable model and its optimizer state; ``step`` counts trainer steps (batches),
    ``optimizer_steps`` optimizer steps (and lr schedule steps)."""

    def __init__(self, model: PreTrainedModel, cfg: TrainConfig, pad_id: int,
                 ref_model: PreTrainedModel | None = None, parallel: Parallel | None = None) -> None:
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("train.kl_coef > 0 needs a reference model")
        self.model, self.cfg, self.pad_id, self.ref_model = model, cfg, pad_id, ref_model
        self.parallel = parallel or Parallel()
        master = weights_dtype(cfg.precision)
        if next(model.parameters()).dtype != master:  # e.g. a bf16 checkpoint trained with fp32 master weights
            torch.nn.Module.to(model, dtype=master)
        self.publish_dtype = parse_dtype(checkpoint_dtype(cfg.precision, cfg.checkpoint_dtype))
        self.keeps_master = self.publish_dtype != master  # the published weights lose bits: save the master too
        self.model.train()
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        # what forward runs on: the model, DDP, or sharded in place (FSDP2 then casts to bf16 itself)
        self.module = self.parallel.wrap(model, torch.bfloat16 if bf16_compute(cfg.precision) else None)
        if self.parallel.distributed:
            self.device = torch.device(self.parallel.device(cfg.device))
        self.autocast = partial(autocast, cfg.precision, self.device, self.parallel.sharded)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup(cfg.warmup_steps))
        self.loss_cfg = LossConfig(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, tis_cap=cfg.tis_cap,
                                   kl_coef=cfg.kl_coef, naive=cfg.policy_loss == "naive",
                                   decoupled=cfg.policy_loss == "decoupled",
                                   behaviour_weight_cap=cfg.behaviour_weight_cap,
                                   behaviour_weight_mode=cfg.behaviour_weight_mode)
        # the cap train/behaviour_weight_truncated_frac counts against: the loss's own, else behaviour_weight_cap
        self.diagnostic_cap = self.loss_cfg.weight_cap or cfg.behaviour_weight_cap
        self.weighted = cfg.staleness_weight != "off"  # soft staleness weights (loss.staleness_weight)
        several = cfg.minibatches_per_batch * cfg.epochs_per_batch > 1
        # the loss reads a proximal policy that differs from the one being stepped: the rows carry token gaps, for
        # loglinear_proximal (the estimate itself, or its error beside the recomputed one)
        self.proximal_gaps = several and self.loss_cfg.weight_cap is not None
        self.loglinear = self.proximal_gaps and cfg.proximal_logprobs == "loglinear"
        self.step = 0  # trainer steps: one per batch
        self.optimizer_steps = 0  # minibatches_per_batch × epochs_per_batch per trainer step

    @property
    def vocab_size(self) -> int:
        embeddings: Any = self.model.get_input_embeddings()
        return int(embeddings.weight.shape[0])

    @property
    def max_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def micro_batch_rows(self, n_rows: int) -> int:
        """Rows per forward: at most ``micro_batch_size``, and small enough for ``grad_accum`` chunks."""
        return max(1, min(self.cfg.micro_batch_size, math.ceil(n_rows / self.cfg.grad_accum)))

    def validate(self, batch: Batch) -> None:
        """Raise ``InvalidBatch`` if this model cannot train on ``batch``."""
        validate_batch(batch, self.vocab_size, self.max_len)

    def _ref_logprobs(self, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor | None:
        if self.ref_model is None or self.loss_cfg.kl_coef <= 0:
            return None
        with torch.no_grad(), self.autocast():
            logits = self.ref_model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
            return token_logprobs(logits, input_ids)

    def train_step(self, batches: Sequence[Batch], current_version: int | None = None) -> dict[str, float]:
        """One trainer step on ``batches`` (already validated): ``minibatches_per_batch × epochs_per_batch``
        optimizer steps; returns the step's metrics.

        ``current_version``: the version being trained (the newest checkpoint's); staleness weights
        measure each trajectory's gap from it (without it every trajectory weighs 1).
        """
        t0 = time.perf_counter()
        weigh = partial(staleness_weight, family=self.cfg.staleness_weight, lam=self.cfg.staleness_lambda)
        data = build_rows(batches, self.cfg.std_normalize, self.cfg.mask_nonlast_version_tokens,
                          current_version, weigh if self.weighted else None, with_gaps=self.proximal_gaps)
        n_tokens = data.loss_tokens
        plan = split_step(data.rows, self.parallel.world, self.cfg.minibatches_per_batch, self.micro_batch_rows)
        mine = self.parallel.command("step", plan).shards if self.parallel.distributed else plan[0]
        out = self.train_shards(mine)
        sums = out.sums
        seconds = max(time.perf_counter() - t0, 1e-9)
        denom = max(n_tokens, 1)
        per_update = denom * self.cfg.epochs_per_batch  # loss tokens over the step's optimizer steps
        rewards = torch.tensor(data.rewards or [0.0], dtype=torch.float64)
        metrics = {
            "train/loss": sums["loss"] / len(out.grad_norms),
            "train/grad_norm": sum(out.grad_norms) / len(out.grad_norms),
            "train/lr": out.lr,
            "train/entropy": sums["entropy"] / denom,
            "train/clip_frac": sums["clip_frac"] / per_update,
            "train/train_rollout_logprob_abs_diff": sums["logprob_abs_diff"] / denom,
            "train/reward_mean": float(rewards.mean()),
            "train/reward_std": float(rewards.std(unbiased=False)),
            "train/groups": float(data.n_groups),
            "train/samples": float(len(data.rows)),
            "train/micro_batches": float(sum(s.n_micro for s in mine)),
            "train/tokens": float(data.tokens),
            "train/loss_tokens": float(n_tokens),
            "train/tokens_per_s": data.tokens / seconds,
            "train/step_time_s": seconds,
            "train/skipped_nonfinite": float(out.skipped),
            # off-policy diagnostics: the behaviour policy against the proximal one (before the step's first update)
            "train/minibatches": float(len(mine)),
            "train/optimizer_steps": float(self.optimizer_steps),
            "train/ess": ess(sums["is_weight"], sums["is_weight_sq"], n_tokens),
            "train/behaviour_weight_truncated_frac": sums["is_truncated"] / denom,
            "train/mismatch_kl": sums["mismatch_kl"] / denom,
            "train/clip_frac_minibatch_mean": sum(out.clip_fracs) / len(out.clip_fracs),
            "train/clip_frac_minibatch_max": max(out.clip_fracs),
        }
        metrics.update({f"train/{k}": v for k, v in tool_call_metrics(
            s.meta for b in batches for g in b.groups for s in g.samples).items()})
        if self.loss_cfg.kl_coef > 0:
            metrics["train/kl"] = sums["kl"] / per_update
        if self.loss_cfg.weight_cap is not None:
            metrics["train/tis_weight_mean"] = sums["tis_weight"] / per_update
        if self.weighted:
            metrics["train/staleness_weight_mean"] = sums["staleness_weight"] / per_update
        if sums["proximal_approx_tokens"] > 0:  # recomputed: how far the log-linear estimate was from it
            metrics["train/proximal_approx_abs_err"] = sums["proximal_approx_abs_err"] / sums["proximal_approx_tokens"]
        if self.cfg.mask_nonlast_version_tokens:  # the diff above covers last-version tokens only
            metrics["train/train_rollout_logprob_abs_diff_all"] = sums["logprob_abs_diff_all"] / max(data.diff_tokens, 1)
        return metrics

    def train_shards(self, shards: Sequence[Shard]) -> StepOutcome:
        """This rank's part of one trainer step, one ``Shard`` per minibatch; sums over every rank.

        Several optimizer steps (more than one minibatch, or more than one epoch): the proximal
        log-probabilities of minibatches 1.. are computed first, without gradient, by the weights before any
        update; minibatch 0's come from its own first forward, which runs before any update too. Then every
        epoch steps the minibatches in order, each one optimizer step over its micro-batches.
        """
        several = len(shards) * self.cfg.epochs_per_batch > 1
        chunks = [self._chunks(s) for s in shards]
        proximal: list[list[torch.Tensor | None]] = [[None] * len(c) for c in chunks]
        sums: dict[str, float] = defaultdict(float)
        if several and not self.loglinear:
            for k in range(1, len(shards)):
                proximal[k] = [self._proximal(chunk, sums) for chunk in chunks[k]]
        scale = float(self.parallel.world)  # torch averages gradients over ranks; the loss is a global sum
        norms: list[float] = []
        clipped: list[float] = []  # this rank's clipped tokens, per optimizer step
        lr, skipped = 0.0, 0
        updates = [(epoch, k) for epoch in range(self.cfg.epochs_per_batch) for k in range(len(shards))]
        for u, (epoch, k) in enumerate(updates):
            # this forward gives the batch's diagnostics: the policy before the step's first update, or under
            # loglinear (no proximal pass) each minibatch's first forward, k updates later
            first = epoch == 0 and (k == 0 or self.loglinear)
            progress = u / len(updates)  # how far the policy being stepped has moved towards the next version
            self.optimizer.zero_grad(set_to_none=True)
            clipped.append(0.0)
            for c, chunk in enumerate(chunks[k]):
                with self.parallel.no_sync(self.module, skip=c < len(chunks[k]) - 1):
                    if not chunk:
                        self._zero_backward()
                        continue
                    t = collate(chunk, self.pad_id, self.device)
                    with self.autocast():  # backward runs outside: it follows the dtypes the forward chose
                        logits = self.module(input_ids=t.input_ids, attention_mask=t.attention_mask,
                                             use_cache=False).logits
                        logp = token_logprobs(logits, t.input_ids)
                        prox = proximal[k][c]
                        # loglinear: the estimate stands in for the proximal pass; recomputed: it is measured
                        # against the exact values, once per token (the first epoch's minibatches 1..)
                        wanted = prox is None or (epoch == 0 and k > 0)
                        if self.proximal_gaps and u > 0 and t.gaps is not None and wanted:
                            estimate = loglinear_proximal(logp, t.rollout_logp, t.gaps, progress)
                            if prox is None:
                                prox = estimate
                            else:
                                sums["proximal_approx_abs_err"] += float(((estimate - prox).abs() * t.mask).sum())
                                sums["proximal_approx_tokens"] += float(t.mask.sum())
                        parts = policy_loss(logp, t.rollout_logp, t.advantages, t.mask, shards[k].loss_tokens,
                                            self.loss_cfg, self._ref_logprobs(t.input_ids, t.attention_mask),
                                            t.weights if self.weighted else None, prox)
                    if first:
                        self._diagnose(logits.detach(), logp.detach(), t, sums)
                        if k == 0 and self.cfg.epochs_per_batch > 1:
                            proximal[k][c] = logp.detach()  # minibatch 0's proximal policy, for the later epochs
                    del logits
                    if not self.parallel.is_leader:
                        fault_point("follower_mid_step")  # crash tests: a rank dies with the step half done
                    (parts.loss * scale if scale != 1 else parts.loss).backward()
                    sums["loss"] += float(parts.loss.detach())
                    for key, v in parts.sums.items():
                        sums[key] += v
                    clipped[-1] += parts.sums["clip_frac"]
            grad_norm, lr, skip = self._optimizer_step()
            norms.append(grad_norm)
            skipped += int(skip)
            if u < len(updates) - 1 and self.parallel.is_leader:
                fault_point("between_minibatches")  # crash tests: killed with the batch half trained
        self.step += 1
        if self.parallel.distributed:  # entered by each rank after its optimizer steps: the step is done everywhere
            keys = ("loss", *SUM_KEYS)
            reduced = self.parallel.all_reduce_sum([sums[key] for key in keys] + clipped, self.device)
            sums = defaultdict(float, zip(keys, reduced[: len(keys)], strict=True))
            clipped = reduced[len(keys):]
        fracs = [n / max(shards[k].loss_tokens, 1) for n, (_, k) in zip(clipped, updates, strict=True)]
        return StepOutcome(sums, norms, fracs, lr, skipped)

    def _chunks(self, shard: Shard) -> list[list[TrainRow]]:
        """The micro-batches of one minibatch on this rank, padded with empty ones to the common count."""
        chunks: list[list[TrainRow]] = micro_batches(shard.rows, shard.micro_rows) if shard.rows else []
        return chunks + [[] for _ in range(shard.n_micro - len(chunks))]  # zero-weight: collectives pair up

    @torch.no_grad()
    def _proximal(self, chunk: list[TrainRow], sums: dict[str, float]) -> torch.Tensor | None:
        """Log-probabilities of one micro-batch under the weights as they are (no gradient), and its diagnostics;
        an empty micro-batch runs a forward all the same (FSDP2 gathers and DDP buffer syncs pair up)."""
        if not chunk:
            ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
            with self.autocast():
                self.module(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            return None
        t = collate(chunk, self.pad_id, self.device)
        with self.autocast():
            logits = self.module(input_ids=t.input_ids, attention_mask=t.attention_mask, use_cache=False).logits
            logp = token_logprobs(logits, t.input_ids)
        self._diagnose(logits, logp, t, sums)
        return logp

    def _diagnose(self, logits: torch.Tensor, logp: torch.Tensor, t: Tensors, sums: dict[str, float]) -> None:
        """Add one micro-batch's pre-update sums: entropy, logprob diffs, behaviour-vs-proximal weights."""
        sums["entropy"] += entropy_sum(logits, t.mask)
        if t.diff_mask is not None:  # the version mask is on: the diff over every response token too
            sums["logprob_abs_diff_all"] += float(logprob_abs_diff_sum(logp, t.rollout_logp, t.diff_mask))
        for key, v in offpolicy_sums(logp, t.rollout_logp, t.mask, self.diagnostic_cap).items():
            sums[key] += v

    def _optimizer_step(self) -> tuple[float, float, bool]:
        """Clip and apply the accumulated gradient (skipped when not finite); (grad norm, lr used, skipped)."""
        norm: Any = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("non-finite grad norm at step=%d optimizer_step=%d: update skipped", self.step + 1,
                        self.optimizer_steps + 1)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self.scheduler.step()  # the schedule counts optimizer steps
        self.optimizer_steps += 1
        return grad_norm, lr, skipped

    def _zero_backward(self) -> None:
        """A micro-batch with no rows on this rank: a forward + zero-gradient backward that joins the collectives."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        with self.autocast():
            logits = self.module(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    def export(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(full weights to publish, or None = save ``self.model`` as is; ``state_dict()``) — a collective on
        every rank. The weights are in ``train.checkpoint_dtype``; the state holds the master weights when
        that cast loses bits."""
        if self.parallel.distributed and self.parallel.is_leader:
            self.parallel.command("export")
        weights, optim = self.parallel.full_state(self.model, self.optimizer)
        state = {"optimizer": optim, "scheduler": self.scheduler.state_dict(), "step": self.step,
                 "optimizer_steps": self.optimizer_steps}
        if not self.keeps_master or not self.parallel.is_leader:  # the other ranks' copy is dropped
            return weights, state
        master = weights if weights is not None else self.model.state_dict()
        return cast_floating(master, self.publish_dtype), {**state, "master_weights": master}

    def idle(self) -> None:
        """Rank 0 found no batch: tell the other ranks (their collectives never wait past a timeout)."""
        if self.parallel.distributed:
            self.parallel.command("idle")

    def close(self) -> None:
        """Rank 0 stops: the other ranks stop too, then the process group is left."""
        if self.parallel.distributed:
            self.parallel.command("stop")
            self.parallel.close()

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler and step (the model weights are saved in HF layout separately; the master
        weights too when the published ones lose bits)."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "step": self.step, "optimizer_steps": self.optimizer_steps}
        return {**state, "master_weights": self.model.state_dict()} if self.keeps_master else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``/``export()``'s state (master weights first, when it holds them)."""
        if "master_weights" in state:  # the checkpoint's HF weights were rounded for the engines
            master = cast_floating(state["master_weights"], weights_dtype(self.cfg.precision))
            self.parallel.load_weights(self.model, master)
        self.parallel.load_optimizer(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.optimizer_steps = int(state.get("optimizer_steps", self.step))  # older states: one per step
