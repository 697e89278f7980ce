"""`dressage init-model`: build a tiny model directory for a task (random init + warm start).

Usage: ``python -m tools.dev.init_model --task reverse --out models/reverse-tiny
[--warm-steps N] [--target-accuracy A] [--seed S] [--hidden H] [--layers L] ...``

Prints one summary line (params, warm-start figures, seconds) and exits 0; exits 2 with a
message naming the option on bad input, and 1 when `--out` is occupied by something that is
not a model (unless `--force`).
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from shared.errors import ConfigError, UnknownTask
from shared.modeling.architecture import ModelSpec
from shared.modeling.build import BuildReport, ModelDirExists, WarmStartOptions, build_model_dir, ensure_model
from shared.modeling.loading import ModelNotFound
from shared.tasks import TaskFailed, scan_dataset

log = logging.getLogger(__name__)

DEFAULT_TARGET_ACCURACY = 0.3  # greedy held-out accuracy; ~0.45-0.6 sampled reward on `reverse`


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dressage init-model", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, help="task whose demonstrations warm-start the model")
    p.add_argument("--out", required=True, help="model directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default=None,
                   help="rows to warm-start on, for a task without a generator (a plugin with demonstration(row))")
    p.add_argument("--warm-steps", type=int, default=400, help="max warm-start steps (0 = random init)")
    p.add_argument("--guess-share", type=float, default=0.0,
                   help="share of warm-start rows demonstrated by the task's wrong guess (tasks with a guess: lookup)")
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=DEFAULT_TARGET_ACCURACY,
        help="stop the warm start once greedy held-out accuracy reaches this (<= 0 disables)",
    )
    p.add_argument(
        "--eval-every", type=int, default=WarmStartOptions.eval_every, help="steps between early-stop checks"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--arch", default=ModelSpec.arch, choices=["qwen3", "qwen2", "llama"])
    p.add_argument("--hidden", type=int, default=ModelSpec.hidden_size)
    p.add_argument("--intermediate", type=int, default=ModelSpec.intermediate_size)
    p.add_argument("--layers", type=int, default=ModelSpec.num_hidden_layers)
    p.add_argument("--heads", type=int, default=ModelSpec.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=ModelSpec.num_key_value_heads)
    p.add_argument("--max-positions", type=int, default=ModelSpec.max_position_embeddings)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: tiny models gain nothing from more, and lose a lot on busy cores)",
    )
    p.add_argument(
        "--if-missing", action="store_true", help="do nothing if --out already holds a complete model"
    )
    p.add_argument("--force", action="store_true", help="replace whatever --out holds")
    return p


def _summary(r: BuildReport) -> str:
    line = f"built {r.path}: task={r.task} params={r.params} seed={r.seed}"
    if r.warm_steps:
        b, a = r.before, r.after
        line += (
            f" warm_steps={r.warm_steps}"
            f" greedy acc {b['greedy']['accuracy']:.2f}->{a['greedy']['accuracy']:.2f}"
            f" sampled reward {b['sampled']['reward_mean']:.2f}->{a['sampled']['reward_mean']:.2f}"
            f" sampled acc {b['sampled']['accuracy']:.2f}->{a['sampled']['accuracy']:.2f}"
        )
    return line + f" seconds={r.seconds:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads < 1:
        print("--threads: expected >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    spec = ModelSpec(
        arch=args.arch,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
    )
    if args.warm_steps < 0 or args.batch_size < 1 or args.lr <= 0 or args.eval_every < 1:
        print("--warm-steps must be >= 0, --batch-size >= 1, --lr > 0, --eval-every >= 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.guess_share <= 1.0:
        print("--guess-share must be in [0, 1]", file=sys.stderr)
        return 2
    target = args.target_accuracy if args.target_accuracy > 0 else None
    warm = WarmStartOptions(
        steps=args.warm_steps,
        target_accuracy=target,
        batch_size=args.batch_size,
        lr=args.lr,
        eval_every=args.eval_every,
        guess_share=args.guess_share,
    )
    try:
        dataset = scan_dataset(args.dataset, task=args.task).rows if args.dataset else None
        if args.if_missing:
            built = ensure_model(args.out, args.task, spec=spec, seed=args.seed, warm=warm, dataset=dataset)
            if built is None:
                print(f"model at {args.out} already complete; nothing to do")
                return 0
            report = built
        else:
            report = build_model_dir(
                args.out, args.task, spec=spec, seed=args.seed, warm=warm, replace=args.force, dataset=dataset
            )
    except (ConfigError, UnknownTask, TaskFailed, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ModelDirExists, ModelNotFound) as exc:
        print(f"error: {exc} (use --force to replace it)", file=sys.stderr)
        return 1
    print(_summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
