"""Redis key names of the wire contract (docs/streams.md#names), derived from one prefix.

Every service builds its names here, so a prefix change moves a whole deployment at once.
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

    def custom(self, *parts: str) -> str:
        """A service-private key under the prefix, e.g. ``custom("prompt_buffer", "cursor")``."""
        return self._k(*parts)
