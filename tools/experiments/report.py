"""An experiment's outputs: summary.csv, results.md, report.html + PNGs, and the bench headline.

Across seeds every number is a mean with its 95 % Student-t interval, every ratio against the
spec's baseline a ratio of means with the log-scale delta-method interval (``tools.reports.intervals``).
Speed-ups are baseline time / variant time, so > 1 means the variant is faster:

* to K steps: baseline ``wall_to_k_s`` / variant ``wall_to_k_s``;
* to the baseline's final accuracy: baseline ``wall_to_k_s`` (the time the baseline needed to end
  with that accuracy) / variant ``time_to_baseline_acc_s`` (when the variant first published a
  version at least as accurate as the baseline's mean final eval accuracy). Runs that never got
  there are left out of that mean and counted ("reached 2/3").
"""

from __future__ import annotations

import csv
import html
import os
import platform
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.window_decisions import DecisionRecord
from tools.experiments import summary as summ
from tools.experiments.build import builds_text
from tools.experiments.spec import Spec
from tools.reports import dropbias, timing
from tools.reports.decisionlog import FILE as DECISIONS_FILE
from tools.reports.decisionlog import load_records
from tools.reports.intervals import Interval, NoData, mean_interval, ratio_interval
from tools.reports.metricslog import load_rows
from tools.reports.series import Row, number

TO_BASE = "time_to_baseline_acc_s"
DECOMP = (("trainer_wait_frac", "trainer wait"), ("trainer_train_frac", "trainer train"),
          ("trainer_checkpoint_frac", "checkpoint"), ("trainer_publish_frac", "publish"),
          ("engine_busy_frac", "engine busy"), ("proxy_pause_frac", "proxy paused"),
          ("publication_pause_frac", "publication pause"), ("worker_slot_busy_frac", "worker slots busy"))


@dataclass(frozen=True)
class Files:
    csv: Path
    markdown: Path
    html: Path
    pngs: list[Path]
    table: str


@dataclass(frozen=True)
class Ratios:
    variant: str
    to_k: Interval | None
    to_acc: Interval | None
    reached: tuple[int, int]  # (runs that reached the baseline's final accuracy, runs)
    final_acc: Interval | None


def _mean(xs: Sequence[float]) -> Interval | None:
    return mean_interval(xs) if xs else None


def _ratio(a: Sequence[float], b: Sequence[float]) -> Interval | None:
    try:
        return ratio_interval(a, b) if a and b else None
    except NoData:
        return None


def baseline_accuracy(spec: Spec, rows: Sequence[dict[str, Any]]) -> float | None:
    accs = summ.values(rows, spec.baseline, "final_eval_acc")
    return sum(accs) / len(accs) if accs else None


def add_time_to_baseline(spec: Spec, rows: list[dict[str, Any]], metrics: Mapping[str, Sequence[Row]]) -> None:
    """Each row gets ``time_to_baseline_acc_s`` (None when the run never reached it)."""
    target = baseline_accuracy(spec, rows)
    for r in rows:
        m = metrics.get(str(r.get("run_dir")))
        r[TO_BASE] = summ.time_to_accuracy(m, target) if (target is not None and m) else None


def ratios(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[Ratios]:
    base_k = summ.values(rows, spec.baseline, "wall_to_k_s")
    base_acc = summ.values(rows, spec.baseline, "final_eval_acc")
    out = []
    for v in spec.variants:
        if v == spec.baseline:
            continue
        to_acc = summ.values(rows, v, TO_BASE)
        n = len([r for r in rows if r.get("variant") == v])
        out.append(Ratios(v, _ratio(base_k, summ.values(rows, v, "wall_to_k_s")), _ratio(base_k, to_acc),
                          (len(to_acc), n), _ratio(summ.values(rows, v, "final_eval_acc"), base_acc)))
    return out


HEADLINE_LABELS = {"final_eval_acc": "final eval accuracy", "best_eval_acc": "best eval accuracy",
                   "reward_auc": "reward AUC"}


def headline(spec: Spec, rows: Sequence[dict[str, Any]]) -> str:
    """The report's first line (and the bench's last): the spec's ``headline`` measure for the variant that
    does best on it against the baseline. A spec with one variant compares nothing, so its line is that
    variant's reward gain over the run."""
    if len(spec.variants) == 1:
        gain = _mean(summ.values(rows, spec.baseline, "reward_gain"))
        return (f"{spec.baseline}: reward gain from the first to the last fifth of the steps "
                f"{_iv(gain, 3)} (seeds {len(summ.values(rows, spec.baseline, 'reward_gain'))}); no variant to compare")
    if spec.headline != "speed":
        return measure_headline(spec, rows, spec.headline)
    rs = [r for r in ratios(spec, rows) if r.to_k is not None]
    k = spec.stop.train_steps or "K"
    if not rs:
        return f"{_pair(spec, None)} wall-clock to {k} steps: n/a (no finished runs to compare); to {spec.baseline} final accuracy: n/a"
    best = max(rs, key=lambda r: r.to_k.estimate if r.to_k else 0.0)
    assert best.to_k is not None
    acc = "n/a" if best.to_acc is None else f"{best.to_acc.estimate:.2f}×"
    return (f"{_pair(spec, best.variant)} wall-clock to {k} steps: {best.to_k.estimate:.2f}× (seeds {best.to_k.n}, "
            f"95% interval {_bounds(best.to_k)}); to {spec.baseline} final accuracy: {acc}")


def measure_headline(spec: Spec, rows: Sequence[dict[str, Any]], column: str) -> str:
    """``variant/baseline <measure>: ratio`` for the variant with the highest ratio of the measure's means."""
    label = HEADLINE_LABELS[column]
    base = summ.values(rows, spec.baseline, column)
    found = [(v, iv) for v in spec.variants if v != spec.baseline
             and (iv := _ratio(summ.values(rows, v, column), base)) is not None]
    if not found:
        return f"variant/{spec.baseline} {label}: n/a (no finished runs to compare)"
    variant, best = max(found, key=lambda f: f[1].estimate)
    return (f"{variant}/{spec.baseline} {label}: {best.estimate:.2f}× (seeds {len(summ.values(rows, variant, column))} against "
            f"{len(base)}, 95% interval {_bounds(best)}); the highest of {len(found)} variants")


def _bounds(iv: Interval) -> str:
    lo = "?" if iv.low is None else f"{iv.low:.2f}"
    hi = "?" if iv.high is None else f"{iv.high:.2f}"
    return f"[{lo}, {hi}]"


def _pair(spec: Spec, variant: str | None) -> str:
    """The ratio's name: "async/sync" for the async-vs-sync bench (its documented last line), else the
    variant over the baseline, so no other spec's headline reads as an async speed-up."""
    if spec.baseline == "sync":
        return "async/sync"
    return f"{variant or 'variant'}/{spec.baseline}"


def _iv(iv: Interval | None, digits: int = 2, unit: str = "") -> str:
    return "-" if iv is None else iv.text(digits, unit)


def variant_table(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    head = ["variant", "runs", "steps", "wall to K (s)", "initial eval acc", "final eval acc", "best eval acc",
            "reward AUC",
            "logprob diff", "dropped", "re-enqueued"]
    out = [head]
    for v in spec.variants:
        n = len([r for r in rows if r.get("variant") == v])
        out.append([v + (" (baseline)" if v == spec.baseline else ""), str(n),
                    _iv(_mean(summ.values(rows, v, "steps")), 0), _iv(_mean(summ.values(rows, v, "wall_to_k_s")), 1),
                    _iv(_mean(summ.values(rows, v, "initial_eval_acc"))),
                    _iv(_mean(summ.values(rows, v, "final_eval_acc"))), _iv(_mean(summ.values(rows, v, "best_eval_acc"))),
                    _iv(_mean(summ.values(rows, v, "reward_auc")), 1),
                    _iv(_mean(summ.values(rows, v, "logprob_abs_diff_mean")), 4),
                    _iv(_mean(summ.values(rows, v, "groups_dropped")), 1),
                    _iv(_mean(summ.values(rows, v, "groups_reenqueued")), 1)])
    return out


def staleness_table(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Did the controls act, and what did they cost: steps and time to each target (runs that reached
    it), the shares dropped by the window / rejected by the span cap / dead-lettered, how often the
    window in force changed (an adaptive one), the logprob diff."""
    head = ["variant"]
    for x in spec.targets:
        head += [f"steps to {x:g}", f"time to {x:g} (s)", "reached"]
    head += ["window drops", "span rejections", "re-enqueued", "dead-lettered", "window changes", "logprob diff"]
    out = [head]
    for v in spec.variants:
        n = len([r for r in rows if r.get("variant") == v])
        cells = [v + (" (baseline)" if v == spec.baseline else "")]
        for x in spec.targets:
            steps = summ.values(rows, v, summ.steps_column(x))
            cells += [_iv(_mean(steps), 0), _iv(_mean(summ.values(rows, v, summ.target_column(x))), 0),
                      f"{len(steps)}/{n}"]
        cells += [_iv(_mean([100 * x for x in summ.values(rows, v, c)]), 1, " %") for c in summ.SHARES]
        cells.append(_iv(_mean(summ.values(rows, v, "window_changes")), 1))
        cells.append(_iv(_mean(summ.values(rows, v, "logprob_abs_diff_mean")), 4))
        out.append(cells)
    return out


def drop_bias_table(spec: Spec, rows: Sequence[dict[str, Any]],
                    decisions: Mapping[str, Sequence[DecisionRecord]]) -> list[list[str]]:
    """Whom the controls drop (``tools.reports.dropbias``): per variant, the group attempts dropped by the
    window and the groups dead-lettered against the trained ones, pooled over the seeds (a group attempt
    is the unit), with the Mann-Whitney p and KS D of the pool, and in how many runs alone p < 0.05; for
    the window's drops, which of their trajectories were outside the window (``dropbias.deciders``)."""
    out = [["variant", "set", "groups (set / trained)", "response tokens, set vs trained", "p [KS D]",
            "runs p < 0.05", "pass rate, set vs trained", "p [KS D]", "runs p < 0.05",
            "trajectories outside the window: pass rate vs their groups'"]]
    for v in spec.variants:
        runs = [r for r in rows if r.get("variant") == v]
        pooled = [rec for r in runs for rec in decisions.get(str(r.get("run_dir")), ())]
        comps = {(c.name, c.measure): c for c in dropbias.compare(pooled)}
        shown = [name for name in dropbias.SETS if comps[(name, "len")].n]
        if not shown:
            trained = comps[(dropbias.SETS[0], "len")].n_trained
            out.append([v, "-", f"0 / {trained}", "nothing measured was dropped or dead-lettered", "", "", "", "", "", ""])
        for name in shown:
            cells = [v, dropbias.LABELS[name], f"{comps[(name, 'len')].n} / {comps[(name, 'len')].n_trained}"]
            for measure, digits in (("len", 1), ("pass", 3)):
                c = comps[(name, measure)]
                ps = [p for p in (number(r.get(f"{name}_{measure}_p")) for r in runs) if p is not None]
                cells += ["-" if c.mean is None or c.mean_trained is None else
                          f"{c.mean:.{digits}f} vs {c.mean_trained:.{digits}f}",
                          "-" if c.p_value is None or c.ks_d is None else f"{c.p_value:.2g} [{c.ks_d:.2f}]",
                          f"{sum(p < 0.05 for p in ps)}/{len(ps)}"]
            cells.append(dropbias.describe_deciders(dropbias.deciders(pooled)) if name == "dropped" else "")
            out.append(cells)
    return out


def age_table(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """A trained group's age in seconds, in flight against queued (``tools.reports.agesplit``), beside the
    trainer's version gap and the gap at the cut (mean [95 % interval] across seeds)."""
    cols = [("in_flight_s_mean", 2), ("queued_collector_s_mean", 2), ("queued_trainer_s_mean", 2),
            ("queued_s_mean", 2), ("version_gap_mean", 2), ("gap_at_cut_mean", 2)]
    out = [["variant", "in flight (s)", "queued: finished -> cut (s)", "queued: cut -> trained (s)",
            "queued, total (s)", "version gap at the step", "version gap at the cut"]]
    for v in spec.variants:
        out.append([v, *[_iv(_mean(summ.values(rows, v, c)), d) for c, d in cols]])
    return out


def learning_table(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """First vs last fifth of the steps: reward, and the share of samples calling a tool (tool tasks)."""
    tools = any(summ.values(rows, v, "tool_calls_gain") for v in spec.variants)
    head = ["variant", "reward, first fifth", "reward, last fifth", "reward gain"]
    out = [head + (["tool calls, first fifth", "tool calls, last fifth", "tool-call gain"] if tools else [])]
    for v in spec.variants:
        cols = ["reward_first", "reward_last", "reward_gain"] + (
            ["tool_calls_first", "tool_calls_last", "tool_calls_gain"] if tools else [])
        out.append([v, *[_iv(_mean(summ.values(rows, v, c)), 3) for c in cols]])
    return out


def ratio_table(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = [["variant", f"speed-up to K steps vs {spec.baseline}", f"speed-up to {spec.baseline}'s final accuracy",
            "reached it", f"final accuracy ÷ {spec.baseline}"]]
    for r in ratios(spec, rows):
        out.append([r.variant, _iv(r.to_k, 2, "×"), _iv(r.to_acc, 2, "×"), f"{r.reached[0]}/{r.reached[1]}",
                    _iv(r.final_acc, 2)])
    return out


def decomposition_table(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = [["variant", *[label for _, label in DECOMP]]]
    for v in spec.variants:
        cells = []
        for col, _ in DECOMP:
            iv = _mean([100 * x for x in summ.values(rows, v, col)])
            cells.append("-" if iv is None else iv.text(1, " %"))
        out.append([v, *cells])
    return out


def chain_table(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """A batch's trip through the pipeline (ms, mean [95 % interval]) beside the trainer's step time
    (its wall-clock to the last step over the steps, so runs stopped by accuracy count too)."""
    out = [["variant", "trainer step", *[label for _, label in timing.CHAIN.values()]]]
    for v in spec.variants:
        steps = [1000 * w / k for r in rows if r.get("variant") == v
                 and (w := number(r.get("wall_clock_s"))) and (k := number(r.get("steps")))]
        means = [_mean(steps), *[_mean(summ.values(rows, v, f"{link}_ms")) for link in timing.CHAIN]]
        out.append([v, *["-" if iv is None else iv.text(1, " ms") for iv in means]])
    return out


def cores_table(spec: Spec, rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """CPU cores each service used on average while the trainer ran (mean over seeds)."""
    names = [c for c in summ.columns(spec.targets) if c.startswith("cores_")]
    used = [c for c in names if any(number(r.get(c)) is not None for r in rows)]
    out = [["variant", *[c.removeprefix("cores_").replace("_", "-") for c in used]]]
    for v in spec.variants:
        out.append([v, *["-" if (iv := _mean(summ.values(rows, v, c))) is None else f"{iv.estimate:.2f}"
                         for c in used]])
    return out


def markdown(table: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
    return "\n".join(lines)


def html_table(table: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table[1:])
    return f"<table><tr>{head}</tr>{body}</table>"


def machine() -> dict[str, str]:
    info = {"cores": str(os.cpu_count()), "platform": platform.platform(), "python": platform.python_version()}
    try:
        info["load average (1, 5, 15 min)"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    try:
        import torch

        info["torch"] = f"{torch.__version__}, default CPU threads {torch.get_num_threads()}"
    except ImportError:
        pass
    return info


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + (" (working tree has uncommitted changes)" if dirty else "")


def thread_settings(spec: Spec) -> str:
    """The CPU-thread settings of the runs (engine.num_threads and ops.service_threads when set)."""
    seen = []
    for run in spec.runs:
        engine = (run.config.get("engine") or {}).get("num_threads")
        per_service = (run.config.get("ops") or {}).get("service_threads")
        text = f"engine.num_threads={engine}" + (f", ops.service_threads={per_service}" if per_service else "")
        if text not in seen:
            seen.append(text)
    return "; ".join(seen)


def model_builds(spec: Spec, rows: Sequence[dict[str, Any]]) -> str:
    """Which model build the runs started from (``tools.experiments.build``), variant by variant."""
    by_variant = {v: [r.get("model_build") or None for r in rows if r.get("variant") == v] for v in spec.variants}
    return builds_text({v: bs for v, bs in by_variant.items() if bs})


def write_csv(path: Path, spec: Spec, rows: Sequence[dict[str, Any]]) -> None:
    cols = [*summ.columns(spec.targets), TO_BASE]
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow([summ.as_csv_value(r.get(c)) for c in cols])


def write_outputs(spec: Spec, rows: list[dict[str, Any]], root: Path, command: str) -> Files:
    root.mkdir(parents=True, exist_ok=True)
    metrics = {str(r.get("run_dir")): load_rows(Path(str(r.get("run_dir"))) / "metrics.jsonl") for r in rows}
    decisions = {str(r.get("run_dir")): load_records(Path(str(r.get("run_dir"))) / DECISIONS_FILE) for r in rows}
    add_time_to_baseline(spec, rows, metrics)
    write_csv(root / "summary.csv", spec, rows)
    from tools.experiments.plots import plot_experiment  # matplotlib only when drawn

    pngs = plot_experiment(spec, rows, metrics, root) if rows else []
    tables = [("Per variant (mean [95 % interval] across seeds)", variant_table(spec, rows)),
              ("Learning: first against last fifth of the steps (mean [95 % interval] across seeds)",
               learning_table(spec, rows)),
              ("Staleness controls: time to target, and what the controls dropped (mean [95 % interval]; "
               "steps and time over the runs that reached the target)", staleness_table(spec, rows)),
              ("Whom the controls drop: length and pass rate (share of trajectories with reward > 0) of the "
               "group attempts dropped by the window and of the dead-lettered groups, against the trained ones "
               "(pooled over seeds, a group attempt is the unit; two-sided Mann-Whitney p and KS D)",
               drop_bias_table(spec, rows, decisions)),
              ("A trained group's age: in flight (enqueued -> rollout finished) against queued (-> batch cut -> "
               "the trainer's step), with the version gap (mean [95 % interval] across seeds)", age_table(spec, rows)),
              (f"Ratios against the baseline ({spec.baseline})", ratio_table(spec, rows)),
              ("Where the time goes (fractions of wall-clock, mean [95 % interval])", decomposition_table(spec, rows)),
              ("A batch's trip (ms per batch, mean [95 % interval]): admission after a publication, then the "
               "slowest of its groups waiting for a worker and rolling out; at η = 1 it has one trainer step "
               "for all of it", chain_table(spec, rows)),
              (f"CPU cores used per service while the trainer ran (mean; the machine has {os.cpu_count()})",
               cores_table(spec, rows))]
    target = baseline_accuracy(spec, rows)
    facts = [("spec", spec.path + (" (quick preset)" if spec.quick else "")), ("command", command),
             ("seeds", ", ".join(map(str, spec.seeds))), ("stop rule", spec.stop.describe()),
             ("baseline final eval accuracy", "-" if target is None else f"{target:.3f}"),
             ("model build", model_builds(spec, rows)),
             ("runs finished", f"{len(rows)}/{len(spec.runs)}"), ("git commit", git_commit()),
             ("threads", thread_settings(spec)), *machine().items(),
             ("written", time.strftime("%Y-%m-%d %H:%M:%S"))]
    head = headline(spec, rows)
    md = [f"# Experiment {spec.name}", "", spec.description.strip(), "", f"**{head}**", ""]
    md += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in facts]
    for title, table in tables:
        md += ["", f"## {title}", "", markdown(table)]
    md += ["", "Intervals: Student-t for means; ratios of means with the log-scale delta method and "
           "Welch-Satterthwaite degrees of freedom (tools/reports/intervals.py). Times are the trainer loop's "
           "wall-clock (start-up excluded, see tools/experiments/summary.py).", ""]
    (root / "results.md").write_text("\n".join(md), encoding="utf-8")
    from tools.reports.report import render_html

    page = render_html(f"Experiment {spec.name}", facts, pngs)
    extra = f"<h2>Headline</h2><p>{html.escape(head)}</p>" + "".join(
        f"<h2>{html.escape(t)}</h2>{html_table(tb)}" for t, tb in tables)
    page = page.replace("<h2>Plots</h2>", extra + "\n<h2>Plots</h2>", 1)
    (root / "report.html").write_text(page, encoding="utf-8")
    text = "\n".join([head, "", markdown(ratio_table(spec, rows)), "", markdown(decomposition_table(spec, rows)),
                      "", markdown(cores_table(spec, rows))])
    return Files(root / "summary.csv", root / "results.md", root / "report.html", pngs, text if rows else "")


def csv_rows(path: Path) -> list[dict[str, Any]]:
    """summary.csv read back (numbers as floats where they parse)."""
    with path.open(newline="", encoding="utf-8") as fh:
        return [{k: (number(v) if number(v) is not None and k not in ("variant", "run_dir") else v)
                 for k, v in r.items()} for r in csv.DictReader(fh)]
