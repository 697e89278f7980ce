"""Where a run's wall-clock goes, from its metric rows (pure: rows in, fractions out).

Sources (all cumulative, so any two samples give the rate in between):
* the trainer's ``time/{wait,train,checkpoint,publish,other,wall}_s`` on every step
  (``shared.phases``: the phases never overlap, so they and ``other`` sum to ``wall`` exactly;
  ``other`` is what the four named phases do not explain: metric reports, heartbeats, decoding);
* the ``ops`` rows of ``dressage up``: ``engine/busy_s`` (a forward pass running),
  ``proxy/weight_update_s`` (the proxy paused for a weight load) and ``cpu/<service>_s`` (CPU
  seconds of each service's processes), sampled every few seconds; CPU seconds per second are the
  cores a service used, which on a 2-core machine says who takes the cores from rollout and training;
* the rollout chain of a batch: ``prompt_buffer/admit_lag_s`` (a version's publication to the first
  groups it admits) and, per batch from the collector, the slowest group's prompt-queue wait
  (``staleness/time_prompt_queue_s_max``) and rollout (``staleness/time_rollout_s_max``): at η = 1 a
  batch has one trainer step to go through the chain, so a chain longer than a step is trainer wait;
* the rollout workers' ``rollout/group_seconds`` per finished group: a group's wall time is spent
  waiting on the proxy (its model calls), so their sum over the worker slots
  (workers × ``rollout.concurrency``) and the trainer loop's length is the slots' busy fraction
  (groups that finished while the loop ran; without trainer rows, the whole span of the rows).

The weight-publication pause is the trainer's checkpoint + publish fractions plus the proxy's
update fraction (pause, engine load, resume): the two happen in different processes, and adding
them is the conservative reading. verl's idle ratio and prime-rl's wait-for-batch timer are the models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.config import LOCAL_SERVICES
from tools.reports.series import Row, number, trainer_rows

TRAINER_PHASES = ("wait", "train", "checkpoint", "publish", "other")
# The rollout chain's links: column name -> (the metric averaged over the loop's reports, its label).
CHAIN = {"admit_lag": ("prompt_buffer/admit_lag_s", "admission after a publication"),
         "batch_queue_max": ("staleness/time_prompt_queue_s_max", "slowest group's queue"),
         "batch_rollout_max": ("staleness/time_rollout_s_max", "slowest group's rollout")}


@dataclass(frozen=True)
class TimeSplit:
    trainer_wall_s: float | None = None  # the trainer loop's wall-clock (since its first read)
    trainer: dict[str, float] = field(default_factory=dict)  # phase -> fraction of trainer_wall_s
    trainer_seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    engine_busy: float | None = None  # fraction of the sampled window with a forward pass running
    proxy_pause: float | None = None  # fraction of the sampled window the proxy was paused for weights
    weight_updates: int | None = None  # weight loads the proxy applied
    group_seconds_mean: float | None = None  # mean wall time of one group attempt (waiting on the proxy)
    worker_slot_busy: float | None = None  # Σ group seconds / (slots × run length)
    cores: dict[str, float] = field(default_factory=dict)  # service -> CPU cores used on average (loop window)
    chain: dict[str, float] = field(default_factory=dict)  # CHAIN link -> mean seconds per batch (loop window)

    @property
    def engine_idle(self) -> float | None:
        return None if self.engine_busy is None else max(0.0, 1.0 - self.engine_busy)

    @property
    def publication_pause(self) -> float | None:
        """Checkpoint + publish (trainer) + proxy pause, as a fraction of wall-clock."""
        if not self.trainer:
            return None
        return self.trainer["checkpoint"] + self.trainer["publish"] + (self.proxy_pause or 0.0)

    def explained(self) -> float | None:
        """Fraction of the trainer's wall-clock that the four named phases account for."""
        if not self.trainer:
            return None
        return sum(self.trainer[p] for p in TRAINER_PHASES if p != "other")


def _at(pts: Sequence[tuple[float, float]], t: float) -> float:
    """A cumulative counter at time ``t``, linearly interpolated between its samples (clamped at the ends)."""
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:], strict=False):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return pts[-1][1]


def _rate(rows: Sequence[Row], name: str, start: float | None = None, end: float | None = None) -> float | None:
    """Increase of a cumulative ``name`` per second over [start, end] (default: first to last sample).

    Samples come every few seconds: the counter is interpolated at ``start`` and ``end``, so a short
    trainer loop is not measured over the much longer span of the samples around it."""
    pts = [(t, v) for t, v in ((number(r.get("ts")), number(r.get(name))) for r in rows)
           if t is not None and v is not None]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    lo = pts[0][0] if start is None else max(start, pts[0][0])
    hi = pts[-1][0] if end is None else min(end, pts[-1][0])
    if hi <= lo:
        return None
    return max(0.0, (_at(pts, hi) - _at(pts, lo)) / (hi - lo))


def covering(rows: Sequence[Row], start: float | None, end: float | None) -> list[Row]:
    """The rows from the last one at or before ``start`` to the first one at or after ``end`` (all if unknown)."""
    if start is None or end is None:
        return list(rows)
    ts = [number(r.get("ts")) or 0.0 for r in rows]
    first = max((i for i, t in enumerate(ts) if t <= start), default=0)
    last = min((i for i, t in enumerate(ts) if t >= end), default=len(rows) - 1)
    return list(rows[first:last + 1])


def decompose(rows: Sequence[Row], slots: int | None = None) -> TimeSplit:
    """The run's time decomposition; ``slots`` = rollout workers × concurrency (None: not computed).

    The engine's and proxy's fractions are taken over the trainer loop's lifetime (the samples that
    cover it), so start-up and the wait for a last evaluation do not dilute them."""
    last = next((r for r in reversed(trainer_rows(rows)) if number(r.get("time/wall_s"))), None)
    wall = number(last.get("time/wall_s")) if last else None
    seconds: dict[str, float] = {}
    if last is not None and wall:
        for p in TRAINER_PHASES:
            seconds[p] = number(last.get(f"time/{p}_s")) or 0.0
    end = number(last.get("ts")) if last else None
    start = end - wall if end is not None and wall else None
    ops = covering([r for r in rows if r.get("service") == "ops"], start, end)
    updates = [number(r.get("proxy/weight_updates")) for r in ops]
    if start is not None and end is not None:  # the workers' groups that finished while the trainer ran
        in_loop = [r for r in rows if start <= (number(r.get("ts")) or 0.0) <= end]
        length = end - start
    else:
        in_loop = list(rows)
        ts = [t for t in (number(r.get("ts")) for r in rows) if t is not None]
        length = (max(ts) - min(ts)) if ts else 0.0
    groups = [v for v in (number(r.get("rollout/group_seconds")) for r in in_loop) if v is not None]
    chain = {}
    for link, (metric, _) in CHAIN.items():
        values = [v for v in (number(r.get(metric)) for r in in_loop) if v is not None]
        if values:
            chain[link] = sum(values) / len(values)
    return TimeSplit(
        trainer_wall_s=wall,
        trainer={p: s / wall for p, s in seconds.items()} if wall else {},
        trainer_seconds=seconds,
        engine_busy=_rate(ops, "engine/busy_s", start, end),
        proxy_pause=_rate(ops, "proxy/weight_update_s", start, end),
        weight_updates=int(max(u for u in updates if u is not None)) if any(u is not None for u in updates) else None,
        group_seconds_mean=sum(groups) / len(groups) if groups else None,
        worker_slot_busy=(sum(groups) / (slots * length)) if slots and groups and length > 0 else None,
        cores={s: c for s in LOCAL_SERVICES if (c := _rate(ops, f"cpu/{s}_s", start, end)) is not None},
        chain=chain,
    )


def columns(split: TimeSplit) -> dict[str, float | None]:
    """Flat fields for summary.csv (fractions in [0, 1], seconds as named)."""
    out: dict[str, float | None] = {f"trainer_{p}_frac": split.trainer.get(p) for p in TRAINER_PHASES}
    out.update({"trainer_wall_s": split.trainer_wall_s, "engine_busy_frac": split.engine_busy,
                "engine_idle_frac": split.engine_idle, "proxy_pause_frac": split.proxy_pause,
                "publication_pause_frac": split.publication_pause, "group_seconds_mean": split.group_seconds_mean,
                "worker_slot_busy_frac": split.worker_slot_busy})
    out.update({f"cores_{s.replace('-', '_')}": split.cores.get(s) for s in LOCAL_SERVICES})
    out["cores_total"] = sum(split.cores.values()) if split.cores else None
    out.update({f"{link}_ms": (1000 * split.chain[link] if link in split.chain else None) for link in CHAIN})
    return out


def summary_pairs(split: TimeSplit) -> list[tuple[str, str]]:
    """Lines for the report's summary table ("-" where there is no data)."""
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f} %"

    wall = "-" if split.trainer_wall_s is None else f"{split.trainer_wall_s:.0f} s"
    out = [("trainer wall-clock (loop)", wall)]
    out += [(f"trainer {p} {'(waiting for a batch)' if p == 'wait' else ''}".rstrip(), pct(split.trainer.get(p)))
            for p in TRAINER_PHASES]
    out += [("engine busy / idle", f"{pct(split.engine_busy)} / {pct(split.engine_idle)}"),
            ("proxy paused for weight updates", pct(split.proxy_pause)
             + ("" if split.weight_updates is None else f" ({split.weight_updates} updates)")),
            ("weight publication pause (checkpoint + publish + proxy)", pct(split.publication_pause)),
            ("rollout group wait on the proxy, mean",
             "-" if split.group_seconds_mean is None else f"{split.group_seconds_mean:.2f} s"),
            ("rollout worker slots busy", pct(split.worker_slot_busy)),
            ("rollout chain per batch: admission after a publication / slowest group's queue / its rollout",
             " / ".join("-" if link not in split.chain else f"{1000 * split.chain[link]:.1f} ms" for link in CHAIN)),
            ("CPU cores used (services)", ", ".join(f"{s} {c:.2f}" for s, c in split.cores.items())
             + (f"; total {sum(split.cores.values()):.2f}" if split.cores else "-"))]
    return out


def one_line(split: TimeSplit) -> str:
    """For ``dressage status``: the trainer's split, the engine's busy and idle fractions, the proxy's
    pause and how long a rollout worker waits on the proxy for one group."""
    if not split.trainer and split.engine_busy is None:
        return "no timing data yet"
    parts = [f"trainer {p} {100 * split.trainer[p]:.0f}%" for p in TRAINER_PHASES if p in split.trainer]
    if split.engine_busy is not None and split.engine_idle is not None:
        parts.append(f"engine busy {100 * split.engine_busy:.0f}% idle {100 * split.engine_idle:.0f}% (last minute)")
    if split.proxy_pause is not None:
        parts.append(f"proxy paused {100 * split.proxy_pause:.1f}%")
    if split.group_seconds_mean is not None:
        parts.append(f"workers wait {split.group_seconds_mean:.2f}s per group on the proxy")
    return "  ".join(parts)
