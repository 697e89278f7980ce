"""Trainer batches → training rows → padded tensors in micro-batches; checks at the edge.

Contract:
* ``validate_batch`` refuses (``InvalidBatch``, naming the field) a batch the model cannot train
  on: no completed group with samples, a token id outside the vocabulary, a sequence longer than
  the model's context, a sample with loss on no token. The loop dead-letters such a batch.
* ``build_rows`` turns the batches of one optimizer step into rows (one per sample) carrying the
  GRPO advantage of its trajectory, its train mask (``loss.train_masks``) and, when asked, the
  staleness weight of its trajectory's version gap (``loss.staleness_weight``). Failed groups carry
  no samples to train and are skipped. Under the non-last-version mask a row also carries its
  unmasked response tokens (``diff_mask``), so that the logprob diff can be measured over the same
  tokens with and without the mask.
* ``minibatches`` deals a step's rows to its minibatches (one optimizer step each), longest first,
  so every minibatch gets a like share of long and short rows; deterministic, so a batch retrained
  after a restart is cut exactly as before, and one minibatch returns the rows unchanged in content;
* ``micro_batches`` + ``collate`` pad rows on the right into ``[B, T]`` tensors, grouped by length
  so little compute goes to padding; the order of rows inside a minibatch does not change its gradient.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from services.trainer.loss import sample_advantages, train_masks, trajectory_rewards
from shared.errors import DressageError
from shared.schemas import Batch, RolloutGroup
from shared.staleness import trajectory_version_infos, trajectory_version_span
from shared.versions import real_version, versions_behind


class InvalidBatch(DressageError):
    """A decoded batch the trainer cannot train on; the message names the field."""


@dataclass(frozen=True)
class TrainRow:
    """One sample ready to train: tokens, train mask, behaviour logprobs and its advantage."""

    token_ids: list[int]
    mask: list[int]  # 1 = token carries loss (loss_mask, position 0 off, optional version mask)
    rollout_logprobs: list[float]  # behaviour-policy logprob per token (0.0 where mask is 0)
    advantage: float  # GRPO advantage of the sample's trajectory
    weight: float = 1.0  # staleness weight of the sample's trajectory (1 = unweighted)
    diff_mask: list[int] | None = None  # the mask before the non-last-version mask (None: not masked)
    gaps: list[int] | None = None  # per token, versions behind the proximal policy (``token_gaps``; None: not asked)


@dataclass
class StepRows:
    """Everything one optimizer step trains on, flattened over its batches."""

    rows: list[TrainRow] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # one per trajectory, all groups
    n_groups: int = 0  # completed groups trained
    n_failed_groups: int = 0  # failed groups skipped (no samples to train)

    @property
    def loss_tokens(self) -> int:
        return sum(sum(r.mask) for r in self.rows)

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def diff_tokens(self) -> int:
        """Response tokens before the non-last-version mask (``loss_tokens`` when it is off)."""
        return sum(sum(r.mask if r.diff_mask is None else r.diff_mask) for r in self.rows)


@dataclass
class Tensors:
    """A padded micro-batch, ``[B, T]`` unless noted."""

    input_ids: torch.Tensor  # long, padded with pad_id
    attention_mask: torch.Tensor  # long, 1 on real tokens
    mask: torch.Tensor  # float, 1 on loss tokens
    rollout_logp: torch.Tensor  # float32 behaviour logprobs
    advantages: torch.Tensor  # float32 [B]
    weights: torch.Tensor  # float32 [B], the rows' staleness weights
    diff_mask: torch.Tensor | None = None  # float, 1 on response tokens before the version mask (None: unmasked)
    gaps: torch.Tensor | None = None  # float, each token's version gap (None: the rows carry none)


def validate_batch(batch: Batch, vocab_size: int, max_len: int) -> None:
    """Raise ``InvalidBatch`` naming the first field that makes ``batch`` untrainable."""
    trainable = 0
    for g, group in enumerate(batch.groups):
        if group.status != "completed":
            continue
        for i, s in enumerate(group.samples):
            where = f"groups[{g}].samples[{i}]"
            n = len(s.token_ids)
            if n < 2:
                raise InvalidBatch(f"{where}.token_ids: needs at least 2 tokens, got {n} (group_id={group.group_id})")
            if n > max_len:
                raise InvalidBatch(f"{where}.token_ids: {n} tokens exceed the model context {max_len} "
                                   f"(group_id={group.group_id})")
            bad = next((t for t in s.token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidBatch(f"{where}.token_ids: id {bad} outside the vocabulary [0, {vocab_size}) "
                                   f"(group_id={group.group_id})")
            trainable += 1
    if trainable == 0:
        raise InvalidBatch(f"groups: batch {batch.batch_id} has no completed group with samples")


def build_rows(batches: Sequence[Batch], std_normalize: bool, mask_nonlast: bool,
               current_version: int | None = None, weight: Callable[[int], float] | None = None, *,
               with_gaps: bool = False) -> StepRows:
    """Rows, trajectory rewards and group counts of one optimizer step.

    With ``weight`` and ``current_version``, each row carries ``weight(gap)`` of its trajectory's gap
    (``trajectory_gaps``); a trajectory without a numbered end version weighs ``weight(0)``. With
    ``with_gaps``, each row carries every token's gap (``token_gaps``).
    """
    out = StepRows()
    for batch in batches:
        for group in batch.groups:
            if group.status != "completed" or not group.samples:
                out.n_failed_groups += 1
                continue
            out.n_groups += 1
            samples = group.samples
            out.rewards.extend(trajectory_rewards(samples))
            advantages = sample_advantages(samples, std_normalize)
            masks = train_masks(samples, mask_nonlast)
            unmasked = train_masks(samples, False) if mask_nonlast else [None] * len(samples)
            gaps = trajectory_gaps(group, current_version) if weight and current_version is not None else {}
            for s, adv, mask, full in zip(samples, advantages, masks, unmasked, strict=True):
                w = weight(gaps.get(s.traj_id, 0)) if weight else 1.0
                per_token = token_gaps(s.token_versions, current_version) if with_gaps else None
                out.rows.append(TrainRow(list(s.token_ids), mask, list(s.logprobs), adv, w, full, per_token))
    return out


def token_gaps(labels: Sequence[str], current_version: int | None) -> list[int]:
    """Per token, how many versions its label is behind ``current_version``, at least 0; 0 for a label
    without a number (context tokens, a foreign label) and for every token when there is no current version."""
    if current_version is None:
        return [0] * len(labels)
    gaps = []
    for label in labels:
        real = real_version(label)
        gaps.append(0 if real is None else max(0, versions_behind(current_version, real) or 0))
    return gaps


def minibatches(rows: Sequence[TrainRow], n: int) -> list[list[TrainRow]]:
    """``rows`` dealt to ``min(n, len(rows))`` minibatches (at least one): sorted longest first (ties in
    batch order), row ``i`` of that order to minibatch ``i mod n``."""
    ordered = sorted(range(len(rows)), key=lambda i: (-len(rows[i].token_ids), i))
    k = max(1, min(n, len(rows)))
    return [[rows[i] for i in ordered[j::k]] for j in range(k)]


def micro_batches(rows: Sequence[TrainRow], micro_batch_size: int) -> list[list[TrainRow]]:
    """Rows sorted longest first, cut into chunks of at most ``micro_batch_size``."""
    ordered = sorted(rows, key=lambda r: len(r.token_ids), reverse=True)
    return [ordered[i : i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]


def collate(rows: Sequence[TrainRow], pad_id: int, device: torch.device | str = "cpu") -> Tensors:
    """Right-padded tensors of ``rows`` on ``device``."""
    width = max(len(r.token_ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    logp = torch.zeros((n, width), dtype=torch.float32)
    diff_mask = torch.zeros((n, width), dtype=torch.float32) if any(r.diff_mask is not None for r in rows) else None
    gaps = torch.zeros((n, width), dtype=torch.float32) if any(r.gaps is not None for r in rows) else None
    for b, r in enumerate(rows):
        k = len(r.token_ids)
        input_ids[b, :k] = torch.tensor(r.token_ids, dtype=torch.long)
        attention[b, :k] = 1
        mask[b, :k] = torch.tensor(r.mask, dtype=torch.float32)
        logp[b, :k] = torch.tensor(r.rollout_logprobs, dtype=torch.float32)
        if diff_mask is not None:
            diff_mask[b, :k] = torch.tensor(r.mask if r.diff_mask is None else r.diff_mask, dtype=torch.float32)
        if gaps is not None and r.gaps is not None:
            gaps[b, :k] = torch.tensor(r.gaps, dtype=torch.float32)
    adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    weights = torch.tensor([r.weight for r in rows], dtype=torch.float32)
    return Tensors(input_ids.to(device), attention.to(device), mask.to(device), logp.to(device), adv.to(device),
                   weights.to(device), None if diff_mask is None else diff_mask.to(device),
                   None if gaps is None else gaps.to(device))


def version_gap_hist(batches: Sequence[Batch], current_version: int) -> dict[str, int]:
    """Trajectories per gap ``current_version - end version`` ({"0": n0, "1": n1, ...}) over the step."""
    return {str(g): n for g, n in sorted(Counter(_gaps(batches, current_version)).items())}


def version_span_hist(batches: Sequence[Batch]) -> dict[str, int]:
    """Trajectories per version span (distinct real versions over their tokens: 1 = one version,
    2 = resumed across one update, ...) over the step ({"1": n1, "2": n2, ...})."""
    spans = [n for batch in batches for group in batch.groups for n in trajectory_version_span(group).values()]
    return {str(s): n for s, n in sorted(Counter(spans).items())}


def version_gap(batches: Sequence[Batch], current_version: int) -> tuple[float, int] | None:
    """Mean and max of ``current_version - end version`` over the step's trajectories.

    Only integer end versions count (the trainer publishes "0", "1", ...); None when there is none.
    """
    gaps = _gaps(batches, current_version)
    if not gaps:
        return None
    return sum(gaps) / len(gaps), max(gaps)


def trajectory_gaps(group: RolloutGroup, current_version: int) -> dict[str, int]:
    """traj_id -> versions its end version is behind ``current_version`` (foreign labels absent)."""
    gaps: dict[str, int] = {}
    for info in trajectory_version_infos(group):
        gap = versions_behind(current_version, info.version)
        if gap is not None:
            gaps[info.key] = gap
    return gaps


def _gaps(batches: Sequence[Batch], current_version: int) -> list[int]:
    return [g for batch in batches for group in batch.groups for g in trajectory_gaps(group, current_version).values()]
