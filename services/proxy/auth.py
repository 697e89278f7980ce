"""Who may call which proxy route: operator scope, agent scope, per-session tokens (pure, no I/O).

Scopes (with no key configured at all the proxy is open, for development only):
* ``operator`` (``proxy.operator_key``): the control plane -- ``/v1/rollout/*``, ``/metrics`` and
  every ``/v1/sessions/...`` route for any session. No model calls.
* ``agent`` (``proxy.api_key``, held by rollout workers): every other ``/v1/*`` route (chat,
  generate, models and whatever model API is added later: the rule is by prefix, not by route
  list) and ``/s/{any}/v1/*``, plus ``/v1/sessions/{id}`` for sessions this credential created.
* ``session`` (``shared.edge.session_token(api_key, sid)``, handed to one black-box agent): only
  ``/s/{sid}/v1/*`` of that one session; anything else is 403.
Operator routes with only ``api_key`` set are refused (403): the agent key never pauses the fleet.
``/health`` is open. A session is bound to the owner of the credential that created it
(``Principal.owner``); a request by another owner sees 404, as if the session did not exist.
The principal of the running request is in the context variable ``PRINCIPAL`` (set by the guard),
so every route that opens a session applies the binding without passing it along.
"""

from __future__ import annotations

import hmac
from contextvars import ContextVar
from dataclasses import dataclass

from shared.edge import SESSION_TOKEN_PREFIX, bearer, same_secret, session_token

OPEN_PATHS = frozenset({"/health"})
OPERATOR_PREFIXES = ("/v1/rollout/", "/metrics", "/v1/sessions")


@dataclass(frozen=True)
class Principal:
    scope: str  # "open" (no keys configured or /health), "operator", "agent", "session"
    owner: str | None = None  # sessions it creates are bound to this; None = unbound (open mode)
    session_id: str | None = None  # the one session a "session" principal may use

    @property
    def any_session(self) -> bool:
        return self.scope in ("open", "operator")

    def may_use(self, session_id: str, session_owner: str | None) -> bool:
        if self.session_id is not None and session_id != self.session_id:
            return False
        return self.any_session or session_owner == self.owner


OPEN = Principal("open")
PRINCIPAL: ContextVar[Principal] = ContextVar("proxy_principal", default=OPEN)


@dataclass(frozen=True)
class Refusal:
    status: int  # 401 (no or bad credential) or 403 (valid credential, wrong scope)
    message: str


def _session_in_path(path: str) -> str | None:
    """``sid`` of a ``/s/{sid}/v1/...`` path, matched whole (the rest must start with ``/v1/``)."""
    if not path.startswith("/s/"):
        return None
    sid, sep, rest = path[3:].partition("/")
    return sid if sep and sid and (rest == "v1" or rest.startswith("v1/")) else None


class Authorizer:
    def __init__(self, agent_key: str | None, operator_key: str | None) -> None:
        self.agent_key, self.operator_key = agent_key, operator_key

    @property
    def open(self) -> bool:
        return self.agent_key is None and self.operator_key is None

    def decide(self, path: str, headers: list[tuple[bytes, bytes]]) -> Principal | Refusal:
        if self.open or path in OPEN_PATHS:
            return OPEN
        token = bearer(headers)
        operator_route = path.startswith(OPERATOR_PREFIXES)
        path_sid = _session_in_path(path)
        if same_secret(token, self.operator_key):
            if operator_route:
                return Principal("operator")
            return Refusal(403, "the operator key has no agent scope (model calls need the agent key)")
        if same_secret(token, self.agent_key):
            if operator_route and not path.startswith("/v1/sessions/"):
                return Refusal(403, "operator scope: the agent key cannot call this route")
            return Principal("agent", owner="agent")
        if token is not None and token.startswith(SESSION_TOKEN_PREFIX.encode()) and self.agent_key is not None:
            if path_sid is not None and hmac.compare_digest(token, session_token(self.agent_key, path_sid).encode()):
                return Principal("session", owner="agent", session_id=path_sid)
            return Refusal(403, "a session token is valid only under /s/{its session}/v1/")
        return Refusal(401, "missing or invalid bearer token")
