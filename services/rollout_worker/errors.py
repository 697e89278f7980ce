"""Named failures of one trajectory; any of them fails the whole prompt group.

``code`` is a short machine-readable token (the proxy's own ``error`` for its 502s, e.g.
``partial_rollout_staleness_exceeded``); ``retryable`` is False only for failures that another
attempt cannot fix (unknown task, a reference the task refuses), which are dead-lettered at once.
"""

from __future__ import annotations

from shared.errors import DressageError

# The proxy's 502 ``detail.error`` values (ARCHITECTURE, proxy contract).
STALENESS_EXCEEDED = "partial_rollout_staleness_exceeded"
PROXY_502_CODES = frozenset({STALENESS_EXCEEDED, "trajectory_version_changed", "generation_preempted"})


class TrajectoryFailed(DressageError):
    """One trajectory could not finish; ``code`` classifies it, ``message`` says why."""

    def __init__(self, code: str, message: str = "", *, retryable: bool = True,
                 session_id: str | None = None) -> None:
        self.code = code
        self.message = message
        self.retryable = retryable
        self.session_id = session_id
        super().__init__(self.text)

    @property
    def text(self) -> str:
        """``"<code>: <message> (session <id>)"``, the error text carried on the wire."""
        where = f" (session {self.session_id})" if self.session_id else ""
        return f"{self.code}: {self.message}{where}" if self.message else f"{self.code}{where}"

    def at(self, session_id: str) -> TrajectoryFailed:
        """The same failure, attributed to ``session_id`` if it had no session yet."""
        if self.session_id is None:
            self.session_id = session_id
            self.args = (self.text,)
        return self
