"""The adaptive window's Redis shell: measure, decide (``policy.decide``), act through ``{p}:control``.

It acts through the operator's own control path: ``HSET {p}:control keep_versions N``, which the
group-collector re-reads every ``collector.control_poll_s`` and applies to the waiting groups at
once. Every tick -- change or not -- is one log line (INFO; DEBUG when it measured nothing) and one
``{p}:window_controller:decisions`` entry (capped) carrying the inputs (logprob diff, mismatch KL, ESS, waiting fraction, drop rate, new trainer
steps, the measure steered by and its target),
the proposal, the reason, and the window before and after; ``window_controller/*`` metrics follow.

An operator who sets ``keep_versions`` by hand while the controller runs is followed: the controller
adopts the value it finds (bounded by its own limits on its next change) and logs that it did.
Burst mode reads every trainer step already recorded, makes one decision and exits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import redis

from services.window_controller.policy import (
    Decision,
    Signals,
    State,
    decide,
    drift,
    initial_state,
    steered,
)
from services.window_controller.signals import SignalReader
from shared.config import WindowControllerConfig
from shared.consumer import ConsumerLoop
from shared.keys import Keys
from shared.lifecycle import StopFlag
from shared.telemetry import Heartbeat, MetricGauges, report_metrics

log = logging.getLogger(__name__)
SERVICE = "window-controller"
DECISIONS_MAXLEN = 10_000


def _opt(x: float | None) -> str:
    return "" if x is None else f"{x:.6g}"


class WindowController:
    def __init__(self, r: redis.Redis, keys: Keys, cfg: WindowControllerConfig, default_keep: int, *,
                 consumer: str = "window-controller", burst: bool = False, heartbeat_ttl_s: float = 15.0,
                 stop: StopFlag | None = None, reader: SignalReader | None = None, backoff_max_s: float = 5.0,
                 gauges: MetricGauges | None = None) -> None:
        self.r, self.keys, self.cfg, self.burst = r, keys, cfg, burst
        self.gauges = gauges  # Prometheus mirror of the window_controller/* metrics (None: no endpoint)
        self.stop = stop or StopFlag()
        self.loop = ConsumerLoop(SERVICE, self.stop, backoff_max_s=backoff_max_s)
        self.reader = reader or SignalReader(r, keys)
        if burst:
            self.reader.cursor = "0-0"  # burst: decide on everything already recorded
        self.state: State = initial_state(cfg, cfg.initial_keep or default_keep)
        self.written: str | None = None  # the last keep_versions this controller wrote
        self._heartbeat = Heartbeat(r, keys, SERVICE, consumer, heartbeat_ttl_s)

    def _control(self) -> str | None:
        raw = self.r.hget(self.keys.control, "keep_versions")
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)

    def _write(self, keep: int) -> None:
        self.r.hset(self.keys.control, "keep_versions", str(keep))
        self.written = str(keep)

    def start(self) -> None:
        """Take over the live window: an operator's value if set, else the configured start."""
        current = self._control()
        if current is not None and current.strip().isdigit() and current.isascii() and int(current) > 0:
            self.state = initial_state(self.cfg, int(current))
        self._write(self.state.keep)
        if not self.burst:
            self.reader.prime()
        name, target = steered(self.cfg)
        log.info("window controller started keep_versions=%d (bounds %d..%d, steering %s to %.4g)",
                 self.state.keep, self.cfg.min_keep, self.cfg.max_keep, name, target)

    def _follow_operator(self) -> None:
        current = self._control()
        if current is None or current == self.written:
            return
        if current.strip().isdigit() and current.isascii() and int(current) > 0:
            log.info("operator set keep_versions=%s (controller had %s): following it", current, self.written)
            self.state = replace(self.state, keep=int(current), streak=0)
            self.written = current
        else:  # off, or a bad value the collector ignores: put ours back
            log.warning("keep_versions=%r in %s is not a window this controller keeps; restoring %d",
                        current, self.keys.control, self.state.keep)
            self._write(self.state.keep)

    def tick(self) -> Decision:
        self._follow_operator()
        signals = self.reader.read()
        decision = decide(self.cfg, self.state, signals)
        self.state = decision.state
        if decision.changed:
            self._write(decision.after)
        self._record(decision, signals)
        return decision

    def _record(self, d: Decision, s: Signals) -> None:
        measured = s.steps > 0 or s.drop_rate is not None  # a tick that saw nothing is logged at DEBUG only
        (name, target), value = steered(self.cfg), _opt(drift(self.cfg, s))
        log.log(logging.INFO if measured or d.changed else logging.DEBUG,
                "window decision keep_versions=%d->%d proposal=%+d reason=%s %s=%s (target %.4g) logprob_diff=%s "
                "wait_fraction=%s drop_rate=%s trainer_steps=%d floor=%d", d.before, d.after, d.proposal, d.reason,
                name, value, target, _opt(s.logprob_diff), _opt(s.wait_fraction),
                _opt(s.drop_rate), s.steps, d.state.floor)
        fields = {"keep_before": str(d.before), "keep_after": str(d.after), "proposal": str(d.proposal),
                  "reason": d.reason, "logprob_diff": _opt(s.logprob_diff), "mismatch_kl": _opt(s.mismatch_kl),
                  "ess": _opt(s.ess), "wait_fraction": _opt(s.wait_fraction),
                  "drop_rate": _opt(s.drop_rate), "trainer_steps": str(s.steps), "floor": str(d.state.floor),
                  "signal": name, "drift": value, "target": f"{target:.6g}",
                  "target_logprob_diff": f"{self.cfg.target_logprob_diff:.6g}", "at": f"{time.time():.3f}"}
        self.r.xadd(self.keys.window_controller_decisions, fields, maxlen=DECISIONS_MAXLEN, approximate=True)
        metrics = {"window_controller/keep_versions": d.after, "window_controller/changed": int(d.changed),
                   "window_controller/proposal": d.proposal}
        report_metrics(self.r, self.keys, SERVICE, metrics)
        if self.gauges is not None:
            self.gauges.set(metrics)

    def run(self) -> int:
        started = False

        def step() -> bool:
            nonlocal started
            if not started:
                self.start()
                started = True
            self.tick()
            self._heartbeat.beat({"keep_versions": self.state.keep})
            return False  # one decision per tick: burst ends here, otherwise wait for the next tick

        self.loop.run(step, burst=self.burst, idle=lambda: self.stop.wait(self.cfg.interval_s))
        log.info("window controller stopping keep_versions=%d", self.state.keep)
        return 0
