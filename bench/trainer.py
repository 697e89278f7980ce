"""Tokens/s of one trainer step vs a plain ``transformers`` forward/backward on the same batch, same run.

The batch is ``--groups`` GRPO groups of ``--samples`` trajectories of ``--tokens`` tokens (a
quarter prompt, the rest reply with loss), for a Qwen3-architecture model of ``--hidden`` width and
``--layers`` layers. Measured, alternating rounds, median of ``--rounds``:

* trainer: ``Learner.train_step([batch])`` — advantages, masks, padding, forward, token logprobs,
  clipped PG loss, entropy, backward, grad clip, AdamW step (the whole step the service runs);
* baseline: the same padded tensors through ``model(input_ids, attention_mask, labels)`` (HF's
  own cross-entropy), backward, AdamW step.

Both take one forward over the whole batch (``micro_batch_size`` = batch size). The ratio is
trainer tokens/s ÷ baseline tokens/s; 1.0 means the GRPO machinery costs nothing extra.

    python bench/trainer.py [--groups 4] [--samples 8] [--tokens 96] [--hidden 128] [--layers 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.trainer.batching import build_rows, collate  # noqa: E402
from services.trainer.learner import Learner  # noqa: E402
from shared.config import TrainConfig  # noqa: E402
from shared.modeling import ModelSpec, build_model  # noqa: E402
from shared.schemas import Batch, RolloutGroup, Sample, Window  # noqa: E402

VOCAB = 100


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
                                token_versions=["-1"] * n_prompt + ["0"] * (tokens - n_prompt),
                                reward=float(s % 3) / 2))
        out.append(RolloutGroup(group_id=f"g{g}", prompt_id=f"p{g}", attempt=0, status="completed", samples=group))
    return Batch(batch_id="bench", groups=out, window=Window(keep_versions=0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = ModelSpec(hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(256, args.tokens))
    batch = make_batch(args.groups, args.samples, args.tokens)
    n_rows = args.groups * args.samples
    cfg = TrainConfig(micro_batch_size=n_rows, lr=1e-5)
    learner = Learner(build_model(spec, VOCAB, 0, 2, seed=0), cfg, pad_id=0)
    base_model = build_model(spec, VOCAB, 0, 2, seed=0).train()
    base_opt = torch.optim.AdamW(base_model.parameters(), lr=1e-5)
    t = collate(build_rows([batch], True, False).rows, pad_id=0)
    labels = t.input_ids.masked_fill(t.mask == 0, -100)
    n_tokens = int(t.attention_mask.sum())

    def baseline_step() -> None:
        base_opt.zero_grad(set_to_none=True)
        loss = base_model(input_ids=t.input_ids, attention_mask=t.attention_mask, labels=labels).loss
        loss.backward()
        base_opt.step()

    learner.train_step([batch])  # warm-up both (allocator, kernels)
    baseline_step()
    ours, base = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        learner.train_step([batch])
        ours.append(n_tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        baseline_step()
        base.append(n_tokens / (time.perf_counter() - start))
    o, b = statistics.median(ours), statistics.median(base)
    print(f"batch: {n_rows} sequences x {args.tokens} tokens = {n_tokens} tokens; model hidden={args.hidden} "
          f"layers={args.layers}; threads={args.threads}; median of {args.rounds} rounds")
    print(f"trainer step (GRPO loss, metrics, AdamW): {o:10.0f} tokens/s")
    print(f"plain transformers forward/backward/AdamW: {b:10.0f} tokens/s")
    print(f"ratio trainer / baseline: {o / b:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
