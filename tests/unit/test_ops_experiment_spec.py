"""Experiment specs: every run's config is validated before anything runs, and errors name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from services.ops.experiment import main as experiment_main
from services.ops.experiment_spec import SpecError, load_spec, nest

REPO = Path(__file__).resolve().parents[2]


def write_spec(tmp_path: Path, **changes: Any) -> Path:
    spec: dict[str, Any] = {
        "name": "t", "base": str(REPO / "configs/test.yaml"), "baseline": "sync", "seeds": [0, 1],
        "stop": {"steps": 3}, "targets": [0.5],
        "variants": {"sync": {"pacing": {"max_versions_ahead": 0}, "staleness.keep_versions": 0},
                     "async": {"DRESSAGE_PACING_MAX_VERSIONS_AHEAD": 2}},
        "quick": {"seeds": [7], "stop": {"steps": 1}},
    }
    spec.update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_runs_are_variants_times_seeds_with_merged_overrides(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path))
    assert [r.key for r in spec.runs] == ["sync/seed0", "sync/seed1", "async/seed0", "async/seed1"]
    sync1 = spec.runs[1].config
    assert sync1["pacing"]["max_versions_ahead"] == 0 and sync1["staleness"]["keep_versions"] == 0
    assert sync1["train"]["seed"] == 1 and sync1["engine"]["seed"] == 1 and sync1["prompt_buffer"]["shuffle_seed"] == 1
    assert sync1["train"]["max_steps"] == 3
    assert sync1["rollout"]["max_new_tokens"] == 12  # from the base YAML
    assert spec.runs[2].config["pacing"]["max_versions_ahead"] == 2


def test_quick_preset_changes_seeds_stop_and_folder(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path), quick=True)
    assert spec.name == "t-quick" and spec.seeds == [7] and spec.stop.steps == 1
    assert [r.key for r in spec.runs] == ["sync/seed7", "async/seed7"]


@pytest.mark.parametrize(("changes", "named"), [
    ({"variants": {"sync": {"pacing": {"max_versions_ahaed": 0}}}}, "pacing.max_versions_ahaed"),
    ({"variants": {"sync": {"pacingg.max_versions_ahead": 0}}}, "pacingg"),
    ({"variants": {"sync": {"DRESSAGE_NOPE_X": 1}}}, "DRESSAGE_NOPE_X"),
    ({"variants": {"sync": {"train": {"lr": -1}}}}, "train.lr"),
    ({"overrides": {"rollout.concurrency": 0}}, "rollout.concurrency"),
    ({"seeds": []}, "seeds"),
    ({"colour": "blue"}, "colour"),
    ({"baseline": "synchronous"}, "baseline"),
    ({"stop": {"steps": 3, "seconds": 10}}, "stop"),
    ({"stop": {"accuracy": 0.5}}, "cap"),
    ({"quick": {"variants": ["async", "fast"]}}, "quick.variants"),
])
def test_a_bad_spec_names_the_key(tmp_path: Path, changes: dict[str, Any], named: str) -> None:
    with pytest.raises(SpecError, match=named.replace(".", r"\.")):
        load_spec(write_spec(tmp_path, **changes), quick="quick" in changes)


def test_a_bad_spec_exits_2_before_any_run_starts(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "experiments"
    path = write_spec(tmp_path, variants={"sync": {}, "async": {"pacing": {"max_versions_ahead": 1, "bogus": 1}}})
    assert experiment_main([str(path), "--out", str(out)]) == 2
    assert "variants.async" in capsys.readouterr().err
    assert not out.exists()  # nothing ran, not even the valid variant


def test_override_spellings_are_equivalent() -> None:
    want = {"pacing": {"max_versions_ahead": 0}}
    assert nest({"pacing": {"max_versions_ahead": 0}}, "x") == want
    assert nest({"pacing.max_versions_ahead": 0}, "x") == want
    assert nest({"DRESSAGE_PACING_MAX_VERSIONS_AHEAD": 0}, "x") == want
    assert nest({"DRESSAGE_PROMPT_BUFFER_N_SAMPLES": 4}, "x") == {"prompt_buffer": {"n_samples": 4}}
    with pytest.raises(SpecError, match="lr"):
        nest({"lr": 0.1}, "x")
