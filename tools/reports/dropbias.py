"""Whom the staleness controls drop: length and difficulty of dropped and dead-lettered groups
against trained ones, from a run's collector decision records (pure: records in, numbers out).

Input: ``shared.window_decisions.DecisionRecord``s (``<run>/decisions.jsonl``, or a live
``{p}:collector:decisions``). The unit is one group attempt, never one trajectory: the trajectories
of a group share their prompt (and largely their length and outcome), so counting them one by one
reads one prompt ~n_samples times as independent evidence (the soak's reasoning,
``tools.reports.twosample``). Per attempt:

* ``len``: the mean response length of its trajectories (loss-mask tokens, all segments);
* ``pass``: its pass rate, the share of its trajectories with reward > 0 (not the mean reward: on the
  built-in tasks any reward above 0 is a solved episode, and partial credit would mix how hard the
  prompt is with how well it was answered). A task whose every reward is > 0 has pass rate 1 everywhere
  and this measure says nothing there.

The sets:

* ``trained``: attempts cut into a batch;
* ``dropped``: attempts the window dropped (re-enqueued, or dead-lettered on the last attempt);
* ``dead``: groups dead-lettered for any reason, by their last attempt. A failed attempt (the span cap,
  a task error, ...) carries no trajectories and cannot be measured: it is in no set.

Each of ``dropped`` and ``dead`` is compared with ``trained`` on both measures: the two-sided
Mann-Whitney U p-value and the Kolmogorov-Smirnov distance D (``tools.reports.twosample``, the one
implementation). A group dropped twice and then trained is in both sets: the question is which
attempts the window turns away at its checks, not only which prompts are lost. Records written
before the decision log carried lengths and rewards have none: every figure is then None.

*Why* an attempt was dropped (``deciders``): a group is outside the window when one of its trajectories
is (``shared.window_decisions.outside_window``), so among the window's drops this counts the trajectories
that were outside (gap >= the window in force) and how many of them were rewarded, against the share of
rewarded trajectories in those groups, and the drops where every trajectory outside was a rewarded one.
A trajectory that wins early ends on an older version than its siblings that play on, so a rewarded
share above the groups' own says the window judged those groups by their early winners. Per trajectory,
``gaps`` and ``rewards`` align only when every trajectory has a real version (equal lengths); other
records are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.window_decisions import DecisionRecord, outside_window
from tools.reports.twosample import ks_statistic, mann_whitney

SETS = ("dropped", "dead")  # each compared with the trained attempts
MEASURES = {"len": "response tokens", "pass": "pass rate"}
# summary.csv columns, in order (tools.experiments.summary)
COLUMNS = (["trained_n", "trained_len_mean", "trained_pass_mean"]
           + [f"{s}_{c}" for s in SETS for c in ("n", "len_mean", "pass_mean", "len_p", "len_ks", "pass_p", "pass_ks")]
           + ["dropped_outside_pass", "dropped_groups_pass", "dropped_only_rewarded_share"])


@dataclass(frozen=True)
class Unit:
    """One measured group attempt."""

    length: float  # mean response tokens per trajectory
    passed: float  # share of trajectories with reward > 0


@dataclass(frozen=True)
class Comparison:
    """One set against the trained attempts on one measure (``p_value``/``ks_d`` None without both sides)."""

    name: str  # "dropped" | "dead"
    measure: str  # "len" | "pass"
    n: int
    n_trained: int
    mean: float | None
    mean_trained: float | None
    p_value: float | None
    ks_d: float | None


def unit(rec: DecisionRecord) -> Unit | None:
    """The attempt's measures; None when it has no trajectories (failed, or an old record)."""
    if not rec.response_tokens or len(rec.rewards) != len(rec.response_tokens):
        return None
    n = len(rec.response_tokens)
    return Unit(sum(rec.response_tokens) / n, sum(1 for r in rec.rewards if r > 0) / n)


def split(records: Sequence[DecisionRecord]) -> dict[str, list[Unit]]:
    """The measured attempts of each set: ``trained``, ``dropped``, ``dead``."""
    out: dict[str, list[Unit]] = {"trained": [], "dropped": [], "dead": []}
    for rec in records:
        u = unit(rec)
        if u is None:
            continue
        if rec.decision == "trained":
            out["trained"].append(u)
            continue
        if rec.window_decided:
            out["dropped"].append(u)
        if rec.outcome == "dead_lettered":
            out["dead"].append(u)
    return out


@dataclass(frozen=True)
class Deciders:
    """The trajectories that put the window's dropped attempts outside it (counts over those attempts)."""

    drops: int  # window drops whose trajectories all carry a gap and a reward
    only_rewarded: int  # of those, drops whose every trajectory outside the window was rewarded
    outside: int  # trajectories outside the window (gap >= the window in force)
    outside_rewarded: int  # of those, the rewarded ones (reward > 0)
    trajectories: int  # every trajectory of those drops
    rewarded: int  # of those, the rewarded ones

    @property
    def outside_pass(self) -> float | None:
        return self.outside_rewarded / self.outside if self.outside else None

    @property
    def groups_pass(self) -> float | None:
        return self.rewarded / self.trajectories if self.trajectories else None

    @property
    def only_rewarded_share(self) -> float | None:
        return self.only_rewarded / self.drops if self.drops else None


def deciders(records: Sequence[DecisionRecord]) -> Deciders:
    """Which trajectories were outside the window in the attempts it dropped (module docstring)."""
    drops = only = outside = outside_rewarded = trajectories = rewarded = 0
    for rec in records:
        if (rec.decision != "dropped" or not rec.window_decided or not rec.keep_versions or not rec.gaps
                or len(rec.gaps) != len(rec.rewards)):
            continue
        out = [r for g, r in zip(rec.gaps, rec.rewards, strict=True) if outside_window([g], rec.keep_versions)]
        if not out:
            continue  # an unknown version (gap -1) cannot have decided it; nothing to attribute
        drops += 1
        only += all(r > 0 for r in out)
        outside += len(out)
        outside_rewarded += sum(1 for r in out if r > 0)
        trajectories += len(rec.rewards)
        rewarded += sum(1 for r in rec.rewards if r > 0)
    return Deciders(drops, only, outside, outside_rewarded, trajectories, rewarded)


def describe_deciders(d: Deciders) -> str:
    """``"0.61 rewarded vs 0.37 in those groups; only rewarded ones outside in 219 of 307 drops"``."""
    if not d.drops:
        return "-"
    assert d.outside_pass is not None and d.groups_pass is not None
    return (f"{d.outside_pass:.2f} rewarded vs {d.groups_pass:.2f} in those groups; "
            f"only rewarded ones outside in {d.only_rewarded} of {d.drops} drops")


def _values(units: Sequence[Unit], measure: str) -> list[float]:
    return [u.length if measure == "len" else u.passed for u in units]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def compare(records: Sequence[DecisionRecord]) -> list[Comparison]:
    """Every set against the trained attempts, on every measure (in ``SETS`` × ``MEASURES`` order)."""
    sets = split(records)
    out = []
    for name in SETS:
        for measure in MEASURES:
            a, b = _values(sets[name], measure), _values(sets["trained"], measure)
            both = bool(a and b)
            out.append(Comparison(name, measure, len(a), len(b), _mean(a), _mean(b),
                                  mann_whitney(a, b).p_value if both else None, ks_statistic(a, b) if both else None))
    return out


def columns(records: Sequence[DecisionRecord]) -> dict[str, float | int | None]:
    """The run's ``COLUMNS`` (counts of measured attempts; means and tests None where a side is empty)."""
    sets = split(records)
    out: dict[str, float | int | None] = dict.fromkeys(COLUMNS)  # in COLUMNS order
    out.update({"trained_n": len(sets["trained"]), "trained_len_mean": _mean(_values(sets["trained"], "len")),
                "trained_pass_mean": _mean(_values(sets["trained"], "pass"))})
    for c in compare(records):
        out[f"{c.name}_n"] = c.n
        out[f"{c.name}_{c.measure}_mean"] = c.mean
        out[f"{c.name}_{c.measure}_p"] = c.p_value
        out[f"{c.name}_{c.measure}_ks"] = c.ks_d
    d = deciders(records)
    out.update({"dropped_outside_pass": d.outside_pass, "dropped_groups_pass": d.groups_pass,
                "dropped_only_rewarded_share": d.only_rewarded_share})
    return out


LABELS = {"dropped": "dropped by the window", "dead": "dead-lettered"}


def describe(c: Comparison) -> str:
    """``"31.2 vs 24.0 (12 vs 240 groups), Mann-Whitney p=0.003, KS D=0.41"``, or why there is no test."""
    if not c.n or not c.n_trained:
        return f"- ({c.n} {LABELS[c.name]}, {c.n_trained} trained groups with trajectories)"
    digits = 1 if c.measure == "len" else 3
    assert c.mean is not None and c.mean_trained is not None and c.p_value is not None and c.ks_d is not None
    return (f"{c.mean:.{digits}f} vs {c.mean_trained:.{digits}f} ({c.n} vs {c.n_trained} groups), "
            f"Mann-Whitney p={c.p_value:.2g}, KS D={c.ks_d:.2f}")


def summary_pairs(records: Sequence[DecisionRecord]) -> list[tuple[str, str]]:
    """Lines for ``dressage report``: each set against the trained groups (group attempt = unit)."""
    if not records:
        return [("whom the controls drop", "- (no decisions.jsonl)")]
    return ([(f"{MEASURES[c.measure]}: {LABELS[c.name]} vs trained (per group)", describe(c))
             for c in compare(records)]
            + [("trajectories outside the window in its drops", describe_deciders(deciders(records)))])
