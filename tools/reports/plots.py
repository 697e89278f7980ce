"""The report's PNG figures (matplotlib, Agg backend: no display needed), one file per figure.

Each ``plot_*`` takes metric rows, writes ``<out>/<name>.png`` and returns its path; a figure
without data still renders, with a "no data yet" note, so a report of a young run is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless, deterministic

import matplotlib.pyplot as plt  # noqa: E402

from tools.reports import series as S  # noqa: E402

Rows = Sequence[S.Row]


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} data yet", ha="center", va="center", transform=ax.transAxes, color="gray")


def _save(fig: Any, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_learning(rows: Rows, out: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    reward = S.per_version(S.trainer_rows(rows), S.REWARD)
    if reward:
        ax1.plot(reward.x, reward.y, marker="o", ms=3)
    else:
        _empty(ax1, "reward")
    ax1.set(title="training reward per version", xlabel="weight version", ylabel="mean reward")
    acc = S.per_version(S.eval_rows(rows), S.EVAL_ACC)
    if acc:
        ax2.plot(acc.x, acc.y, marker="o", color="tab:green")
        ax2.set_ylim(-0.02, 1.02)
    else:
        _empty(ax2, "evaluation")
    ax2.set(title="eval accuracy per version (greedy, held-out)", xlabel="weight version", ylabel="accuracy")
    return _save(fig, out, "learning")


def plot_logprob_diff(rows: Rows, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    diff = S.per_step(rows, S.LOGPROB_DIFF)
    if diff:
        ax.plot(diff.x, diff.y, color="tab:purple")
    else:
        _empty(ax, "logprob")
    ax.set(title="train_rollout_logprob_abs_diff", xlabel="trainer step", ylabel="mean |Δ logprob|")
    return _save(fig, out, "logprob_diff")


def plot_staleness(rows: Rows, out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, prefixes, title in ((axes[0], S.GAP, "version gap (trajectory vs current)"),
                                (axes[1], S.SPAN, "versions spanned per trajectory")):
        hist = S.histogram(rows, prefixes)
        if hist:
            xs = sorted(hist)
            ax.bar(xs, [hist[x] for x in xs], width=0.8)
            ax.set_xticks(xs)
        else:
            _empty(ax, "staleness")
        unit = "trajectories" if S.is_exact_histogram(rows, prefixes) else "batches (by their maximum)"
        ax.set(title=title, xlabel="versions", ylabel=unit)
    return _save(fig, out, "staleness")


def plot_pipeline(rows: Rows, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    shown = ("groups_dropped_stale", "groups_reenqueued", "groups_dead_lettered", "poison_dead_lettered")
    over_time = S.counters_over_time(rows)
    drawn = False
    for name in shown:
        s = over_time.get(name)
        if s:
            label = name.replace("groups_", "").replace("_", " ")
            ax.plot(s.x, s.y, label=f"{label} ({s.y[-1]:.0f})")
            drawn = True
    if drawn:
        ax.legend(fontsize=8)
        ax.set_ylim(0, max(1.0, ax.get_ylim()[1]))  # counters start at 0; all-zero lines sit on the axis
    else:
        _empty(ax, "pipeline")
    ax.set(title="drops, retries, dead letters (cumulative)", xlabel="seconds since start", ylabel="groups")
    return _save(fig, out, "pipeline")


def plot_all(rows: Rows, out: Path) -> list[Path]:
    return [plot_learning(rows, out), plot_logprob_diff(rows, out), plot_staleness(rows, out),
            plot_pipeline(rows, out)]
