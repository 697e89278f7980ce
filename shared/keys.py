"""Redis key names of the wire contract (docs/streams.md#names), derived from one prefix.

Every service builds its names here, so a prefix change moves a whole deployment at once, and a key
one process writes and another reads is spelled once. A new key gets a property here, never a string
at its call site.
"""

from __future__ import annotations

from dataclasses import dataclass

# Consumer group names (docs/streams.md#names).
GROUP_ROLLOUT = "rollout"
GROUP_COLLECTOR = "collector"
GROUP_TRAINER = "trainer"


@dataclass(frozen=True)
class Keys:
    prefix: str = "dressage"

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    @property
    def prompts(self) -> str:
        return self._k("prompts")

    @property
    def rollouts(self) -> str:
        return self._k("rollouts")

    @property
    def batches(self) -> str:
        return self._k("batches")

    @property
    def dead(self) -> str:
        return self._k("dead")

    @property
    def weights_channel(self) -> str:
        return self._k("weights")

    @property
    def weights_latest(self) -> str:
        return self._k("weights", "latest")

    @property
    def weights_log(self) -> str:
        return self._k("weights", "log")

    @property
    def control(self) -> str:
        return self._k("control")

    @property
    def metrics(self) -> str:
        return self._k("metrics")

    def health(self, service: str, consumer: str) -> str:
        return self._k("health", service, consumer)

    def health_pattern(self) -> str:
        return self._k("health", "*")

    @property
    def health_prefix(self) -> str:
        """``{p}:health:``, the start of every heartbeat key (``dressage status`` scans under it)."""
        return self._k("health") + ":"

    # Counters and state one process writes and another reads (docs/streams.md#names has the table).

    @property
    def stats(self) -> str:
        """Hash of pipeline counters: every service writes, prompt-buffer (pacing) and ops read."""
        return self._k("stats")

    @property
    def prompt_buffer_cursor(self) -> str:
        """Hash ``epoch``, ``position``, ``rows``: where the prompt-buffer resumes after a restart."""
        return self._k("prompt_buffer", "cursor")

    @property
    def prompt_buffer_brake(self) -> str:
        """Hash: the dead-letter brake's state (prompt-buffer writes, ``dressage status`` reads)."""
        return self._k("prompt_buffer", "brake")

    @property
    def prompt_buffer_dataset(self) -> str:
        """Hash ``path``, ``rows``, ``malformed``, ``first_error``: the dataset as the prompt-buffer read it."""
        return self._k("prompt_buffer", "dataset")

    @property
    def collector_done(self) -> str:
        """Set of ``group_id:attempt`` the collector has committed (dedup)."""
        return self._k("collector", "done")

    @property
    def collector_closed(self) -> str:
        """Set of ``group_id`` batched or dead-lettered (dedup across attempts)."""
        return self._k("collector", "closed")

    @property
    def collector_window(self) -> str:
        """Hash: the window in force (collector writes, ``dressage status`` reads)."""
        return self._k("collector", "window")

    @property
    def collector_decisions(self) -> str:
        """Stream: one entry per committed outcome of a group attempt."""
        return self._k("collector", "decisions")

    @property
    def window_controller_decisions(self) -> str:
        """Stream: one entry per adaptive-window tick."""
        return self._k("window_controller", "decisions")

    @property
    def trainer_trained(self) -> str:
        """Stream: one entry per acknowledged step (the history checker reads it)."""
        return self._k("trainer", "trained")

    @property
    def eval_pinned(self) -> str:
        """Set of checkpoint paths with an evaluation queued or running."""
        return self._k("eval", "pinned")

    @property
    def ops_degraded(self) -> str:
        """Hash: services ``dressage up`` gave up restarting (``dressage status`` reads it)."""
        return self._k("ops", "degraded")
