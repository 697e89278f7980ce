"""Named proxy errors, each carrying its HTTP status and the JSON ``detail`` the client receives.

Every error a route can raise is a ``ProxyError``; the app turns it into one body that two kinds
of clients read (``error_body``): OpenAI's ``{"error": {"message", "type", "param", "code"}}`` --
what the ``openai`` SDK shows -- with the error's extra fields (``versions``, ``version_span``,
``max_preempts``, ``session_id``...) kept inside that object, and the original's
``{"detail": {"error": <code>, "message", ...}}`` beside it. Bodies name the offending field or id
and never contain secrets, stack traces or engine URLs with credentials.
"""

from __future__ import annotations

from typing import Any

from shared import codes
from shared.errors import DressageError

# OpenAI's error ``type`` by HTTP status (their SDK maps the status to an exception class).
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 429: "rate_limit_error", 502: "upstream_error",
                 503: "service_unavailable_error"}


def error_body(status: int, detail: dict[str, Any]) -> dict[str, Any]:
    """``{"error": {message, type, param, code, **extra}, "detail": detail}`` for ``detail`` =
    ``{"error": <code>, "message": ..., "field"?: ..., **extra}``."""
    extra = {k: v for k, v in detail.items() if k not in ("error", "message", "field")}
    openai = {"message": str(detail.get("message") or detail.get("error") or ""),
              "type": _OPENAI_TYPES.get(status, "server_error"), "param": detail.get("field"),
              "code": detail.get("error"), **extra}
    return {"error": openai, "detail": detail}


class ProxyError(DressageError):
    """Base: ``status`` (HTTP code), ``code`` (machine-readable ``error``), ``extra`` (more detail)."""

    status = 500
    code = codes.INTERNAL_ERROR

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra
        self.headers: dict[str, str] = {}

    def detail(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.extra}

    def detail_body(self) -> dict[str, Any]:
        """The whole JSON response body (see ``error_body``)."""
        return error_body(self.status, self.detail())


class InvalidRequest(ProxyError):
    """A body or header that fails validation; ``field`` names it (422)."""

    status = 422
    code = codes.INVALID_REQUEST

    def __init__(self, field: str, message: str, **extra: Any) -> None:
        super().__init__(f"{field}: {message}", field=field, **extra)


class UnsupportedParameter(ProxyError):
    """A field an upstream API accepts that would change the result and is not implemented (400)."""

    status = 400
    code = codes.UNSUPPORTED_PARAMETER

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)


class SessionNotFound(ProxyError):
    status = 404
    code = codes.SESSION_NOT_FOUND


class SessionConflict(ProxyError):
    """The session cannot take this request (finalized, step limit, mode mismatch) (409)."""

    status = 409
    code = codes.SESSION_CONFLICT


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


class UpstreamStreamError(UpstreamError):
    """An engine reported an error inside a streamed answer (SGLang: HTTP 200, ``data: {"error": ...}``).

    Raised with the status and body the same error has unstreamed (a 400 with that object), so the
    client sees one error either way; its own class only keeps it from being read as "this engine
    cannot stream" (``EngineClient.generate``)."""


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
    code = codes.PROXY_SHUTTING_DOWN
