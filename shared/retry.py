"""Redis at service start: wait out an outage with bounded backoff, stop at once on bad credentials.

``check_redis(r)`` PINGs until Redis answers. A refused connection, a timeout or a Redis still
loading its AOF is transient: it is waited out with exponential backoff capped at ``backoff_max_s``
(optionally bounded overall by ``timeout_s`` -> ``RedisUnavailable``). A wrong or missing password,
or an ACL user that may not even PING, is not transient — redis-py reports it as a *connection*
error, so a reconnect loop would retry it forever — and raises ``RedisAuthFailed`` at once. Its
message names the endpoint, the user and the settings to fix, never the password.
``Backoff`` is the bounded exponential delay schedule used here (0.1 s doubling up to the cap), and
``retry_until`` the same wait around any async attempt (the proxy's ``/flush_cache`` after a weight load).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis

from shared.errors import RedisAuthFailed, RedisUnavailable

log = logging.getLogger(__name__)

TRANSIENT = (redis.ConnectionError, redis.TimeoutError)  # what an outage looks like to redis-py (AOF loading too)


class Backoff:
    def __init__(self, first_s: float = 0.1, max_s: float = 5.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._next = first_s

    def next(self) -> float:
        """The delay to wait now; the following one doubles, up to ``max_s``."""
        delay, self._next = self._next, min(self._next * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next = self.first_s


def is_auth_error(exc: BaseException) -> bool:
    """Credentials or permissions: NOAUTH / WRONGPASS / NOPERM (retrying cannot fix these)."""
    return isinstance(exc, (redis.AuthenticationError, redis.exceptions.NoPermissionError,
                            redis.exceptions.AuthenticationWrongNumberOfArgsError))


def endpoint(r: redis.Redis) -> str:
    """``host:port/db (user U)`` of a client, for messages: no password, ever."""
    kw: dict[str, Any] = r.connection_pool.connection_kwargs
    where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
    return f"{where}/{kw.get('db', 0)} (user {kw.get('username') or 'default'})"


def check_redis(r: redis.Redis, timeout_s: float | None = None, backoff_max_s: float = 5.0,
                sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once Redis answers PING; raise ``RedisAuthFailed`` at once, ``RedisUnavailable`` after ``timeout_s``."""
    backoff = Backoff(max_s=backoff_max_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            r.ping()
            return
        except redis.RedisError as exc:
            if is_auth_error(exc):
                raise RedisAuthFailed(f"redis at {endpoint(r)} refused the credentials: {exc} — check "
                                      "REDIS_PASSWORD / redis.password (and the user in REDIS_URL)") from None
            if not isinstance(exc, TRANSIENT):
                raise
            delay = backoff.next()
            if deadline is not None and time.monotonic() + delay > deadline:
                raise RedisUnavailable(f"redis at {endpoint(r)} did not answer within {timeout_s}s: {exc}") from None
            log.warning("redis at %s not reachable (%s); retrying in %.1fs", endpoint(r), exc, delay)
            sleep(delay)


async def retry_until(attempt: Callable[[], Awaitable[bool]], timeout_s: float, backoff: Backoff | None = None,
                      sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> bool:
    """Await ``attempt()`` until it returns True, waiting ``backoff.next()`` between tries; False once the
    next wait would end past ``timeout_s``. An exception from ``attempt`` ends it (not transient here)."""
    backoff = backoff or Backoff()
    deadline = time.monotonic() + timeout_s
    while not await attempt():
        delay = backoff.next()
        if time.monotonic() + delay > deadline:
            return False
        await sleep(delay)
    return True
