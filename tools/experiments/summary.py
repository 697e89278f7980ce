"""One experiment run's row of summary.csv, and the per-variant aggregates (pure: rows in, values out).

Clock: a run's times are the trainer loop's own wall-clock (``time/wall_s`` on each step, zero
when the trainer starts reading batches -- right after it publishes version 0, before which the
prompt-buffer releases nothing). Process start-up (model loads, Redis, ports) is the same for
every variant and is left out, so it cannot dilute a ratio; it is reported as ``startup_s``.

* ``wall_to_k_s``: trainer wall-clock at step K (K = the spec's step target, else the last step);
* ``time_to_acc_<X>``: wall-clock at which the first *trained* version (>= 1) whose greedy eval
  accuracy is >= X was published (the eval itself runs later; the time the model existed is what
  counts). Version 0, the starting model, is left out: a target it already meets says nothing about
  training, and ``initial_eval_acc`` shows it;
* ``steps_to_acc_<X>``: the trainer step at which that same version was published -- the sample
  efficiency behind the wall-clock figure (a window that drops groups can take fewer steps and more
  time);
* ``window_drop_share`` / ``span_reject_share`` / ``reenqueue_share``: the share of the attempts the
  collector decided on (trained + dropped stale + rejected by the span cap) that the window dropped /
  the span cap rejected / that were re-enqueued as a new attempt, and ``dead_letter_share`` the share
  of new groups given up: whether a staleness control acted;
* ``reward_auc``: the area under the training-reward curve over trainer steps (unit width per step),
  so a run that learns sooner has a larger area at equal steps;
* ``reward_first`` / ``reward_last``: the mean training reward over the first and the last fifth of
  the steps (as ``dressage report``), and ``reward_gain`` their difference -- across seeds, the
  interval of the gain says whether a run learned at all;
* ``tool_calls_first`` / ``tool_calls_last`` / ``tool_calls_gain``: the same for the share of
  samples that called a tool (``train/tool_calls/sample_frac``; tool-using tasks only);
* ``window_changes`` / ``keep_versions_last``: how often the batch window in force changed during the
  run (the collector's reported ``staleness/keep_versions``; 0 for a fixed window) and the last
  window (0 = off): whether an adaptive window moved at all;
* the time decomposition columns come from ``tools.reports.timing``;
* whom the controls drop (``trained_*``, ``dropped_*``, ``dead_*``: the length and pass rate of the
  attempts trained, dropped by the window and dead-lettered, with a two-sample test of each against the
  trained ones) come from the run's ``decisions.jsonl`` (``tools.reports.dropbias``);
* a trained group's age split into time in flight and time queued (``in_flight_s_mean``,
  ``queued_*_s_mean``) beside the trainer's version gap and the gap at the cut (``tools.reports.agesplit``);
* how off-policy the trained data was (``ess_mean``, ``ess_min``, ``truncated_frac_mean``, ``clip_frac_mb_*``,
  ``mismatch_kl_mean``, ``prox_approx_err_mean``: the trainer's per-step diagnostics, ``tools.reports.offpolicy``);
* ``model_build``: the model the run started from (``tools.experiments.build``): seeds pool only within one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shared.window_decisions import DecisionRecord
from tools.reports import agesplit, dropbias, offpolicy, series, timing
from tools.reports.series import Row, number, pick

COUNTERS = {"groups_produced": "groups_produced", "groups_trained": "groups_trained",
            "groups_dropped": "groups_dropped_stale", "groups_reenqueued": "groups_reenqueued",
            "groups_dead_lettered": "groups_dead_lettered",
            "groups_span_rejected": "partial_rollout_rejected_groups"}  # the span cap acting


SHARES = ("window_drop_share", "span_reject_share", "reenqueue_share", "dead_letter_share")
WINDOW = ("window_changes", "keep_versions_last")


def target_column(x: float) -> str:
    return f"time_to_acc_{x:g}"


def steps_column(x: float) -> str:
    return f"steps_to_acc_{x:g}"


def columns(targets: Sequence[float]) -> list[str]:
    """summary.csv's header, in order."""
    return (["variant", "seed", "steps", "wall_to_k_s", "wall_clock_s", "startup_s"]
            + [target_column(x) for x in targets] + [steps_column(x) for x in targets]
            + ["initial_eval_acc", "final_eval_acc", "best_eval_acc", "reward_auc", "logprob_abs_diff_mean",
               "logprob_abs_diff_all_mean"]
            + [f"{name}_{part}" for name in ("reward", "tool_calls") for part in ("first", "last", "gain")]
            + list(COUNTERS) + list(SHARES) + list(WINDOW) + list(timing.columns(timing.TimeSplit()))
            + list(dropbias.COLUMNS) + list(agesplit.COLUMNS) + list(offpolicy.COLUMNS) + ["model_build", "run_dir"])


def step_clock(rows: Sequence[Row]) -> dict[int, float]:
    """Trainer step -> trainer wall-clock (s) at that step (the newest report wins after a restart)."""
    out: dict[int, float] = {}
    for r in series.trainer_rows(rows):
        s, w = pick(r, series.STEP), number(r.get("time/wall_s"))
        if s is not None and w is not None:
            out[int(s)] = w
    return out


def window_history(rows: Sequence[Row]) -> dict[str, int | None]:
    """``window_changes`` and ``keep_versions_last`` from the collector's reports, in row order."""
    seen = [int(k) for k in (number(r.get("staleness/keep_versions")) for r in rows
                             if r.get("service") == "group-collector") if k is not None]
    changes = sum(1 for a, b in zip(seen, seen[1:], strict=False) if a != b)
    return {"window_changes": changes if seen else None, "keep_versions_last": seen[-1] if seen else None}


def publish_clock(rows: Sequence[Row]) -> dict[int, float]:
    """Published version -> trainer wall-clock (s) when it was published (version 0: at 0)."""
    out: dict[int, float] = {0: 0.0}
    for r in series.trainer_rows(rows):
        v, w = number(r.get("train/published_version")), number(r.get("time/wall_s"))
        if v is not None and w is not None:
            out[int(v)] = w
    return out


def eval_curve(rows: Sequence[Row]) -> list[tuple[int, float]]:
    """(version, accuracy) in version order, one per evaluated version."""
    acc = series.per_version(series.eval_rows(rows), series.EVAL_ACC)
    return [(int(v), a) for v, a in zip(acc.x, acc.y, strict=True)]


def time_to_accuracy(rows: Sequence[Row], target: float) -> float | None:
    """Wall-clock at which the first trained version with eval accuracy >= target was published; None if never."""
    published = publish_clock(rows)
    for version, acc in eval_curve(rows):
        if version >= 1 and acc >= target and version in published:
            return published[version]
    return None


def steps_to_accuracy(rows: Sequence[Row], target: float) -> int | None:
    """Trainer step at which the first trained version with eval accuracy >= target was published."""
    steps: dict[int, int] = {}
    for r in series.trainer_rows(rows):
        v, s = number(r.get("train/published_version")), pick(r, series.STEP)
        if v is not None and s is not None:
            steps[int(v)] = int(s)
    for version, acc in eval_curve(rows):
        if version >= 1 and acc >= target and version in steps:
            return steps[version]
    return None


def shares(counts: Mapping[str, Any]) -> dict[str, float | None]:
    """The staleness controls' shares (module docstring) from the run's final counters."""
    trained, dropped, rejected = (float(counts.get(k) or 0) for k in ("groups_trained", "groups_dropped",
                                                                       "groups_span_rejected"))
    decided, produced = trained + dropped + rejected, float(counts.get("groups_produced") or 0)
    dead, again = float(counts.get("groups_dead_lettered") or 0), float(counts.get("groups_reenqueued") or 0)
    return {"window_drop_share": dropped / decided if decided else None,
            "span_reject_share": rejected / decided if decided else None,
            "reenqueue_share": again / decided if decided else None,
            "dead_letter_share": dead / produced if produced else None}


def reward_curve(rows: Sequence[Row]) -> list[tuple[int, float]]:
    curve = series.per_step(rows, series.REWARD)
    return [(int(s), y) for s, y in zip(curve.x, curve.y, strict=True)]


def first_last(ys: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """Mean of the first and of the last fifth of ``ys`` (at least one value each), and last - first."""
    if not ys:
        return None, None, None
    k = max(1, len(ys) // 5)
    first, last = sum(ys[:k]) / k, sum(ys[-k:]) / k
    return first, last, last - first


def run_row(rows: Sequence[Row], variant: str, seed: int, targets: Sequence[float], k_steps: int | None,
            slots: int | None, started_at: float | None, run_dir: str,
            decisions: Sequence[DecisionRecord] = (), model_build: str | None = None) -> dict[str, Any]:
    clock = step_clock(rows)
    last = max(clock) if clock else None
    k = k_steps if k_steps is not None and k_steps in clock else last
    trainer = series.trainer_rows(rows)
    first_ts = number(trainer[0].get("ts")) if trainer else None
    first_wall = number(trainer[0].get("time/wall_s")) if trainer else None
    evals = eval_curve(rows)
    rewards = [y for _, y in reward_curve(rows)]
    diffs = [y for y in (pick(r, series.LOGPROB_DIFF) for r in trainer) if y is not None]
    diffs_all = [y for y in (pick(r, series.LOGPROB_DIFF_ALL) for r in trainer) if y is not None] or diffs
    stats = next((r for r in reversed(rows) if r.get("service") == "ops" and any(
        str(key).startswith("stats/") for key in r)), {})
    startup = None
    if first_ts is not None and first_wall is not None and started_at is not None:
        startup = first_ts - first_wall - started_at  # the trainer loop's start, after the run's start
    row: dict[str, Any] = {
        "variant": variant, "seed": seed, "steps": last,
        "wall_to_k_s": clock.get(k) if k is not None else None,
        "wall_clock_s": clock.get(last) if last is not None else None,
        "startup_s": startup,
    }
    for x in targets:
        row[target_column(x)] = time_to_accuracy(rows, x)
    for x in targets:
        row[steps_column(x)] = steps_to_accuracy(rows, x)
    row.update({
        "initial_eval_acc": evals[0][1] if evals and evals[0][0] == 0 else None,
        "final_eval_acc": evals[-1][1] if evals else None,
        "best_eval_acc": max(a for _, a in evals) if evals else None,
        "reward_auc": sum(rewards) if rewards else None,
        "logprob_abs_diff_mean": sum(diffs) / len(diffs) if diffs else None,
        "logprob_abs_diff_all_mean": sum(diffs_all) / len(diffs_all) if diffs_all else None,
    })
    calls = [y for y in (pick(r, series.TOOL_SAMPLE_FRAC) for r in trainer) if y is not None]
    for name, ys in (("reward", rewards), ("tool_calls", calls)):
        row.update(zip((f"{name}_first", f"{name}_last", f"{name}_gain"), first_last(ys), strict=True))
    for col, counter in COUNTERS.items():
        row[col] = int(number(stats.get(f"stats/{counter}", 0)) or 0) if stats else None
    row.update(shares(row))
    row.update(window_history(rows))
    row.update(timing.columns(timing.decompose(rows, slots)))
    row.update(dropbias.columns(decisions))
    row.update(agesplit.split(rows).columns())
    row.update(offpolicy.split(rows).columns())
    row["model_build"] = model_build
    row["run_dir"] = run_dir
    return row


def as_csv_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def values(rows: Sequence[Mapping[str, Any]], variant: str, column: str) -> list[float]:
    """The numeric values of ``column`` over the runs of ``variant`` (missing ones left out)."""
    out = []
    for r in rows:
        if r.get("variant") == variant:
            v = number(r.get(column))
            if v is not None:
                out.append(v)
    return out
