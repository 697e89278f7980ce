"""Shared fixtures: a private redis-server per test session (never the machine's own Redis); how
`make test`'s two test processes share the files (pytest-xdist, ``--dist loadfile``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
from scheduling import make_scheduler
from summaries import read_summaries

from shared.keys import Keys
from shared.redisproc import RedisProcess

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _FileOrTestScheduling:
    """pytest-xdist's hook (registered only where xdist is installed): loadfile, with SPREAD files split and
    FIRST files handed out first (tests/scheduling.py)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        return make_scheduler(config, log)


def _by_file(config: pytest.Config) -> bool:
    """True under `make test`'s scheduling: xdist installed and ``--dist loadfile`` asked for."""
    return config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadfile"


def pytest_configure(config: pytest.Config) -> None:
    if _by_file(config):
        config.pluginmanager.register(_FileOrTestScheduling(), "dressage-file-or-test-scheduling")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the main process prints
        return
    for line in read_summaries(config):
        terminalreporter.write_line(line)


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
