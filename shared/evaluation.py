"""Evaluation jobs on rq: the trainer enqueues, the eval worker runs; neither imports the other.

Contract:
* ``enqueue_eval`` puts one job per version on the rq queue ``eval.queue`` of the pipeline's Redis.
  Arguments are plain strings and ints only (checkpoint path, version, step, dataset path, count,
  key prefix, batch size, device) and the function is named by its module path, so the job is
  serialised as JSON (``rq.serializers.JSONSerializer``): nothing is ever pickled or unpickled.
  The Redis URL is *not* an argument (it may hold a password, and rq logs job descriptions);
  the job uses the connection of the worker that runs it.
* ``run_eval_job`` loads the checkpoint, plays the first ``n_examples`` rows of the held-out
  dataset with greedy decoding through the task verifiers (``shared.tasks``) and appends one
  report to ``{p}:metrics`` (service ``eval``): ``eval/accuracy``, ``eval/reward``,
  ``eval/version``, ``eval/step``, ``eval/n``. It returns the same dict (rq keeps it as the result).
  Job ids are ``<prefix>-eval-v<version>``, so a version is never queued twice at once.
* A queued version's checkpoint is pinned in the set ``{p}:eval:pinned`` until its job ends
  (success or failure), so the trainer's pruning never deletes a checkpoint an evaluation still needs.
"""

from __future__ import annotations

import logging
import re
import sys
from collections import defaultdict
from typing import Any

import redis
from rq import Queue, get_current_job
from rq.serializers import JSONSerializer

from shared.keys import Keys
from shared.telemetry import report_metrics

log = logging.getLogger(__name__)

JOB_FUNCTION = "shared.evaluation.run_eval_job"
SERIALIZER = JSONSerializer


def eval_queue(r: redis.Redis, name: str) -> Queue:
    """The rq queue (JSON-serialised) that evaluation jobs travel on."""
    return Queue(name, connection=r, serializer=SERIALIZER)


def job_id(prefix: str, version: str) -> str:
    """rq job ids allow letters, digits, ``_`` and ``-`` only."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{prefix}-eval-v{version}")


def enqueue_eval(r: redis.Redis, queue: str, checkpoint_path: str, version: str, step: int,
                 dataset: str, n_examples: int, prefix: str, batch_size: int = 64,
                 device: str = "cpu", timeout_s: int = 1800) -> str:
    """Queue the evaluation of one version; returns the rq job id."""
    r.sadd(pinned_key(prefix), str(checkpoint_path))
    kwargs = {"checkpoint_path": str(checkpoint_path), "version": str(version), "step": int(step),
              "dataset": str(dataset), "n_examples": int(n_examples), "prefix": str(prefix),
              "batch_size": int(batch_size), "device": str(device)}
    job = eval_queue(r, queue).enqueue_call(JOB_FUNCTION, kwargs=kwargs, timeout=timeout_s,
                                            job_id=job_id(prefix, version), result_ttl=86_400,
                                            failure_ttl=7 * 86_400, description=f"eval version={version}")
    log.info("queued evaluation version=%s step=%d job_id=%s", version, step, job.id)
    return str(job.id)


def pinned_key(prefix: str) -> str:
    return Keys(prefix).eval_pinned


def pinned_checkpoints(r: redis.Redis, prefix: str) -> list[str]:
    """Checkpoint paths with an evaluation queued or running (never pruned)."""
    return [p.decode() if isinstance(p, bytes) else str(p) for p in r.smembers(pinned_key(prefix))]


def preload(model_path: str | None = None) -> list[str]:
    """Import, in the calling process, the modules ``run_eval_job`` needs: torch, transformers, the task
    plugins and the module of the model's architecture (read from ``model_path``'s config, when there).

    rq forks one work horse per job, and a fork inherits what its parent imported: preloaded in the eval
    worker, a job costs its own work (about 0.4 s for the CPU demo's model) instead of importing torch and
    transformers afresh (6-10 s of CPU per job; at one evaluation every 5 versions that kept a core busy).
    Nothing here runs a torch op, so no thread pool is started before the fork. A model that cannot be
    read yet only skips the architecture module. Returns the modules it imported, for the log.
    """
    import importlib

    before = set(sys.modules)
    importlib.import_module("torch")
    importlib.import_module("shared.modeling")
    importlib.import_module("shared.tasks")
    if model_path:
        try:
            from transformers import AutoConfig
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            config = AutoConfig.from_pretrained(model_path, local_files_only=True)
            MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # resolving the class imports its module
        except (OSError, ValueError, KeyError) as exc:
            log.warning("preload: architecture of %s not imported (%s); the first job imports it", model_path, exc)
    return sorted(set(sys.modules) - before)


_job_threads: int | None = None  # set by ``warm_up``: the torch threads a job runs with (a fork inherits it)
_default_task: str | None = None  # set by ``configure``: the task of dataset rows without one (model.task)
_template_kwargs: dict[str, Any] = {}  # set by ``configure``: model.chat_template_kwargs


def configure(task: str | None, template_kwargs: dict[str, Any] | None = None) -> None:
    """The eval worker's model settings, set before rq forks (a work horse inherits them): the default task
    of rows without a ``task`` field and the chat template's variables. Jobs carry neither (admission)."""
    global _default_task, _template_kwargs
    _default_task, _template_kwargs = task, dict(template_kwargs or {})


def warm_up(model_path: str, dataset: str, batch_size: int = 64, device: str = "cpu") -> bool:
    """Run one small evaluation in the calling process, single-threaded, so the first-call work of torch
    and transformers (kernel dispatch, model-class and generation set-up) is done once, before rq forks,
    instead of in every work horse (a fresh horse's first evaluation took 0.6-1.0 s against 0.2 s warm).

    Single-threaded because a fork must not inherit a started OpenMP team (a child of a parent that ran a
    parallel op hangs in its first one); the jobs get the process's thread count back (``_job_threads``).
    False, with a log line, when the model or the dataset cannot be read yet: jobs then start cold. Only
    for CPU evaluation (``device`` "cpu"): on an accelerator the first-call work is the device's, which a
    forked child must set up itself (a CUDA context must never be created before a fork).
    """
    global _job_threads
    if device != "cpu":
        log.info("warm-up skipped: eval.device=%s (only CPU evaluation is warmed up before the fork)", device)
        return False
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        score_checkpoint(model_path, dataset, 2, batch_size, device)  # the job's own path, on two rows
    except Exception as exc:  # a model not built yet, a missing dataset: jobs start cold, nothing fails
        log.warning("warm-up skipped model=%s dataset=%s: %s: %s", model_path, dataset, type(exc).__name__, exc)
        torch.set_num_threads(threads)
        return False
    _job_threads = threads
    return True


def _connection() -> redis.Redis:
    job = get_current_job()
    if job is None:
        raise RuntimeError("run_eval_job needs a Redis connection: pass `r` or run it inside an rq worker")
    return job.connection


def score_rows(model: Any, tokenizer: Any, rows: list[dict[str, Any]], batch_size: int) -> dict[str, float]:
    """Greedy mean reward and accuracy over ``rows`` (tasks may be mixed; each row names its task)."""
    from shared.modeling import evaluate  # local: keep this module importable without torch
    from shared.tasks import get_task

    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_task[row["task"]].append(row)
    reward = accuracy = 0.0
    for name, task_rows in by_task.items():
        res = evaluate(model, tokenizer, get_task(name), task_rows, greedy=True, batch_size=batch_size,
                       template_kwargs=_template_kwargs)
        reward += res.reward_mean * res.n
        accuracy += res.accuracy * res.n
    n = max(len(rows), 1)
    return {"eval/reward": reward / n, "eval/accuracy": accuracy / n, "eval/n": float(len(rows))}


def run_eval_job(checkpoint_path: str, version: str, step: int, dataset: str, n_examples: int,
                 prefix: str, batch_size: int = 64, device: str = "cpu",
                 r: redis.Redis | None = None) -> dict[str, Any]:
    """Score one checkpoint on the held-out split and report it to ``{p}:metrics`` (service eval)."""
    conn = r if r is not None else _connection()
    try:
        return _score_and_report(conn, checkpoint_path, version, step, dataset, n_examples, prefix, batch_size,
                                 device)
    finally:
        conn.srem(pinned_key(prefix), str(checkpoint_path))


def _score_and_report(conn: redis.Redis, checkpoint_path: str, version: str, step: int, dataset: str,
                      n_examples: int, prefix: str, batch_size: int, device: str) -> dict[str, Any]:
    import torch

    if _job_threads is not None and torch.get_num_threads() != _job_threads:
        torch.set_num_threads(_job_threads)  # the warm-up ran single-threaded (``warm_up``)
    scores = score_checkpoint(checkpoint_path, dataset, n_examples, batch_size, device)
    metrics: dict[str, Any] = {**scores, "eval/version": str(version), "eval/step": int(step)}
    report_metrics(conn, Keys(prefix), "eval", metrics)
    log.info("evaluated version=%s step=%d accuracy=%.3f reward=%.3f n=%d", version, step,
             scores["eval/accuracy"], scores["eval/reward"], int(scores["eval/n"]))
    return metrics


def score_checkpoint(checkpoint_path: str, dataset: str, n_examples: int, batch_size: int,
                     device: str) -> dict[str, float]:
    """``score_rows`` of the checkpoint at ``checkpoint_path`` on the first ``n_examples`` rows of ``dataset``."""
    import torch

    from shared.modeling import load_model, load_tokenizer
    from shared.tasks import scan_dataset

    scanned = scan_dataset(dataset, task=_default_task)  # malformed rows skipped, as the prompt-buffer does
    if scanned.skipped:
        log.warning("eval dataset %s: %d malformed row(s) skipped, first: %s", dataset, scanned.skipped,
                    scanned.errors[0])
    rows = scanned.rows[:n_examples]
    if not rows:
        raise ValueError(f"eval.dataset {dataset}: no rows to evaluate")
    model = load_model(checkpoint_path, device=device)
    tokenizer = load_tokenizer(checkpoint_path)
    with torch.no_grad():
        return score_rows(model, tokenizer, rows, batch_size)
