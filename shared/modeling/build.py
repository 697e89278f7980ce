"""Building a model directory: tokenizer + tiny causal LM (+ optional warm start), atomically.

Contract:
* `build_model_dir` writes a complete Hugging Face directory (config.json, generation_config.json,
  model.safetensors, tokenizer files with the chat template, and `dressage_build.json` describing
  how it was made) into a temporary sibling and renames it into place, so `out` is either absent,
  a complete model, or untouched; never half-written.
* Without `replace`, a non-empty `out` is never overwritten: `ModelDirExists` is raised before
  any work, naming what is there (a complete model, or what an incomplete one lacks).
* `ensure_model` builds only when `out` holds no complete model; with several concurrent
  callers, one build wins and the others keep it.
* `warm_start` trains an existing directory's model and replaces the directory the same way.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from shared.errors import DressageError
from shared.modeling.architecture import ModelSpec, build_model, count_parameters
from shared.modeling.compat import make_loadable
from shared.modeling.loading import (
    ModelNotFound,
    load_model,
    load_tokenizer,
    missing_files,
    quiet_transformers,
)
from shared.modeling.tokenizer import build_tokenizer, save_tokenizer
from shared.modeling.warmstart import EvalResult, evaluate, warm_start_model
from shared.tasks import PluginTask, get_task

log = logging.getLogger(__name__)

BUILD_INFO = "dressage_build.json"


class ModelDirExists(DressageError):
    """The output directory is not empty and replacing it was not asked for; names the path."""


HELDOUT_ROWS = 128  # held-out prompts for the early-stop check
REPORT_ROWS = 256  # other held-out prompts for the before/after figures (unbiased by the stop rule)
TRAIN_SEED_OFFSET = 1_000_003  # keeps warm-start rows apart from datasets made with small seeds


@dataclass
class WarmStartOptions:
    """How to warm-start; `steps == 0` means no warm start (random init only)."""

    steps: int = 0  # maximum optimiser steps
    target_accuracy: float | None = None  # stop once greedy held-out accuracy reaches this
    batch_size: int = 32
    lr: float = 3e-3
    eval_every: int = 2  # optimiser steps between early-stop checks (the skill jumps fast)
    guess_share: float = 0.0  # share of rows demonstrated by the task's wrong guess (a habit RL can unlearn)


@dataclass
class BuildReport:
    """What was built, with before/after figures on the held-out prompts when warm-started."""

    path: str
    task: str
    seed: int
    params: int
    spec: dict[str, Any]
    warm_steps: int = 0
    seconds: float = 0.0
    before: dict[str, dict[str, float]] = field(default_factory=dict)  # {"greedy"|"sampled": EvalResult}
    after: dict[str, dict[str, float]] = field(default_factory=dict)


def _figures(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, task: Any, rows: list[dict[str, Any]], seed: int
) -> dict[str, dict[str, float]]:
    """Greedy and temperature-1.0 sampled reward/accuracy on `rows`."""
    out: dict[str, dict[str, float]] = {}
    for name, greedy in (("greedy", True), ("sampled", False)):
        r: EvalResult = evaluate(model, tok, task, rows, greedy=greedy, temperature=1.0, seed=seed)
        out[name] = {"reward_mean": r.reward_mean, "accuracy": r.accuracy, "n": r.n}
    return out


def _split_rows(task: Any, options: WarmStartOptions, seed: int,
                dataset: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], ...]:
    """Pairwise-distinct (train, held-out, report) rows; train as large as the steps can use.

    A task with a small `capacity` gets at most a quarter of it held out for each check set. A task
    without a generator (a plugin) takes the rows of ``dataset``, shuffled by ``seed``.
    """
    wanted = max(options.steps, 1) * options.batch_size
    capacity = getattr(task, "capacity", None)
    total = wanted + HELDOUT_ROWS + REPORT_ROWS
    if dataset is not None:
        rows = list(dataset)
        random.Random(seed + TRAIN_SEED_OFFSET).shuffle(rows)
        held, rep = min(HELDOUT_ROWS, len(rows) // 4), min(REPORT_ROWS, len(rows) // 4)
        return rows[: len(rows) - held - rep], rows[len(rows) - held - rep : len(rows) - rep], rows[len(rows) - rep :]
    if isinstance(task, PluginTask):
        raise ValueError(f"task {task.name!r} generates no rows: give its dataset (init-model --dataset)")
    if isinstance(capacity, int) and capacity > 0:
        total = min(total, capacity)
    rows = task.generate(total, seed + TRAIN_SEED_OFFSET)
    held, rep = min(HELDOUT_ROWS, len(rows) // 4), min(REPORT_ROWS, len(rows) // 4)
    train_end = len(rows) - held - rep
    return rows[:train_end], rows[train_end : train_end + held], rows[train_end + held :]


def _write_dir(model: PreTrainedModel, tok: PreTrainedTokenizerBase, info: dict[str, Any], tmp: Path) -> None:
    model.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tok, tmp)  # type: ignore[arg-type]  # every tokenizer built here is a fast one
    make_loadable(tmp)  # config.json too: transformers 4.5x (SGLang's pin) must read it
    (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    missing = missing_files(tmp)
    if missing:  # a transformers change would show up here, not at load time in a service
        raise ModelNotFound(f"built directory {tmp} lacks {', '.join(missing)}")


def _refuse_occupied(out: Path) -> None:
    """Raise ModelDirExists if `out` is a non-empty directory (or a file)."""
    if out.is_dir() and not any(out.iterdir()):
        return
    if out.exists():
        missing = missing_files(out)
        what = (
            "a complete model"
            if not missing
            else f"something that is not a complete model (missing {', '.join(missing)})"
        )
        raise ModelDirExists(f"{out} already holds {what}; not overwriting it")


def _install(tmp: Path, out: Path, replace: bool) -> bool:
    """Rename `tmp` to `out`. Returns False (and drops tmp) if another builder got there first."""
    if out.exists() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():
        if not replace:  # a concurrent builder installed its model after our up-front check
            shutil.rmtree(tmp)
            _refuse_occupied(out)
            return False
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(trash)
        tmp.rename(out)
        shutil.rmtree(trash)
        return True
    try:
        tmp.rename(out)
    except OSError:  # lost a race with a concurrent builder: keep theirs
        shutil.rmtree(tmp)
        if missing_files(out):
            raise
        return False
    return True


def _run_warm_start(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    task: Any,
    options: WarmStartOptions,
    seed: int,
    report: BuildReport,
    dataset: list[dict[str, Any]] | None = None,
) -> None:
    train, held, rep = _split_rows(task, options, seed, dataset)
    report.before = _figures(model, tok, task, rep, seed)
    ws = warm_start_model(
        model,
        tok,
        task,
        train,
        options.steps,
        seed=seed,
        batch_size=options.batch_size,
        lr=options.lr,
        heldout_rows=held,
        target_accuracy=options.target_accuracy,
        eval_every=options.eval_every,
        guess_share=options.guess_share,
    )
    report.warm_steps, report.seconds = ws.steps, ws.seconds
    report.after = _figures(model, tok, task, rep, seed)


def build_model_dir(
    out: str | Path,
    task_name: str,
    spec: ModelSpec | None = None,
    seed: int = 0,
    warm: WarmStartOptions | None = None,
    replace: bool = False,
    dataset: list[dict[str, Any]] | None = None,
) -> BuildReport:
    """Build tokenizer + model (random init from `seed`), optionally warm-start (on ``dataset``'s rows for a
    task without a generator), install at `out`."""
    quiet_transformers()
    spec = spec or ModelSpec()
    spec.validate()
    warm = warm or WarmStartOptions()
    task = get_task(task_name)
    out = Path(out)
    if not replace:
        _refuse_occupied(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = build_tokenizer(model_max_length=spec.max_position_embeddings)
    model = build_model(spec, len(tok), int(tok.pad_token_id), int(tok.eos_token_id), seed=seed)
    report = BuildReport(str(out), task_name, seed, count_parameters(model), spec.as_dict())
    if warm.steps > 0:
        _run_warm_start(model, tok, task, warm, seed, report, dataset)
    report.seconds = time.perf_counter() - t0
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    _write_dir(model, tok, {"builder": "shared.modeling", **asdict(report), "warm": asdict(warm)}, tmp)
    if _install(tmp, out, replace):
        log.info(
            "built model path=%s task=%s params=%d warm_steps=%d seconds=%.1f",
            out,
            task_name,
            report.params,
            report.warm_steps,
            report.seconds,
        )
    else:
        log.info("model path=%s was built concurrently by another process; keeping it", out)
    return report


def ensure_model(
    path: str | Path,
    task_name: str,
    spec: ModelSpec | None = None,
    seed: int = 0,
    warm: WarmStartOptions | None = None,
    dataset: list[dict[str, Any]] | None = None,
) -> BuildReport | None:
    """Build the model at `path` unless a complete one is already there; the report if built now."""
    if not missing_files(path):
        log.info("model path=%s already complete; not rebuilding", path)
        return None
    return build_model_dir(path, task_name, spec=spec, seed=seed, warm=warm, replace=False, dataset=dataset)


def read_build_info(path: str | Path) -> dict[str, Any] | None:
    """The `dressage_build.json` of a directory built here, or None for foreign checkpoints."""
    p = Path(path) / BUILD_INFO
    return json.loads(p.read_text()) if p.is_file() else None


def warm_start(
    model_dir: str | Path,
    task_name: str,
    steps: int,
    seed: int = 0,
    target_accuracy: float | None = None,
    batch_size: int = 32,
    lr: float = 3e-3,
) -> BuildReport:
    """Warm-start the model saved in `model_dir` on `task_name` and replace the directory."""
    quiet_transformers()
    model_dir = Path(model_dir)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    task = get_task(task_name)
    options = WarmStartOptions(steps=steps, target_accuracy=target_accuracy, batch_size=batch_size, lr=lr)
    report = BuildReport(str(model_dir), task_name, seed, count_parameters(model), {})
    _run_warm_start(model, tok, task, options, seed, report)
    info = {**(read_build_info(model_dir) or {}), "warm_start": asdict(report), "warm": asdict(options)}
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    _write_dir(model, tok, info, tmp)
    _install(tmp, model_dir, replace=True)
    return report
