"""Pure extraction of the report's series and summary from metric rows (no I/O, no plotting).

Rows are the flat dicts of ``metricslog`` (``service``, ``ts``, metric names -> values). Metric
names follow the services' conventions (``train/...``, ``eval/...``, ``staleness/...``,
``prompt_buffer/...``, and ``stats/<counter>`` snapshots of ``{p}:stats`` that ``dressage up``
reports as service ``ops``); each quantity is looked up under a short list of accepted names, so a
renamed metric shows up as "no data" in the report instead of a crash.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Row = Mapping[str, Any]

STEP = ("train/step", "step")
VERSION = ("train/version", "version", "weight_version", "eval/version")
REWARD = ("train/reward_mean", "train/reward", "reward_mean", "reward/mean")
LOGPROB_DIFF = ("train/train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff")
# the same over every response token, reported only under the non-last-version loss mask
LOGPROB_DIFF_ALL = ("train/train_rollout_logprob_abs_diff_all",)
EVAL_ACC = ("eval/accuracy", "eval_accuracy")
EVAL_REWARD = ("eval/reward", "eval/reward_mean")
GAP = ("train/version_gap", "staleness/version_gap")  # the trainer's gap is the one at training time  # prefixes of *_mean/_max/_hist
SPAN = ("staleness/version_span", "train/version_span")
TOOL_WELL_FORMED = ("train/tool_calls/well_formed_frac",)  # tool-using tasks only (shared.toolcalls)
TOOL_SAMPLE_FRAC = ("train/tool_calls/sample_frac",)  # share of samples that called a tool
# {p}:stats counters (ops rows carry them as stats/<name>) shown over time and in the summary.
COUNTERS = ("groups_produced", "groups_trained", "groups_dropped_stale", "groups_reenqueued",
            "groups_dead_lettered", "poison_dead_lettered", "groups_duplicate_discarded",
            "partial_rollout_rejected_groups")  # the span cap acting (failed groups, retried)


def number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            f = float(value)
        except ValueError:
            return None
        return f if math.isfinite(f) else None
    return None


def pick(row: Row, names: Sequence[str]) -> float | None:
    for name in names:
        if name in row:
            v = number(row[name])
            if v is not None:
                return v
    return None


def version_of(row: Row) -> float | None:
    """A row's weight version as a number (versions are integer strings: "0", "1", ...)."""
    return pick(row, VERSION)


@dataclass
class Series:
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)

    def add(self, x: float, y: float) -> None:
        self.x.append(x)
        self.y.append(y)

    def __bool__(self) -> bool:
        return bool(self.x)


def trainer_rows(rows: Iterable[Row]) -> list[Row]:
    return [r for r in rows if r.get("service") == "trainer" and pick(r, STEP) is not None]


def per_version(rows: Iterable[Row], names: Sequence[str]) -> Series:
    """Mean of a metric per weight version (several steps or evals may share one version)."""
    acc: dict[float, list[float]] = {}
    for r in rows:
        v, y = version_of(r), pick(r, names)
        if v is not None and y is not None:
            acc.setdefault(v, []).append(y)
    out = Series()
    for v in sorted(acc):
        out.add(v, sum(acc[v]) / len(acc[v]))
    return out


def per_step(rows: Iterable[Row], names: Sequence[str]) -> Series:
    out = Series()
    for r in trainer_rows(rows):
        s, y = pick(r, STEP), pick(r, names)
        if s is not None and y is not None:
            out.add(s, y)
    return out


def eval_rows(rows: Iterable[Row]) -> list[Row]:
    return [r for r in rows if pick(r, EVAL_ACC) is not None]


def histogram(rows: Iterable[Row], prefixes: Sequence[str]) -> Counter[float]:
    """Counts by value: exact ``<prefix>_hist`` maps ({"0": n, ...}, one count per trajectory) when
    reported, else the per-report ``<prefix>_max`` values (one per batch), so the shape is visible
    either way; ``is_exact_histogram`` tells which."""
    rows = list(rows)
    exact: Counter[float] = Counter()
    for r in rows:
        for p in prefixes:
            h = r.get(f"{p}_hist")
            if isinstance(h, Mapping):
                for k, n in h.items():
                    kv, nv = number(k), number(n)
                    if kv is not None and nv is not None:
                        exact[kv] += int(nv)
    if exact:
        return exact
    coarse: Counter[float] = Counter()
    for p in prefixes:  # one source only: the collector's and the trainer's gaps are taken at other times
        for r in rows:
            v = pick(r, [f"{p}_max"])
            if v is not None:
                coarse[v] += 1
        if coarse:
            break
    return coarse


def is_exact_histogram(rows: Iterable[Row], prefixes: Sequence[str]) -> bool:
    return any(isinstance(r.get(f"{p}_hist"), Mapping) for r in rows for p in prefixes)


def counters_over_time(rows: Iterable[Row]) -> dict[str, Series]:
    """``stats/<counter>`` snapshots (service ``ops``) as cumulative series against run time (s).

    A counter absent from a snapshot was never incremented (HINCRBY creates it): it counts as 0."""
    rows = [r for r in rows if r.get("service") == "ops"]
    t0 = min((number(r.get("ts")) or 0.0 for r in rows), default=0.0)
    out: dict[str, Series] = {c: Series() for c in COUNTERS}
    for r in rows:
        t = number(r.get("ts"))
        if t is None:
            continue
        for c in COUNTERS:
            v = number(r.get(f"stats/{c}", 0))
            if v is not None:
                out[c].add(t - t0, v)
    return {c: s for c, s in out.items() if s}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary(rows: Sequence[Row]) -> list[tuple[str, str]]:
    """The report's summary table as (label, value) pairs; "-" where there is no data."""

    def fmt(v: float | None, digits: int = 3) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    train = trainer_rows(rows)
    steps = [pick(r, STEP) or 0.0 for r in train]
    rewards = [y for y in (pick(r, REWARD) for r in train) if y is not None]
    k = max(1, len(rewards) // 5)
    evals = per_version(eval_rows(rows), EVAL_ACC)
    diffs = [y for y in (pick(r, LOGPROB_DIFF) for r in train) if y is not None]
    ts = [t for t in (number(r.get("ts")) for r in rows) if t is not None]
    duration = (max(ts) - min(ts)) if ts else None
    last_stats = next((r for r in reversed(rows) if r.get("service") == "ops"), {})
    versions = [v for v in (version_of(r) for r in train) if v is not None]
    out: list[tuple[str, str]] = [
        ("trainer steps", fmt(max(steps) if steps else None, 0)),
        ("final version", fmt(max(versions) if versions else None, 0)),
        (f"reward, first {k} steps", fmt(_mean(rewards[:k]))),
        (f"reward, last {k} steps", fmt(_mean(rewards[-k:]))),
        ("eval accuracy, first", fmt(evals.y[0] if evals else None) + (f" (v{evals.x[0]:.0f})" if evals else "")),
        ("eval accuracy, last", fmt(evals.y[-1] if evals else None) + (f" (v{evals.x[-1]:.0f})" if evals else "")),
        ("eval accuracy, best", fmt(max(evals.y) if evals else None)),
        ("train_rollout_logprob_abs_diff, mean", fmt(_mean(diffs), 4)),
    ]
    for label, keys in (("well-formed tool calls", TOOL_WELL_FORMED), ("samples calling a tool", TOOL_SAMPLE_FRAC)):
        ys = [y for y in (pick(r, keys) for r in train) if y is not None]
        if ys:  # a tool-using task: how often the model's tool calls parse, how often it calls
            j = max(1, len(ys) // 5)
            out += [(f"{label}, first {j} steps", fmt(_mean(ys[:j]))), (f"{label}, last {j} steps", fmt(_mean(ys[-j:])))]
    for c in COUNTERS:  # a counter never incremented is absent from {p}:stats: 0 once a snapshot exists
        value = number(last_stats.get(f"stats/{c}", 0 if last_stats else None))
        out.append((c.replace("_", " "), fmt(value, 0)))
    out.append(("duration (s)", fmt(duration, 0)))
    if duration and steps:
        out.append(("trainer steps per minute", fmt(60 * len(steps) / duration, 2)))
    return out


def format_table(pairs: Sequence[tuple[str, str]]) -> str:
    width = max((len(k) for k, _ in pairs), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in pairs)
