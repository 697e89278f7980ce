"""Shared fixtures: a private redis-server per test session (never the machine's own Redis)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from shared.keys import Keys
from shared.redisproc import RedisProcess

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A real redis-server on a free loopback port with a temporary directory (AOF on)."""
    server = RedisProcess(directory=tmp_path_factory.mktemp("redis"), appendonly=True).start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_client(redis_server: RedisProcess) -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, decode_responses=False)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    """A unique prefix per test, so tests sharing the session's server never see each other's keys."""
    return Keys(f"t{uuid.uuid4().hex[:10]}")
