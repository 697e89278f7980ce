"""The configuration reference is generated from shared/config.py and the committed page is current."""

from __future__ import annotations

from pathlib import Path

from shared.config import DressageConfig
from tools.dev import configref

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_reference_is_up_to_date() -> None:
    assert DOC.read_text() == configref.render(), (
        "docs/configuration.md is stale: run `python -m tools.dev.configref > docs/configuration.md`")


def test_every_section_and_key_is_documented_with_its_env_var() -> None:
    page = configref.render()
    for section, info in DressageConfig.model_fields.items():
        assert f"## `{section}`" in page
        section_cls = info.annotation  # every field is a Section class
        assert section_cls is not None
        for key in section_cls.model_fields:
            assert f"`DRESSAGE_{section.upper()}_{key.upper()}`" in page


def test_bounds_and_comments_come_from_the_models() -> None:
    page = configref.render()
    row = next(line for line in page.splitlines() if line.startswith("| `max_retries` |"))
    assert ">= 0, <= 100" in row and "at most 1 + max_retries attempts per group" in row
    stop_grace = next(line for line in page.splitlines() if line.startswith("| `stop_grace_s` |"))
    assert "SIGTERM -> SIGKILL" in stop_grace
