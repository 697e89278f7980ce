"""Every machine-readable code that crosses a process boundary, each spelled once.

Three families:

* failure codes of a rollout attempt (``RolloutGroup.error_code``): the proxy's own ``detail.error``
  values (its 502s and 503s) and what the rollout worker adds for failures it sees itself;
* dead-letter reasons (``DeadLetter.reason``);
* the classification the retry budget depends on: a failure in ``INFRASTRUCTURE`` says the
  *upstream* (proxy or engine) was unavailable, not that the group did anything wrong, so it never
  spends one of the group's attempts (the worker keeps the entry pending and backs off).
"""

from __future__ import annotations

# --- failure codes of an attempt (proxy ``detail.error`` values first) -----------------------------
STALENESS_EXCEEDED = "partial_rollout_staleness_exceeded"  # 502: the session would span too many versions
TRAJECTORY_VERSION_CHANGED = "trajectory_version_changed"  # 502: non-partial turn on a new version
GENERATION_PREEMPTED = "generation_preempted"  # 502: non-partial generation interrupted by a weight update
UPSTREAM_ERROR = "upstream_error"  # 502: an engine answered with an error
UPSTREAM_UNAVAILABLE = "upstream_unavailable"  # 503: no engine reachable (refused, timed out, restarting)
OVER_CAPACITY = "over_capacity"  # 503: backpressure, waited out by the client (never a failure)
PROXY_UNREACHABLE = "proxy_unreachable"  # the proxy refused the connection (down or restarting)
PROXY_TIMEOUT = "proxy_timeout"  # no answer from the proxy in time
# 404: the proxy does not know the session (it restarted, or the session was finalized and dropped); the
# proxy's own code, kept by the worker (attempts written before 2026-12-06 say "unknown_session")
SESSION_NOT_FOUND = "session_not_found"
TRAJECTORY_TIMEOUT = "trajectory_timeout"  # the trajectory ran past rollout.trajectory_timeout_s
INVALID_PROMPT_GROUP = "invalid_prompt_group"  # unknown task / refused reference: no retry can fix it
INTERNAL_ERROR = "internal_error"  # a bug: in the runner, or the proxy's own 500
TASK_ERROR = "task_error"  # a task's own code raised, or scored a NaN/inf: not retried (doubles as a dead-letter reason)
# Proxy refusals of a request (4xx/503 ``detail.error``), never a rollout failure code of their own.
INVALID_REQUEST = "invalid_request"  # 422: a body or header fails validation (``field`` names it)
UNSUPPORTED_PARAMETER = "unsupported_parameter"  # 400: accepted upstream, changes the result, not implemented
SESSION_CONFLICT = "session_conflict"  # 409: finalized, step limit, mode mismatch
PROXY_SHUTTING_DOWN = "proxy_shutting_down"  # 503: the proxy is draining
AGENT_REWARD_INVALID = "agent_reward_invalid"  # a black-box agent's final stdout line reported an unusable reward

# Proxy 502 codes that a trajectory fails with as they are.
PROXY_502_CODES = frozenset({STALENESS_EXCEEDED, TRAJECTORY_VERSION_CHANGED, GENERATION_PREEMPTED})

# Upstream unavailable: retried with capped backoff, never spending an attempt. A proxy answering
# 502/503/504 from its front (no ``detail.error``) is an unavailable upstream too.
INFRASTRUCTURE = frozenset({UPSTREAM_UNAVAILABLE, PROXY_UNREACHABLE, PROXY_TIMEOUT,
                            "proxy_http_502", "proxy_http_503", "proxy_http_504"})

# --- dead-letter reasons --------------------------------------------------------------------------
MALFORMED = "malformed"  # the entry does not decode (original bytes kept)
UNSUPPORTED_SCHEMA = "unsupported_schema"  # a v1 entry that v2 cannot take over (docs/streams.md)
RETRIES_EXHAUSTED = "retries_exhausted"  # failed on its last attempt
STALE_RETRIES_EXHAUSTED = "stale_retries_exhausted"  # dropped by the window on its last attempt
MISSING_PROMPT_GROUP = "missing_prompt_group"  # a rollout group without the prompt to re-enqueue
INVALID_BATCH = "invalid_batch"  # trainer: a batch that decodes but cannot be trained (shapes, tokens)
UNEXPECTED_ERROR = "unexpected_error"  # trainer: anything else one batch raised (the poison guard)
# INVALID_PROMPT_GROUP (above) doubles as the reason of a failure no retry can fix.


def is_infrastructure(code: str | None) -> bool:
    """True iff a failure with ``code`` means the upstream was unavailable (no attempt is spent)."""
    return code in INFRASTRUCTURE
