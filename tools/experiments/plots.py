"""An experiment's figures: per variant, the mean across seeds with its 95 % band.

* ``learning_vs_step.png`` / ``learning_vs_wallclock.png``: eval accuracy and training reward
  against trainer step and against the trainer's wall-clock (a seed's value at time t is its latest
  one at or before t; the time axis ends where the shortest seed of the variant ends);
* ``logprob_diff.png``: ``train_rollout_logprob_abs_diff`` per step;
* ``version_gap.png``: the trainer's exact version-gap histogram, pooled over seeds, as fractions;
* ``version_span.png``: the same for the version span of trained trajectories (distinct versions
  over their tokens; what the partial-rollout span cap bounds);
* ``time_split.png``: where the wall-clock went (trainer phases, engine busy) per variant;
* ``keep_versions.png``: the batch window in force (the collector's ``staleness/keep_versions``) against
  the trainer's wall-clock, drawn when some run's window moved (the adaptive window).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from tools.experiments import summary as summ  # noqa: E402
from tools.experiments.spec import Spec  # noqa: E402
from tools.reports import series  # noqa: E402
from tools.reports.intervals import mean_interval  # noqa: E402
from tools.reports.series import Row  # noqa: E402
from tools.reports.timing import TRAINER_PHASES  # noqa: E402

Curve = list[tuple[float, float]]
GRID = 60


def band_by_x(curves: Sequence[Curve]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean and 95 % band at each x that at least two seeds share (every x with one seed)."""
    by_x: dict[float, list[float]] = {}
    for c in curves:
        for x, y in c:
            by_x.setdefault(x, []).append(y)
    need = 2 if len(curves) > 1 else 1
    xs, mean, lo, hi = [], [], [], []
    for x in sorted(by_x):
        ys = by_x[x]
        if len(ys) < need:
            continue
        iv = mean_interval(ys)
        xs.append(x)
        mean.append(iv.estimate)
        lo.append(iv.low if iv.low is not None else iv.estimate)
        hi.append(iv.high if iv.high is not None else iv.estimate)
    return xs, mean, lo, hi


def on_grid(curves: Sequence[Curve]) -> list[Curve]:
    """Step-function resampling of each curve onto a shared time grid [0, shortest end]."""
    curves = [sorted(c) for c in curves if c]
    if not curves:
        return []
    end = min(c[-1][0] for c in curves)
    grid = [end * i / (GRID - 1) for i in range(GRID)]
    out = []
    for c in curves:
        xs = [x for x, _ in c]
        pts = []
        for t in grid:
            i = bisect_right(xs, t) - 1
            if i >= 0:
                pts.append((t, c[i][1]))
        out.append(pts)
    return out


def _draw(ax: Any, curves: Sequence[Curve], label: str, color: str) -> None:
    xs, mean, lo, hi = band_by_x(curves)
    if not xs:
        return
    ax.plot(xs, mean, label=f"{label} (n={len(curves)})", color=color, marker="o" if len(xs) < 15 else None, ms=3)
    ax.fill_between(xs, lo, hi, color=color, alpha=0.2)


def _curves(spec: Spec, rows: Sequence[dict[str, Any]], metrics: Mapping[str, Sequence[Row]]
            ) -> dict[str, dict[str, list[Curve]]]:
    """variant -> kind -> one curve per seed."""
    out: dict[str, dict[str, list[Curve]]] = {}
    for r in rows:
        m = metrics.get(str(r.get("run_dir"))) or []
        published, steps = summ.publish_clock(m), summ.step_clock(m)
        evals = summ.eval_curve(m)
        rewards = summ.reward_curve(m)
        diffs = series.per_step(m, series.LOGPROB_DIFF)
        kinds = out.setdefault(str(r["variant"]), {})
        kinds.setdefault("acc_step", []).append([(float(v), a) for v, a in evals])
        kinds.setdefault("acc_wall", []).append([(published[v], a) for v, a in evals if v in published])
        kinds.setdefault("reward_step", []).append([(float(s), y) for s, y in rewards])
        kinds.setdefault("reward_wall", []).append([(steps[s], y) for s, y in rewards if s in steps])
        kinds.setdefault("diff_step", []).append(list(zip(diffs.x, diffs.y, strict=True)))
        kinds.setdefault("keep_wall", []).append(window_curve(m))
    return out


def window_curve(m: Sequence[Row]) -> Curve:
    """(trainer wall-clock, keep_versions in force) from the collector's reports."""
    trainer = series.trainer_rows(m)
    first = trainer[0] if trainer else None
    ts0, wall0 = (series.number(first.get("ts")), series.number(first.get("time/wall_s"))) if first else (None, None)
    if ts0 is None or wall0 is None:
        return []
    out = []
    for r in m:
        k, ts = series.number(r.get("staleness/keep_versions")), series.number(r.get("ts"))
        if r.get("service") == "group-collector" and k is not None and ts is not None and ts >= ts0 - wall0:
            out.append((ts - (ts0 - wall0), k))
    return out


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_experiment(spec: Spec, rows: Sequence[dict[str, Any]], metrics: Mapping[str, Sequence[Row]],
                    out: Path) -> list[Path]:
    curves = _curves(spec, rows, metrics)
    colors = {v: f"C{i}" for i, v in enumerate(spec.variants)}
    pngs = []
    for axis, suffix, xlabel in (("step", "step", "trainer step"), ("wall", "wallclock", "trainer wall-clock (s)")):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
        for v, kinds in curves.items():
            acc = kinds.get(f"acc_{axis}", [])
            rew = kinds.get(f"reward_{axis}", [])
            _draw(a1, on_grid(acc) if axis == "wall" else acc, v, colors.get(v, "gray"))
            _draw(a2, on_grid(rew) if axis == "wall" else rew, v, colors.get(v, "gray"))
        a1.set(title="eval accuracy (mean, 95 % band)", xlabel=xlabel if axis == "wall" else "weight version",
               ylabel="accuracy")
        a2.set(title="training reward (mean, 95 % band)", xlabel=xlabel, ylabel="reward")
        for a in (a1, a2):
            if a.lines:
                a.legend(fontsize=8)
        pngs.append(_save(fig, out / f"learning_vs_{suffix}.png"))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for v, kinds in curves.items():
        _draw(ax, kinds.get("diff_step", []), v, colors.get(v, "gray"))
    ax.set(title="train_rollout_logprob_abs_diff", xlabel="trainer step", ylabel="mean |Δ logprob|")
    if ax.lines:
        ax.legend(fontsize=8)
    pngs.append(_save(fig, out / "logprob_diff.png"))
    pngs.append(plot_histogram(spec, rows, metrics, out / "version_gap.png", colors, series.GAP,
                               "version gap at training time (pooled over seeds)", "versions behind"))
    pngs.append(plot_histogram(spec, rows, metrics, out / "version_span.png", colors, series.SPAN,
                               "version span of trajectories (pooled over seeds)", "distinct versions"))
    pngs.append(plot_time_split(spec, rows, out))
    windows = {v: kinds.get("keep_wall", []) for v, kinds in curves.items()}
    if any(len({k for _, k in c}) > 1 for cs in windows.values() for c in cs):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for v, cs in windows.items():
            _draw(ax, on_grid([c for c in cs if c]), v, colors.get(v, "gray"))
        ax.set(title="batch window in force (mean, 95 % band)", xlabel="trainer wall-clock (s)",
               ylabel="keep_versions (0 = off)")
        if ax.lines:
            ax.legend(fontsize=8)
        pngs.append(_save(fig, out / "keep_versions.png"))
    return pngs


def plot_histogram(spec: Spec, rows: Sequence[dict[str, Any]], metrics: Mapping[str, Sequence[Row]], path: Path,
                   colors: dict[str, str], prefixes: Sequence[str], title: str, xlabel: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / max(1, len(spec.variants))
    for i, v in enumerate(spec.variants):
        hist: Counter[float] = Counter()
        for r in rows:
            if r.get("variant") == v:
                hist.update(series.histogram(metrics.get(str(r.get("run_dir"))) or [], prefixes))
        total = sum(hist.values())
        if total:
            xs = sorted(hist)
            ax.bar([x + i * width for x in xs], [hist[x] / total for x in xs], width=width, label=v,
                   color=colors.get(v, "gray"))
    ax.set(title=title, xlabel=xlabel, ylabel="fraction")
    if ax.patches:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_time_split(spec: Spec, rows: Sequence[dict[str, Any]], out: Path) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    bottom = [0.0] * len(spec.variants)
    for phase in TRAINER_PHASES:
        heights = []
        for v in spec.variants:
            vals = summ.values(rows, v, f"trainer_{phase}_frac")
            heights.append(sum(vals) / len(vals) if vals else 0.0)
        a1.bar(spec.variants, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    a1.set(title="trainer wall-clock by phase (mean over seeds)", ylabel="fraction", ylim=(0, 1.05))
    a1.legend(fontsize=8)
    busy = [summ.values(rows, v, "engine_busy_frac") for v in spec.variants]
    means = [sum(b) / len(b) if b else 0.0 for b in busy]
    errs = [0.0 if len(b) < 2 else (mean_interval(b).high or m) - m for b, m in zip(busy, means, strict=True)]
    a2.bar(spec.variants, means, yerr=errs, capsize=4, color="tab:orange")
    a2.set(title="engine busy fraction (95 % interval)", ylabel="fraction", ylim=(0, 1.05))
    return _save(fig, out / "time_split.png")
