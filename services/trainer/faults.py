"""Fault injection for crash tests: ``DRESSAGE_FAULT=<point>:<n>[,<point>:<n>...]``.

When the trainer reaches ``<point>`` for the ``n``-th time (``n`` defaults to 1) the process
kills itself with SIGKILL — no ``finally`` blocks, no flushing, exactly like ``kill -9`` at that
instant. Unset (the default) it costs one dict lookup. Points, in the order a step reaches them:

* ``between_minibatches`` an optimizer step of a batch done, not its last one (``train.minibatches_per_batch``
  or ``epochs_per_batch`` > 1): the weights hold part of the batch, nothing written yet
* ``after_step``        the batch's optimizer steps done, nothing written yet
* ``mid_checkpoint``    checkpoint files written into the temporary directory, not renamed
* ``after_checkpoint``  checkpoint renamed into place, batches not yet acknowledged
* ``after_ack``         batches acknowledged, version not yet published
* ``mid_snapshot``      a weights-only snapshot written into its temporary directory, not renamed
* ``after_snapshot``    a snapshot renamed into place, its version not yet published
* ``follower_mid_step`` under torchrun, a rank > 0 between its first forward and backward of a step
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter

log = logging.getLogger(__name__)

ENV = "DRESSAGE_FAULT"
POINTS = ("between_minibatches", "after_step", "mid_checkpoint", "after_checkpoint", "after_ack", "mid_snapshot",
          "after_snapshot", "follower_mid_step")
_hits: Counter[str] = Counter()


def parse_faults(spec: str | None) -> dict[str, int]:
    """``"after_checkpoint:2,after_step"`` -> ``{"after_checkpoint": 2, "after_step": 1}``."""
    out: dict[str, int] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        name, _, count = item.strip().partition(":")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {name!r}; valid: {', '.join(POINTS)}")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"{ENV}: {item!r}: the count after ':' must be an integer") from None
        if n < 1:
            raise ValueError(f"{ENV}: {item!r}: the count must be >= 1")
        out[name] = n
    return out


def fault_point(name: str) -> None:
    """SIGKILL this process if ``DRESSAGE_FAULT`` asks for it at this (n-th) hit of ``name``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want = parse_faults(spec).get(name)
    if want is None:
        return
    _hits[name] += 1
    if _hits[name] == want:
        log.error("fault injection: SIGKILL at %s (hit %d)", name, want)
        os.kill(os.getpid(), signal.SIGKILL)
