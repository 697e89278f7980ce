"""Which rq jobs the eval-worker agrees to run: the project's evaluation function, nothing else.

Invariant: a job runs only if ALL of these hold, checked in the work horse before any import of
the job's function name (``AdmittedJob.func``) and before any callback is resolved:

* its function name is exactly ``shared.evaluation.JOB_FUNCTION``, with no bound instance;
* it has no positional arguments and exactly the keyword arguments ``enqueue_eval`` writes, each
  of the type ``enqueue_eval`` writes (so no ``r``, no extra names, no nested structures);
* ``checkpoint_path`` resolves (symlinks followed) inside the checkpoint root and ``dataset``
  inside the data root;
* it names no success/failure/stopped callback (rq would import and call those too).

Anything else raises ``JobRefused``: rq records the job as failed with that message and the
worker keeps serving. Pure: no Redis here; ``services.eval_worker.worker`` wires it into rq.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.edge import within
from shared.errors import DressageError
from shared.evaluation import JOB_FUNCTION

# The keyword arguments enqueue_eval writes, with their JSON types.
JOB_KWARGS: dict[str, type] = {"checkpoint_path": str, "version": str, "step": int, "dataset": str,
                               "n_examples": int, "prefix": str, "batch_size": int, "device": str}
MAX_TEXT = 4096  # characters in any string argument


class JobRefused(DressageError):
    """An rq job the eval-worker will not run (the message says why; never the job's payload)."""


def confined(path: str, root: str, what: str) -> Path:
    """``path`` resolved (symlinks followed; relative to the working directory, as the job opens it)
    if it lies inside ``root`` resolved; else ``JobRefused``."""
    full = within(path, [root])
    if full is None:
        raise JobRefused(f"{what} is outside its root {what}_root")
    return full


@dataclass(frozen=True)
class JobPolicy:
    """The roots an evaluation may read from (the worker's own config, never the job's)."""

    checkpoint_root: str
    data_root: str

    def check(self, func_name: str | None, has_instance: bool, args: Sequence[Any],
              kwargs: Mapping[str, Any], callbacks: Sequence[str | None]) -> None:
        if func_name != JOB_FUNCTION or has_instance:
            raise JobRefused(f"function {str(func_name)[:200]!r} is not the evaluation function {JOB_FUNCTION}")
        if any(callbacks):
            raise JobRefused("job callbacks are not allowed")
        if args:
            raise JobRefused("positional arguments are not allowed")
        if set(kwargs) != set(JOB_KWARGS):
            extra = sorted(set(kwargs) - set(JOB_KWARGS))[:5]
            missing = sorted(set(JOB_KWARGS) - set(kwargs))[:5]
            raise JobRefused(f"arguments differ from enqueue_eval's: unexpected {extra}, missing {missing}")
        for name, kind in JOB_KWARGS.items():
            value = kwargs[name]
            if type(value) is not kind:
                raise JobRefused(f"argument {name} must be {kind.__name__}")
            if isinstance(value, str) and (len(value) > MAX_TEXT or "\x00" in value):
                raise JobRefused(f"argument {name} is too long or holds a NUL byte")
        confined(kwargs["checkpoint_path"], self.checkpoint_root, "checkpoint")
        confined(kwargs["dataset"], self.data_root, "dataset")
