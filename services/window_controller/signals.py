"""What the controller measures, read from Redis: new trainer steps and the collector's counters.

``SignalReader.read()`` returns the :class:`~services.window_controller.policy.Signals` of the time
since its previous call or ``prime()`` (a first call without ``prime`` only sets the cursors), so a
restarted controller never acts on history:

* ``logprob_diff``, ``mismatch_kl``, ``ess``: means of ``train/train_rollout_logprob_abs_diff``,
  ``train/mismatch_kl`` and ``train/ess`` over the trainer's new ``{p}:metrics`` entries (the policy
  steers by the one ``window_controller.signal`` names; the decision log keeps all three);
* ``wait_fraction``: growth of the trainer's cumulative ``time/wait_s`` over growth of its
  ``time/wall_s`` (``shared.phases``), from the last entry seen before to the newest one; a restarted
  trainer (wall-clock went back) is measured over its new entries only;
* ``drop_rate``: growth of ``{p}:stats`` ``groups_dropped_stale`` over that plus the growth of
  ``groups_batched``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from services.window_controller.policy import Signals
from shared import stats
from shared.keys import Keys

DIFF = "train/train_rollout_logprob_abs_diff"
MISMATCH_KL, ESS = "train/mismatch_kl", "train/ess"
WAIT, WALL = "time/wait_s", "time/wall_s"


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)


def _number(fields: Mapping[str, str], name: str) -> float | None:
    try:
        value = json.loads(fields[name])
    except (KeyError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mean(rows: Sequence[Mapping[str, str]], name: str) -> float | None:
    values = [v for v in (_number(r, name) for r in rows) if v is not None]
    return sum(values) / len(values) if values else None


def wait_fraction(before: Mapping[str, str] | None, rows: Sequence[Mapping[str, str]]) -> float | None:
    """Share of the trainer's wall-clock spent waiting between ``before`` (or rows[0]) and rows[-1]."""
    if not rows:
        return None
    first = before if before is not None else rows[0]
    w0, t0 = _number(first, WAIT), _number(first, WALL)
    w1, t1 = _number(rows[-1], WAIT), _number(rows[-1], WALL)
    if None in (w0, t0, w1, t1):
        return None
    assert w0 is not None and t0 is not None and w1 is not None and t1 is not None
    if t1 < t0:  # the trainer restarted (its clock began again): measure over the entries after that
        return wait_fraction(rows[0], rows[1:]) if len(rows) > 1 else None
    span = t1 - t0
    return None if span <= 0 else min(1.0, max(0.0, (w1 - w0) / span))


class SignalReader:
    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self.cursor: str | None = None  # last {p}:metrics id read (None: not started)
        self.last_trainer: dict[str, str] | None = None  # newest trainer entry seen so far
        self.counts: tuple[int, int] | None = None  # (groups_dropped_stale, groups_batched) at the last read

    def _counts(self) -> tuple[int, int]:
        dropped, batched = self.r.hmget(stats.key(self.keys), [stats.GROUPS_DROPPED_STALE, stats.GROUPS_BATCHED])
        return int(dropped or 0), int(batched or 0)

    def prime(self) -> None:
        """Start measuring now: later reads cover only what happens from here on."""
        if self.cursor is None:
            last = self.r.xrevrange(self.keys.metrics, count=1)
            self.cursor = _text(last[0][0]) if last else "0-0"
        if self.counts is None:
            self.counts = self._counts()

    def _new_trainer_rows(self) -> list[dict[str, str]]:
        if self.cursor is None:
            self.prime()
            return []
        rows: list[dict[str, str]] = []
        while True:
            page = self.r.xrange(self.keys.metrics, min=f"({self.cursor}", max="+", count=1000)
            for entry_id, raw in page:
                self.cursor = _text(entry_id)
                fields = {_text(k): _text(v) for k, v in raw.items()}
                if fields.get("service") == "trainer" and DIFF in fields:
                    rows.append(fields)
            if len(page) < 1000:
                return rows

    def read(self) -> Signals:
        rows = self._new_trainer_rows()
        counts = self._counts()
        before, self.counts = self.counts, counts
        drop_rate = None
        if before is not None:
            dropped, batched = counts[0] - before[0], counts[1] - before[1]
            drop_rate = dropped / (dropped + batched) if dropped + batched > 0 and dropped >= 0 else None
        signals = Signals(logprob_diff=_mean(rows, DIFF), wait_fraction=wait_fraction(self.last_trainer, rows),
                          drop_rate=drop_rate, steps=len(rows), mismatch_kl=_mean(rows, MISMATCH_KL),
                          ess=_mean(rows, ESS))
        if rows:
            self.last_trainer = rows[-1]
        return signals
