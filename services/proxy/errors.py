"""Named proxy errors, each carrying its HTTP status and the JSON ``detail`` the client receives.

Every error a route can raise is a ``ProxyError``; the app turns it into
``{"detail": {"error": <code>, ...}}`` with ``status``. Bodies name the offending field or id and
never contain secrets, stack traces or engine URLs with credentials.
"""

from __future__ import annotations

from typing import Any

from shared import codes
from shared.errors import DressageError


class ProxyError(DressageError):
    """Base: ``status`` (HTTP code), ``code`` (machine-readable ``error``), ``extra`` (more detail)."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra
        self.headers: dict[str, str] = {}

    def detail(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.extra}

    def detail_body(self) -> dict[str, Any]:
        """The whole JSON response body: ``{"detail": {...}}``."""
        return {"detail": self.detail()}


class InvalidRequest(ProxyError):
    """A body or header that fails validation; ``field`` names it (422)."""

    status = 422
    code = "invalid_request"

    def __init__(self, field: str, message: str, **extra: Any) -> None:
        super().__init__(f"{field}: {message}", field=field, **extra)


class SessionNotFound(ProxyError):
    status = 404
    code = "session_not_found"


class SessionConflict(ProxyError):
    """The session cannot take this request (finalized, step limit, mode mismatch) (409)."""

    status = 409
    code = "session_conflict"


class OverCapacity(ProxyError):
    """Too many generations in flight or too many sessions; retry after ``Retry-After`` (503)."""

    status = 503
    code = codes.OVER_CAPACITY

    def __init__(self, message: str, retry_after_s: int = 1, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.headers = {"Retry-After": str(retry_after_s)}


class UpstreamUnavailable(ProxyError):
    """No engine could be reached (connection refused / connect timeout / read timeout) (503)."""

    status = 503
    code = codes.UPSTREAM_UNAVAILABLE


class UpstreamError(ProxyError):
    """An engine answered with an error or an unparseable body (502)."""

    status = 502
    code = codes.UPSTREAM_ERROR


class GenerationPreempted(ProxyError):
    """Non-partial mode: the generation was interrupted by a pause / weight update (502)."""

    status = 502
    code = codes.GENERATION_PREEMPTED


class TrajectoryVersionChanged(ProxyError):
    """Non-partial mode: this turn would run on a version the trajectory has not used (502)."""

    status = 502
    code = codes.TRAJECTORY_VERSION_CHANGED


class SpanExceeded(ProxyError):
    """Partial mode: the session would span more than ``max_preempts + 1`` real versions (502).

    ``body`` is the exact ``detail`` dict of ``shared.staleness.SpanCheck.detail``.
    """

    status = 502
    code = codes.STALENESS_EXCEEDED

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body.get("message", "")))
        self.body = body

    def detail(self) -> dict[str, Any]:
        return dict(self.body)


class ShuttingDown(ProxyError):
    status = 503
    code = "proxy_shutting_down"
