"""The learner: policy model + optimizer + LR schedule; ``train_step(batches)`` is one optimizer step.

No Redis and no files here: the loop feeds decoded batches in and writes checkpoints out.

One step: rows of every batch → micro-batches of at most ``train.micro_batch_size`` rows, and at
least ``train.grad_accum`` of them; each micro-batch runs forward + backward and its gradient
accumulates; then the gradient norm is clipped and the optimizer steps once. How a step is cut
never changes its gradient (token-level mean over the whole step). Because the weights only change at that single ``optimizer.step()``, the
logprobs every micro-batch computes are the current policy *before* the update: they give
``train/train_rollout_logprob_abs_diff`` (docs/architecture.md#logprob-diff) and the proximal policy of TIS without a
second forward pass. Under the non-last-version loss mask that diff covers the trained (last-version)
tokens only, so ``train/train_rollout_logprob_abs_diff_all`` also reports it over every response token,
the set the diff covers without the mask. A step whose gradient is not finite is skipped (weights
unchanged) and says so.

Under ``torchrun`` (``services.trainer.parallel``) rank 0's ``train_step`` deals the step's rows to
every rank and each rank runs ``train_shard`` on its part; gradients are reduced by DDP / FSDP2 and
the metrics' sums by one all-reduce after every rank's optimizer step.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel

from services.trainer.batching import build_rows, collate, micro_batches, validate_batch
from services.trainer.faults import fault_point
from services.trainer.loss import (
    LossConfig,
    entropy_sum,
    logprob_abs_diff_sum,
    policy_loss,
    staleness_weight,
    token_logprobs,
)
from services.trainer.parallel import Parallel, Shard, split_rows
from shared.config import TrainConfig
from shared.schemas import Batch
from shared.toolcalls import tool_call_metrics

log = logging.getLogger(__name__)

SUM_KEYS = ("entropy", "clip_frac", "logprob_abs_diff", "logprob_abs_diff_all", "kl", "tis_weight",
            "staleness_weight")  # reduced over ranks


def _warmup(steps: int) -> Any:
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / (steps + 1)) if steps > 0 else 1.0

    return factor


class Learner:
    """Owns the trainable model and its optimizer state; ``step`` counts optimizer steps."""

    def __init__(self, model: PreTrainedModel, cfg: TrainConfig, pad_id: int,
                 ref_model: PreTrainedModel | None = None, parallel: Parallel | None = None) -> None:
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("train.kl_coef > 0 needs a reference model")
        self.model, self.cfg, self.pad_id, self.ref_model = model, cfg, pad_id, ref_model
        self.parallel = parallel or Parallel()
        self.model.train()
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        self.module = self.parallel.wrap(model)  # what forward runs on: the model, DDP, or sharded in place
        if self.parallel.distributed:
            self.device = torch.device(self.parallel.device(cfg.device))
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup(cfg.warmup_steps))
        self.loss_cfg = LossConfig(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                                   tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef, naive=cfg.policy_loss == "naive")
        self.weighted = cfg.staleness_weight != "off"  # soft staleness weights (loss.staleness_weight)
        self.step = 0

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
        with torch.no_grad():
            logits = self.ref_model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
            return token_logprobs(logits, input_ids)

    def train_step(self, batches: Sequence[Batch], current_version: int | None = None) -> dict[str, float]:
        """One optimizer step on ``batches`` (already validated); returns the step's metrics.

        ``current_version``: the version being trained (the newest checkpoint's); staleness weights
        measure each trajectory's gap from it (without it every trajectory weighs 1).
        """
        t0 = time.perf_counter()
        weigh = partial(staleness_weight, family=self.cfg.staleness_weight, lam=self.cfg.staleness_lambda)
        data = build_rows(batches, self.cfg.std_normalize, self.cfg.mask_nonlast_version_tokens,
                          current_version, weigh if self.weighted else None)
        n_tokens = data.loss_tokens
        if self.parallel.distributed:
            shard = self.parallel.command("step", split_rows(data.rows, self.parallel.world,
                                                             self.micro_batch_rows)).shard
            assert shard is not None
        else:
            rows_per = self.micro_batch_rows(len(data.rows))
            shard = Shard(data.rows, n_tokens, len(micro_batches(data.rows, rows_per)), rows_per)
        sums, grad_norm, lr, skipped = self.train_shard(shard)
        seconds = max(time.perf_counter() - t0, 1e-9)
        denom = max(n_tokens, 1)
        rewards = torch.tensor(data.rewards or [0.0], dtype=torch.float64)
        metrics = {
            "train/loss": sums["loss"],
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/entropy": sums["entropy"] / denom,
            "train/clip_frac": sums["clip_frac"] / denom,
            "train/train_rollout_logprob_abs_diff": sums["logprob_abs_diff"] / denom,
            "train/reward_mean": float(rewards.mean()),
            "train/reward_std": float(rewards.std(unbiased=False)),
            "train/groups": float(data.n_groups),
            "train/samples": float(len(data.rows)),
            "train/micro_batches": float(shard.n_micro),
            "train/tokens": float(data.tokens),
            "train/loss_tokens": float(n_tokens),
            "train/tokens_per_s": data.tokens / seconds,
            "train/step_time_s": seconds,
            "train/skipped_nonfinite": float(skipped),
        }
        metrics.update({f"train/{k}": v for k, v in tool_call_metrics(
            s.meta for b in batches for g in b.groups for s in g.samples).items()})
        if self.loss_cfg.kl_coef > 0:
            metrics["train/kl"] = sums["kl"] / denom
        if self.loss_cfg.tis_cap is not None:
            metrics["train/tis_weight_mean"] = sums["tis_weight"] / denom
        if self.weighted:
            metrics["train/staleness_weight_mean"] = sums["staleness_weight"] / denom
        if self.cfg.mask_nonlast_version_tokens:  # the diff above covers last-version tokens only
            metrics["train/train_rollout_logprob_abs_diff_all"] = sums["logprob_abs_diff_all"] / max(data.diff_tokens, 1)
        return metrics

    def train_shard(self, shard: Shard) -> tuple[dict[str, float], float, float, bool]:
        """Forward/backward this rank's rows, clip, step; (sums over every rank, grad norm, lr, skipped)."""
        sums: dict[str, float] = defaultdict(float)
        self.optimizer.zero_grad(set_to_none=True)
        chunks: list[list[Any]] = micro_batches(shard.rows, shard.micro_rows) if shard.rows else []
        chunks += [[] for _ in range(shard.n_micro - len(chunks))]  # zero-weight: collectives pair up
        scale = float(self.parallel.world)  # torch averages gradients over ranks; the loss is a global sum
        for i, chunk in enumerate(chunks):
            with self.parallel.no_sync(self.module, skip=i < len(chunks) - 1):
                if not chunk:
                    self._zero_backward()
                    continue
                t = collate(chunk, self.pad_id, self.device)
                logits = self.module(input_ids=t.input_ids, attention_mask=t.attention_mask, use_cache=False).logits
                logp = token_logprobs(logits, t.input_ids)
                parts = policy_loss(logp, t.rollout_logp, t.advantages, t.mask, shard.loss_tokens, self.loss_cfg,
                                    self._ref_logprobs(t.input_ids, t.attention_mask),
                                    t.weights if self.weighted else None)
                sums["entropy"] += entropy_sum(logits.detach(), t.mask)
                if t.diff_mask is not None:  # the version mask is on: the diff over every response token too
                    sums["logprob_abs_diff_all"] += float(logprob_abs_diff_sum(logp.detach(), t.rollout_logp,
                                                                               t.diff_mask))
                del logits
                if not self.parallel.is_leader:
                    fault_point("follower_mid_step")  # crash tests: a rank dies with the step half done
                (parts.loss * scale if scale != 1 else parts.loss).backward()
                sums["loss"] += float(parts.loss.detach())
                for k, v in parts.sums.items():
                    sums[k] += v
        norm: Any = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("non-finite grad norm at step=%d: update skipped", self.step + 1)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        if self.parallel.distributed:  # entered by each rank after its optimizer step: the step is done everywhere
            keys = ("loss", *SUM_KEYS)
            sums = defaultdict(float, zip(keys, self.parallel.all_reduce_sum([sums[k] for k in keys], self.device),
                                          strict=True))
        return sums, grad_norm, lr, skipped

    def _zero_backward(self) -> None:
        """A micro-batch with no rows on this rank: a forward + zero-gradient backward that joins the collectives."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        logits = self.module(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    def export(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(full weights, or None = save ``self.model`` as is; ``state_dict()``) — a collective on every rank."""
        if self.parallel.distributed and self.parallel.is_leader:
            self.parallel.command("export")
        weights, optim = self.parallel.full_state(self.model, self.optimizer)
        return weights, {"optimizer": optim, "scheduler": self.scheduler.state_dict(), "step": self.step}

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
        """Optimizer, scheduler and step (the model weights are saved in HF layout separately)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parallel.load_optimizer(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
