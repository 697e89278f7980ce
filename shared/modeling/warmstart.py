"""Supervised warm start on a task's demonstrations, and task-level evaluation of a model.

Contract:
* `demonstration_examples` turns dataset rows into token sequences whose loss mask is 1 exactly
  on the ideal reply's tokens and the closing eos (`<|im_end|>`), never on the prompt.
* `evaluate` plays every row as an episode of the task (several model calls for multi-turn
  tasks) and reports the mean reward and the exact-match accuracy (`Episode.correct()`).
* with `guess_share` > 0, a share of the rows (picked by a hash of the prompt, so nothing in the
  prompt tells which) is demonstrated by the task's `guess` instead: a wrong answer written without
  the skill, the habit of a base model that has not learned to use its tools yet. A task without
  `guess` and a share outside [0, 1] are refused.
* `warm_start_model` trains in place for at most `steps` optimiser steps and stops early once
  the greedy accuracy on the held-out rows reaches `target_accuracy`. It is deterministic for a
  given seed on one machine, and leaves the caller's global RNG state untouched. Checks run
  every `eval_every * task.max_turns` steps (and after the last step).

The point of the warm start is a *partial* skill: RL needs rewards that vary inside a GRPO group,
so the default stops long before the task is solved.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from shared.modeling.loading import chat_input_ids, pad_token_id
from shared.modeling.sampling import generate_batch
from shared.tasks.base import DemoTurn, Task, start_episode
from shared.tasks.plugin import PluginTask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One training sequence: prompt + reply + eos, loss on the reply part only."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is predicted with loss (reply tokens + eos)


@dataclass(frozen=True)
class EvalResult:
    reward_mean: float  # mean trajectory reward over the rows, in [0, 1]
    accuracy: float  # fraction of rows solved exactly
    n: int  # rows evaluated


@dataclass
class WarmStartReport:
    steps: int  # optimiser steps taken
    seconds: float  # wall time of the training loop, evaluations included
    final_loss: float  # mean loss of the last step
    stopped_early: bool  # target accuracy reached before `max steps`
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, greedy accuracy)


def _turn_example(tokenizer: PreTrainedTokenizerBase, messages: list[Any], reply: str, eos: int,
                  tools: list[dict[str, Any]] | None = None) -> Example:
    prompt_ids = chat_input_ids(tokenizer, messages, add_generation_prompt=True, tools=tools)
    reply_ids = [int(i) for i in tokenizer.encode(reply, add_special_tokens=False)] + [eos]
    return Example(prompt_ids + reply_ids, [0] * len(prompt_ids) + [1] * len(reply_ids))


def _merge_turns(turns: list[Example]) -> list[Example]:
    """Fold the turns of one episode into one sequence when each turn extends the previous one.

    With ChatML, turn k+1's prompt starts with turn k's prompt + reply, so one sequence carrying
    loss on every reply trains the same tokens as N separate ones at a fraction of the compute.
    Turns that do not extend their predecessor (a template that rewrites history) stay separate.
    """
    merged: list[Example] = []
    for ex in turns:
        last = merged[-1] if merged else None
        if last is not None and ex.input_ids[: len(last.input_ids)] == last.input_ids:
            merged[-1] = Example(ex.input_ids, last.loss_mask + ex.loss_mask[len(last.loss_mask) :])
        else:
            merged.append(ex)
    return merged


def guessed(prompt: Any, share: float) -> bool:
    """Whether the warm start demonstrates ``prompt`` by a guess: a stable hash of the prompt
    below ``share`` (the same rows on every machine, unrelated to anything the model can read)."""
    digest = hashlib.blake2b(repr(prompt).encode(), digest_size=8, person=b"dressage-guess").digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def demonstration_examples(
    task: Task, rows: Sequence[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, guess_share: float = 0.0
) -> list[Example]:
    """Training sequences for `rows`: loss on every demonstrated reply + eos, never on context.

    A multi-turn demonstration becomes one sequence when the chat template allows it. A
    ``guess_share`` of the rows is demonstrated by ``task.guess`` (module contract).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id; cannot mark the end of a reply")
    if not 0.0 <= guess_share <= 1.0:
        raise ValueError(f"guess_share={guess_share}: expected a share in [0, 1]")
    guess = getattr(task, "guess", None)
    if guess_share > 0 and guess is None:
        raise ValueError(f"guess_share={guess_share}: task {task.name!r} has no guess demonstrations")
    examples: list[Example] = []
    for row in rows:
        demo: list[DemoTurn]
        if guess is not None and guessed(row["prompt"], guess_share):
            demo = guess(row["prompt"], row["reference"])
        elif isinstance(task, PluginTask):
            demo = task.demonstration_row(row)  # a plugin reads the whole row
        else:
            demo = task.demonstration(row["prompt"], row["reference"])
        turns = [_turn_example(tokenizer, list(messages), reply, int(eos), getattr(task, "tools", None))
                 for messages, reply in demo]
        examples.extend(_merge_turns(turns))
    return examples


def _collate(batch: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, loss_mask) tensors."""
    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.float32)
    for row, e in enumerate(batch):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        attn[row, :n] = 1
        mask[row, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return ids, attn, mask


def sequence_loss(model: PreTrainedModel, batch: Sequence[Example], pad_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over the masked (reply) tokens of `batch`."""
    ids, attn, mask = _collate(batch, pad_id)
    device = next(model.parameters()).device
    ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    # Token t is predicted from positions < t: shift targets and their mask left by one.
    targets, weights = ids[:, 1:], mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    return (nll * weights).sum() / weights.sum().clamp(min=1.0)


@torch.no_grad()
def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    rows: Sequence[dict[str, Any]],
    greedy: bool = True,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
    template_kwargs: dict[str, Any] | None = None,
) -> EvalResult:
    """Play each row as an episode of `task`; mean reward and exact-match accuracy."""
    was_training = model.training
    model.eval()
    episodes = [start_episode(task, r) for r in rows]
    turn = 0
    while True:
        live = [ep for ep in episodes if not ep.done]
        if not live:
            break
        for start in range(0, len(live), batch_size):
            chunk = live[start : start + batch_size]
            replies = generate_batch(
                model,
                tokenizer,
                [ep.messages() for ep in chunk],
                max_new_tokens=task.max_new_tokens,
                greedy=greedy,
                temperature=temperature,
                seed=seed + 7919 * turn + start,
                tools=getattr(task, "tools", None),
                template_kwargs=template_kwargs,
            )
            for ep, reply in zip(chunk, replies, strict=True):
                ep.step(reply.text)
        turn += 1
    model.train(was_training)
    n = len(episodes)
    if n == 0:
        return EvalResult(0.0, 0.0, 0)
    return EvalResult(
        reward_mean=sum(ep.reward() for ep in episodes) / n,
        accuracy=sum(1 for ep in episodes if ep.correct()) / n,
        n=n,
    )


def warm_start_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    train_rows: Sequence[dict[str, Any]],
    steps: int,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 3e-3,
    heldout_rows: Sequence[dict[str, Any]] = (),
    target_accuracy: float | None = None,
    eval_every: int = 25,
    guess_share: float = 0.0,
) -> WarmStartReport:
    """Train `model` in place on demonstrations of `train_rows` (see module contract)."""
    if steps < 0:
        raise ValueError(f"steps={steps}: expected >= 0")
    if target_accuracy is not None and not heldout_rows:
        raise ValueError("target_accuracy needs heldout_rows to measure it on")
    examples = demonstration_examples(task, train_rows, tokenizer, guess_share)
    if steps and not examples:
        raise ValueError(f"task {task.name!r}: no demonstrations to train on")
    pad_id = pad_token_id(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, min(20, steps // 10))
    report = WarmStartReport(steps=0, seconds=0.0, final_loss=float("nan"), stopped_early=False)
    # An evaluation plays every turn of every held-out episode: space checks by the turn count so
    # multi-turn tasks do not spend most of the time evaluating (deterministic, unlike a timer).
    check_every = max(1, eval_every * max(1, int(getattr(task, "max_turns", 1))))
    t0 = time.perf_counter()
    model.train()
    order = torch.randperm(len(examples), generator=gen).tolist() if examples else []
    cursor = 0
    for step in range(1, steps + 1):
        if cursor + batch_size > len(order):  # new epoch: reshuffle
            order, cursor = torch.randperm(len(examples), generator=gen).tolist(), 0
        batch = [examples[i] for i in order[cursor : cursor + batch_size]]
        cursor += batch_size
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / warmup)
        loss = sequence_loss(model, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        report.steps, report.final_loss = step, float(loss.detach())
        if target_accuracy is not None and (step % check_every == 0 or step == steps):
            acc = evaluate(model, tokenizer, task, heldout_rows, greedy=True).accuracy
            report.history.append((step, acc))
            log.info(
                "warm start task=%s step=%d loss=%.4f greedy_acc=%.3f",
                task.name,
                step,
                report.final_loss,
                acc,
            )
            if acc >= target_accuracy:
                report.stopped_early = step < steps
                break
        elif step % check_every == 0:
            log.info("warm start task=%s step=%d loss=%.4f", task.name, step, report.final_loss)
    model.eval()
    report.seconds = time.perf_counter() - t0
    return report
