"""The adaptive window's decision rule (pure): signals in, the next ``keep_versions`` out.

Each tick proposes a direction from what the run measured since the previous tick:

* **widen (+1), urgent**, when the trainer starves: its waiting fraction is above
  ``max_wait_fraction``, the share of groups dropped stale is above ``max_drop_rate``, or it made no
  step for ``stall_ticks`` ticks while groups were being dropped;
* **tighten (-1)** when the *drift* is above ``target x (1 + deadband)`` -- but only while the trainer
  waits at most half of ``max_wait_fraction`` and at most half of ``max_drop_rate`` is dropped (a
  guard band, so a window never tightens into starvation);
* **widen (+1)** when the drift is below ``target x (1 - deadband)`` and groups are being dropped
  (the window costs data that is fresh enough to train on);
* otherwise **hold**.

The drift is the off-policy measure ``window_controller.signal`` names, oriented so that higher means
further off-policy: the trainer's ``train_rollout_logprob_abs_diff`` (target ``target_logprob_diff``),
its behaviour-vs-proximal ``mismatch_kl`` (``target_mismatch_kl``), or the ESS deficit ``1 - ess`` of
the behaviour importance weights (target ``1 - target_ess``). Reasons name it: ``logprob_diff_high``,
``mismatch_kl_low``, ``ess_deficit_high``, ...

Invariants (tested on scripted sequences and with hypothesis, tests/unit/test_window_controller.py):
* ``min_keep <= keep <= max_keep`` and ``keep >= 1`` always: the controller never turns the window off;
* one decision changes ``keep`` by at most ``max_step`` (urgent) or 1 (otherwise);
* the proposal is monotone: non-increasing in the drift, non-decreasing in the waiting
  fraction and the drop rate, all else equal;
* hysteresis: a proposal acts only after it repeated ``patience`` ticks in a row (``2 x patience`` to
  reverse the last change), then ``cooldown`` ticks pass with no change; starvation acts after
  ``starve_patience`` ticks and ignores the cooldown (never starve the trainer);
* no limit cycle: a window that starved the trainer is never used again -- the ``floor`` rises above
  it -- so the number of starvation-driven widenings is bounded by ``max_keep - min_keep``, and
  constant signals move ``keep`` in one direction only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.config import WindowControllerConfig

TIGHTEN, HOLD, WIDEN = -1, 0, 1
URGENT = ("trainer_waiting", "dropping_too_much", "trainer_stalled")  # the starvation reasons


@dataclass(frozen=True)
class Signals:
    """What the run measured since the previous tick."""

    logprob_diff: float | None  # mean train_rollout_logprob_abs_diff of the new trainer steps; None = no step
    wait_fraction: float | None  # share of the trainer's wall-clock spent waiting for a batch; None = unknown
    drop_rate: float | None  # stale drops / (stale drops + groups batched); None = no group decided
    steps: int = 0  # new trainer steps behind these figures
    mismatch_kl: float | None = None  # mean train/mismatch_kl of the new steps; None = no step
    ess: float | None = None  # mean train/ess (normalised, in (0, 1]) of the new steps; None = no step


@dataclass(frozen=True)
class State:
    keep: int  # keep_versions in force
    direction: int = HOLD  # the direction the last ``streak`` ticks proposed
    streak: int = 0
    cooldown: int = 0  # ticks left before a non-urgent change may act
    idle: int = 0  # consecutive ticks without a trainer step
    last_change: int = HOLD  # direction of the last change made
    floor: int = 1  # lowest window still allowed: one above every window that starved the trainer


@dataclass(frozen=True)
class Decision:
    before: int
    after: int
    proposal: int  # TIGHTEN / HOLD / WIDEN
    reason: str
    state: State  # the state after this decision

    @property
    def changed(self) -> bool:
        return self.after != self.before


def initial_state(cfg: WindowControllerConfig, keep: int | None) -> State:
    """Start from ``keep`` (0/None: the widest allowed window), clipped into the bounds."""
    start = keep if keep else cfg.max_keep
    return State(keep=min(max(start, cfg.min_keep), cfg.max_keep), floor=cfg.min_keep)


def steered(cfg: WindowControllerConfig) -> tuple[str, float]:
    """The name and target of the drift ``cfg.signal`` names (higher = further off-policy)."""
    if cfg.signal == "mismatch_kl":
        return "mismatch_kl", cfg.target_mismatch_kl
    if cfg.signal == "ess":
        return "ess_deficit", 1.0 - cfg.target_ess
    return "logprob_diff", cfg.target_logprob_diff


def drift(cfg: WindowControllerConfig, s: Signals) -> float | None:
    """The measure ``cfg.signal`` names in these signals, oriented so that higher = further off-policy."""
    if cfg.signal == "mismatch_kl":
        return s.mismatch_kl
    if cfg.signal == "ess":
        return None if s.ess is None else 1.0 - s.ess
    return s.logprob_diff


def propose(cfg: WindowControllerConfig, s: Signals, idle: int) -> tuple[int, str]:
    """The direction these signals ask for, and why (no state but the idle tick count)."""
    wait, drop = s.wait_fraction or 0.0, s.drop_rate or 0.0
    if wait > cfg.max_wait_fraction:
        return WIDEN, "trainer_waiting"
    if drop > cfg.max_drop_rate:
        return WIDEN, "dropping_too_much"
    if s.steps == 0 and idle >= cfg.stall_ticks and drop > 0:
        return WIDEN, "trainer_stalled"
    (name, target), value = steered(cfg), drift(cfg, s)
    if value is None:
        return HOLD, "no_trainer_step"
    if value > target * (1 + cfg.deadband):
        if wait <= cfg.max_wait_fraction / 2 and drop <= cfg.max_drop_rate / 2:
            return TIGHTEN, f"{name}_high"
        return HOLD, f"{name}_high_but_trainer_needs_data"
    if value < target * (1 - cfg.deadband) and drop > 0:
        return WIDEN, f"{name}_low"
    return HOLD, "in_band"


def decide(cfg: WindowControllerConfig, state: State, s: Signals) -> Decision:
    """One tick: the proposal, the hysteresis, the bounds; returns the decision and the next state."""
    idle = state.idle + 1 if s.steps == 0 else 0
    proposal, reason = propose(cfg, s, idle)
    urgent = reason in URGENT
    streak = state.streak + 1 if proposal == state.direction and proposal != HOLD else int(proposal != HOLD)
    nxt = replace(state, direction=proposal, streak=streak, idle=idle, cooldown=max(0, state.cooldown - 1))
    if proposal == HOLD:
        return Decision(state.keep, state.keep, proposal, reason, nxt)
    if urgent:
        needed, blocked = cfg.starve_patience, False
    else:
        reversing = state.last_change not in (HOLD, proposal)
        needed, blocked = cfg.patience * (2 if reversing else 1), state.cooldown > 0
    if streak < needed or blocked:
        return Decision(state.keep, state.keep, proposal, f"{reason}:waiting", nxt)
    floor = max(nxt.floor, cfg.min_keep, state.keep + 1 if urgent else 0)  # a starving window is never reused
    step = cfg.max_step if urgent else 1
    target = state.keep + proposal * step
    after = min(max(target, floor), cfg.max_keep)
    if after == state.keep:
        return Decision(state.keep, state.keep, proposal, f"{reason}:at_bound",
                        replace(nxt, floor=min(floor, cfg.max_keep)))
    done = replace(nxt, keep=after, streak=0, cooldown=cfg.cooldown, last_change=proposal, idle=0,
                   floor=min(floor, cfg.max_keep))  # idle 0: a stall is judged afresh under the new window
    return Decision(state.keep, after, proposal, reason, done)
