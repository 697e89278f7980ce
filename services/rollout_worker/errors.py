"""Named failures of one trajectory; any of them fails the whole prompt group.

``code`` is a short machine-readable token from ``shared.codes`` (the proxy's own ``error`` for its
502s and 503s, or the worker's own); ``retryable`` is False only for failures that another attempt
cannot fix (unknown task, a reference the task refuses), which the collector dead-letters at once;
``infrastructure`` (the upstream was unavailable) failures never reach the retry budget at all.
"""

from __future__ import annotations

from shared.codes import is_infrastructure
from shared.errors import DressageError


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
    def infrastructure(self) -> bool:
        """The proxy or an engine was unavailable: not the trajectory's fault, no attempt is spent."""
        return is_infrastructure(self.code)

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
