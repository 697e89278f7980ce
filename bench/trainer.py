"""Tokens/s of the trainer vs a plain ``transformers`` forward/backward on the same batch, same run.

The batch is ``--groups`` GRPO groups of ``--samples`` trajectories of ``--tokens`` tokens (a
quarter prompt, the rest reply with loss), for a Qwen3-architecture model of ``--hidden`` width and
``--layers`` layers. Two cases, measured in alternating rounds, median of ``--rounds``:

1. one optimizer step per batch (the default trainer):
   * trainer: ``Learner.train_step([batch])`` — advantages, masks, padding, forward, token logprobs,
     clipped PG loss, entropy, diagnostics, backward, grad clip, AdamW step (the whole step the service runs);
   * baseline: the same padded tensors through ``model(input_ids, attention_mask, labels)`` (HF's
     own cross-entropy), backward, AdamW step.
2. ``--minibatches`` M (default 4) optimizer steps per batch (``train.minibatches_per_batch``, loss
   ``--loss``, default ``decoupled``, the E4 setting):
   * trainer: ``Learner.train_step([batch])`` with M minibatches — which adds the proximal pass: one
     forward without gradient over minibatches 1..M-1, before the first update
     (``train.proximal_logprobs: recompute``); for a loss that reads the proximal policy, also the trainer
     with ``loglinear``, which estimates it instead (no extra forward);
   * baseline: M plain forward/backward/AdamW steps, one per minibatch (the same rows the trainer puts
     in each), on the same data.

The batch's reply tokens were sampled 1 to 4 versions before the one trained (the E4 regime), so the
log-linear estimate interpolates.

Every forward takes a whole minibatch (``micro_batch_size`` = its rows). Ratios are trainer tokens/s ÷
baseline tokens/s over the batch's tokens; 1.0 means the GRPO machinery costs nothing extra. Case 2
also times a plain no-grad forward over minibatches 1..M-1 (the proximal pass's share of the work).

    python bench/trainer.py [--groups 4] [--samples 8] [--tokens 96] [--hidden 128] [--layers 2] [--rounds 7]
                            [--minibatches 4] [--loss decoupled]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.trainer.batching import Tensors, build_rows, collate, minibatches  # noqa: E402
from services.trainer.learner import Learner  # noqa: E402
from shared.config import TrainConfig  # noqa: E402
from shared.modeling import ModelSpec, build_model  # noqa: E402
from shared.schemas import Batch, RolloutGroup, Sample, Window  # noqa: E402

VOCAB = 100
CURRENT = 4  # the version trained: the replies are 1 to 4 versions behind it


def make_batch(groups: int, samples: int, tokens: int, seed: int = 0) -> Batch:
    rng = random.Random(seed)
    n_prompt = tokens // 4
    out = []
    for g in range(groups):
        group = []
        for s in range(samples):
            mask = [0] * n_prompt + [1] * (tokens - n_prompt)
            group.append(Sample(traj_id=f"g{g}-t{s}", token_ids=[rng.randrange(4, VOCAB) for _ in range(tokens)],
                                loss_mask=mask, logprobs=[-rng.uniform(0.5, 3.0) * m for m in mask],
                                token_versions=["-1"] * n_prompt + [str(s % 4)] * (tokens - n_prompt),
                                reward=float(s % 3) / 2))
        out.append(RolloutGroup(group_id=f"g{g}", prompt_id=f"p{g}", attempt=0, status="completed", samples=group))
    return Batch(batch_id="bench", groups=out, window=Window(keep_versions=0))


def median_rates(steps: list[Callable[[], object]], n_tokens: int, rounds: int) -> list[float]:
    """Median tokens/s of each step, timed in alternating rounds after one warm-up call each."""
    for step in steps:
        step()
    rates: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for step, out in zip(steps, rates, strict=True):
            start = time.perf_counter()
            step()
            out.append(n_tokens / (time.perf_counter() - start))
    return [statistics.median(r) for r in rates]


def plain_steps(model: torch.nn.Module, parts: list[Tensors]) -> Callable[[], None]:
    """One plain HF forward/backward/AdamW step per padded part (``labels``: its loss tokens)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    labels = [t.input_ids.masked_fill(t.mask == 0, -100) for t in parts]

    def run() -> None:
        for t, y in zip(parts, labels, strict=True):
            opt.zero_grad(set_to_none=True)
            model(input_ids=t.input_ids, attention_mask=t.attention_mask, labels=y).loss.backward()
            opt.step()

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--loss", choices=("clipped", "naive", "decoupled"), default="decoupled")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = ModelSpec(hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(256, args.tokens))
    batch = make_batch(args.groups, args.samples, args.tokens)
    rows = build_rows([batch], True, False).rows
    n_rows, m = len(rows), args.minibatches
    whole = collate(rows, pad_id=0)
    n_tokens = int(whole.attention_mask.sum())
    print(f"batch: {n_rows} sequences x {args.tokens} tokens = {n_tokens} tokens; model hidden={args.hidden} "
          f"layers={args.layers}; threads={args.threads}; median of {args.rounds} rounds")

    learner = Learner(build_model(spec, VOCAB, 0, 2, seed=0), TrainConfig(micro_batch_size=n_rows, lr=1e-5), pad_id=0)
    o, b = median_rates([lambda: learner.train_step([batch]), plain_steps(build_model(spec, VOCAB, 0, 2, seed=0).train(),
                                                                           [whole])], n_tokens, args.rounds)
    print(f"1 optimizer step per batch: trainer (GRPO loss, metrics, AdamW) {o:10.0f} tokens/s; "
          f"plain forward/backward/AdamW {b:10.0f} tokens/s; ratio {o / b:.2f}")

    parts = minibatches(rows, m)
    cfg = TrainConfig(micro_batch_size=max(len(p) for p in parts), lr=1e-5, minibatches_per_batch=m,
                      policy_loss=args.loss)
    learner = Learner(build_model(spec, VOCAB, 0, 2, seed=0), cfg, pad_id=0)
    estimating = cfg.policy_loss == "decoupled"  # the losses that read a proximal policy (tis_cap aside)
    fast = Learner(build_model(spec, VOCAB, 0, 2, seed=0),
                   cfg.model_copy(update={"proximal_logprobs": "loglinear"}), pad_id=0) if estimating else None
    base_model = build_model(spec, VOCAB, 0, 2, seed=0).train()
    padded = [collate(p, pad_id=0) for p in parts]

    def proximal_forward() -> None:
        with torch.no_grad():
            for t in padded[1:]:
                base_model(input_ids=t.input_ids, attention_mask=t.attention_mask)

    steps = [lambda: learner.train_step([batch], CURRENT), plain_steps(base_model, padded), proximal_forward]
    if fast is not None:
        steps.append(lambda: fast.train_step([batch], CURRENT))
    o, b, f, *ll = median_rates(steps, n_tokens, args.rounds)
    print(f"{m} minibatches per batch ({args.loss}): trainer {o:10.0f} tokens/s; {m} plain forward/backward/AdamW "
          f"steps {b:10.0f} tokens/s; ratio {o / b:.2f}")
    print(f"  a no-grad forward over minibatches 1..{m - 1} (the proximal pass) costs {100 * b / f:.0f} % of the "
          f"{m} plain steps' time; ratio without it {(1 / b) / (1 / o - 1 / f):.2f} (estimate)")
    if ll:
        print(f"  proximal_logprobs loglinear (no proximal pass): trainer {ll[0]:10.0f} tokens/s; ratio {ll[0] / b:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
