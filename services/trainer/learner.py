"""The learner: policy model + optimizer + LR schedule; ``train_step(batches)`` is one optimizer step.

No Redis and no files here: the loop feeds decoded batches in and writes checkpoints out.

One step: rows of every batch → micro-batches of at most ``train.micro_batch_size`` rows, and at
least ``train.grad_accum`` of them; each micro-batch runs forward + backward and its gradient
accumulates; then the gradient norm is clipped and the optimizer steps once. How a step is cut
never changes its gradient (token-level mean over the whole step). Because the weights only change at that single ``optimizer.step()``, the
logprobs every micro-batch computes are the current policy *before* the update: they give
``train/train_rollout_logprob_abs_diff`` (reference §6.3) and the proximal policy of TIS without a
second forward pass. A step whose gradient is not finite is skipped (weights unchanged) and says so.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from services.trainer.batching import build_rows, collate, micro_batches, validate_batch
from services.trainer.loss import LossConfig, entropy_sum, policy_loss, token_logprobs
from shared.config import TrainConfig
from shared.schemas import Batch

log = logging.getLogger(__name__)


def _warmup(steps: int) -> Any:
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / (steps + 1)) if steps > 0 else 1.0

    return factor


class Learner:
    """Owns the trainable model and its optimizer state; ``step`` counts optimizer steps."""

    def __init__(self, model: PreTrainedModel, cfg: TrainConfig, pad_id: int,
                 ref_model: PreTrainedModel | None = None) -> None:
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("train.kl_coef > 0 needs a reference model")
        self.model, self.cfg, self.pad_id, self.ref_model = model, cfg, pad_id, ref_model
        self.model.train()
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup(cfg.warmup_steps))
        self.loss_cfg = LossConfig(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                                   tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef)
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

    def train_step(self, batches: Sequence[Batch]) -> dict[str, float]:
        """One optimizer step on ``batches`` (already validated); returns the step's metrics."""
        t0 = time.perf_counter()
        data = build_rows(batches, self.cfg.std_normalize, self.cfg.mask_nonlast_version_tokens)
        n_tokens = data.loss_tokens
        sums: dict[str, float] = defaultdict(float)
        loss_total = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        chunks = micro_batches(data.rows, self.micro_batch_rows(len(data.rows)))
        for chunk in chunks:
            t = collate(chunk, self.pad_id, self.device)
            logits = self.model(input_ids=t.input_ids, attention_mask=t.attention_mask, use_cache=False).logits
            logp = token_logprobs(logits, t.input_ids)
            parts = policy_loss(logp, t.rollout_logp, t.advantages, t.mask, n_tokens, self.loss_cfg,
                                self._ref_logprobs(t.input_ids, t.attention_mask))
            sums["entropy"] += entropy_sum(logits.detach(), t.mask)
            del logits
            parts.loss.backward()
            loss_total += float(parts.loss.detach())
            for k, v in parts.sums.items():
                sums[k] += v
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("non-finite grad norm at step=%d: update skipped", self.step + 1)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        seconds = max(time.perf_counter() - t0, 1e-9)
        denom = max(n_tokens, 1)
        rewards = torch.tensor(data.rewards or [0.0], dtype=torch.float64)
        metrics = {
            "train/loss": loss_total,
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/entropy": sums["entropy"] / denom,
            "train/clip_frac": sums["clip_frac"] / denom,
            "train/train_rollout_logprob_abs_diff": sums["logprob_abs_diff"] / denom,
            "train/reward_mean": float(rewards.mean()),
            "train/reward_std": float(rewards.std(unbiased=False)),
            "train/groups": float(data.n_groups),
            "train/samples": float(len(data.rows)),
            "train/micro_batches": float(len(chunks)),
            "train/tokens": float(data.tokens),
            "train/loss_tokens": float(n_tokens),
            "train/tokens_per_s": data.tokens / seconds,
            "train/step_time_s": seconds,
            "train/skipped_nonfinite": float(skipped),
        }
        if self.loss_cfg.kl_coef > 0:
            metrics["train/kl"] = sums["kl"] / denom
        if self.loss_cfg.tis_cap is not None:
            metrics["train/tis_weight_mean"] = sums["tis_weight"] / denom
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler and step (the model weights are saved in HF layout separately)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
