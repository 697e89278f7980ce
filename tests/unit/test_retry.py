"""shared.retry: Redis outages at start are waited out with capped backoff; bad credentials stop at once;
``retry_until`` waits the same backoff around an async attempt, up to a deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from shared.errors import RedisAuthFailed, RedisUnavailable
from shared.retry import Backoff, check_redis, retry_until

SECRET = "hunter2-very-secret"


class FlakyRedis(redis.Redis):
    """A client whose PING raises the given errors in turn, then answers."""

    def __init__(self, *errors: Exception) -> None:
        super().__init__(host="10.0.0.9", port=6390, password=SECRET)
        self.errors = list(errors)
        self.pings = 0

    def ping(self, **kwargs: Any) -> bool:
        self.pings += 1
        if self.errors:
            raise self.errors.pop(0)
        return True


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    b = Backoff(0.1, 0.5)
    assert [b.next() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    b.reset()
    assert b.next() == 0.1


def test_transient_errors_are_waited_out_with_capped_backoff() -> None:
    slept: list[float] = []
    r = FlakyRedis(*[redis.ConnectionError("refused")] * 6, redis.BusyLoadingError("loading"))
    check_redis(r, backoff_max_s=1.0, sleep=slept.append)
    assert r.pings == 8 and slept == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("exc", [redis.AuthenticationError("invalid username-password pair"),
                                 redis.AuthenticationError("Authentication required."),
                                 redis.exceptions.NoPermissionError("this user has no permissions to run 'ping'")])
def test_bad_credentials_fail_at_once_naming_the_setting_but_not_the_secret(exc: Exception) -> None:
    r = FlakyRedis(exc)
    with pytest.raises(RedisAuthFailed) as info:
        check_redis(r, sleep=lambda s: pytest.fail("an auth error must not be retried"))
    msg = str(info.value)
    assert r.pings == 1 and "10.0.0.9:6390" in msg and "REDIS_PASSWORD" in msg and SECRET not in msg


def test_an_overall_timeout_gives_up_with_redis_unavailable() -> None:
    r = FlakyRedis(*[redis.ConnectionError("refused")] * 100)
    with pytest.raises(RedisUnavailable, match="did not answer within 0.05s"):
        check_redis(r, timeout_s=0.05, sleep=lambda s: None)


def test_retry_until_backs_off_between_tries_and_gives_up_at_its_deadline() -> None:
    answers, slept = [False, False, True], []

    async def attempt() -> bool:
        return answers.pop(0)

    async def sleep(s: float) -> None:
        slept.append(s)

    assert asyncio.run(retry_until(attempt, 10.0, Backoff(0.05, 1.0), sleep)) is True
    assert slept == [0.05, 0.1] and answers == []

    async def never() -> bool:
        return False

    assert asyncio.run(retry_until(never, 0.0, Backoff(0.05, 1.0), sleep)) is False  # no wait fits
