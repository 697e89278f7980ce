"""Async vs sync RL on this machine: the quick preset of configs/experiments/async-vs-sync.yaml.

Runs ``dressage experiment configs/experiments/async-vs-sync.yaml --quick`` (sync and async η = 1 with
live updates and the commit thread, 5 seeds, 100 trainer steps each, one run at a time; ≤ 10 minutes on
two quiet cores), builds the
tiny warm-started model first if it is missing, and prints the experiment's ratio and
time-decomposition tables, then as its last line::

    async/sync wall-clock to K steps: R× (seeds n, 95% interval [a, b]); to sync final accuracy: S×

R is sync's mean trainer wall-clock to K steps over async's (the baseline is measured in the same
run); S is sync's wall-clock to its final step over the time async first published a model at least
as accurate as sync's mean final eval accuracy (the spec defers evaluation to after each run,
``eval.defer``, so that it takes no CPU from the runs it measures). Every call measures anew (the experiment folder is
deleted first); ``--resume`` instead keeps the runs an interrupted call finished; ``--full`` runs the
whole spec instead of its quick preset.

    python bench/async_speedup.py [--resume] [--full] [--jobs 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.experiments.report import headline  # noqa: E402
from tools.experiments.spec import load_spec  # noqa: E402

SPEC = "configs/experiments/async-vs-sync.yaml"
OUT = "runs/experiments"


def prepare(spec_path: str) -> None:
    """Datasets and the tiny warm-started model of the base config, built only when missing."""
    from shared.config import load_config

    spec = load_spec(spec_path)
    cfg = load_config(None, env={}, overrides=spec.runs[0].config)
    if not Path(cfg.prompt_buffer.dataset).exists() or not Path(cfg.eval.dataset).exists():
        out = Path(cfg.prompt_buffer.dataset).parent.parent
        subprocess.run([sys.executable, "-m", "services", "make-data", "--out", str(out), "--tasks", cfg.model.task],
                       check=True)
    subprocess.run([sys.executable, "-m", "services", "init-model", "--task", cfg.model.task, "--out", cfg.model.path,
                    "--if-missing", "--warm-steps", str(cfg.model.warm_steps), "--seed", str(cfg.model.seed)],
                   check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--resume", action="store_true", help="keep the runs an earlier, interrupted call finished")
    p.add_argument("--full", action="store_true", help="the whole spec instead of its quick preset")
    p.add_argument("--jobs", type=int, default=1)
    args = p.parse_args(argv)
    os.chdir(ROOT)  # the spec's paths (base config, model, data) are relative to the repository
    quick = not args.full
    spec = load_spec(SPEC, quick=quick)
    folder = ROOT / OUT / spec.name
    if not args.resume and folder.exists():
        shutil.rmtree(folder)
    prepare(SPEC)
    cmd = [sys.executable, "-m", "services", "experiment", SPEC, "--out", OUT, "--jobs", str(args.jobs)]
    code = subprocess.call(cmd + (["--quick"] if quick else []), cwd=ROOT)
    from tools.experiments.report import csv_rows

    rows = csv_rows(folder / "summary.csv") if (folder / "summary.csv").exists() else []
    print(f"results: {folder / 'results.md'}")
    print(headline(spec, rows))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
