"""shared.entry.run_service: the password policy binds the services that log in to Redis, not the engine."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from shared.config import DressageConfig
from shared.entry import run_service


def test_the_engine_starts_without_a_redis_password_where_one_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRESSAGE_REDIS_REQUIRE_PASSWORD", "true")  # what compose sets for every service
    for name in ("REDIS_PASSWORD", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    built: list[str] = []

    def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
        built.append(cfg.engine.host)
        return lambda: 0

    assert run_service("engine", [], build, doc=None, burst_help=None, uses_redis=False) == 0
    assert run_service("trainer", [], build, doc=None, burst_help=None) == 2  # a Redis user still needs one
    assert len(built) == 1
