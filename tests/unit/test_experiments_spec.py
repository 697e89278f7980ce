"""Experiment specs: every run's config is validated before anything runs, and errors name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from paths import REPO

from tools.experiments.harness import main as experiment_main
from tools.experiments.spec import SpecError, interleaved, load_spec, nest


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


def test_runs_are_made_seed_by_seed_with_the_variants_in_spec_order(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, variants={"sync": {}, "a": {}, "b": {}}))
    assert [r.key for r in interleaved(spec.runs)] == ["sync/seed0", "a/seed0", "b/seed0",
                                                       "sync/seed1", "a/seed1", "b/seed1"]
    assert [r.key for r in spec.runs][:2] == ["sync/seed0", "sync/seed1"]  # the spec's (and summary's) order


def test_variants_subset_keeps_spec_order_and_needs_the_baseline(tmp_path: Path, capsys: Any) -> None:
    spec = load_spec(write_spec(tmp_path, variants={"sync": {}, "a": {}, "b": {}}), only=["b", "sync"])
    assert [r.key for r in spec.runs] == ["sync/seed0", "sync/seed1", "b/seed0", "b/seed1"]
    with pytest.raises(SpecError, match="--variants: unknown.*'c'"):
        load_spec(write_spec(tmp_path), only=["sync", "c"])
    with pytest.raises(SpecError, match="--variants: must include the baseline 'sync'"):
        load_spec(write_spec(tmp_path), only=["async"])
    assert experiment_main([str(write_spec(tmp_path)), "--variants", "sync", "--check"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["  sync/seed0", "  sync/seed1"]


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
    ({"stop": {"accuracy": 0.5, "max_steps": 9}, "overrides": {"eval.every_versions": 0}}, "stop.accuracy needs"),
    ({"stop": {"accuracy": 0.5, "max_steps": 9}, "overrides": {"eval.every_versions": 2, "eval.defer": True}},
     "stop.accuracy needs"),
    ({"stop": {"seconds": 60}, "overrides": {"eval.every_versions": 2, "eval.defer": True}}, "eval.defer"),
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


@pytest.mark.parametrize("path", sorted((REPO / "configs/experiments").glob("*.yaml")), ids=lambda p: p.stem)
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_every_shipped_spec_and_its_quick_preset_validate(path: Path, quick: bool) -> None:
    spec = load_spec(str(path), quick=quick)  # every run's config validated against the config models
    assert spec.runs and spec.baseline in spec.variants


def _watch_one(tmp_path: Path, stop: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    """Apply the runner's stop rules once to a live child (``sleep``) whose metrics are ``rows``."""
    import json
    import subprocess
    import time

    from shared.lifecycle import StopFlag
    from tools.experiments.harness import Active, Experiment

    tmp_path.mkdir()
    spec = load_spec(str(write_spec(tmp_path, stop=stop)))
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        active = Active(spec.runs[0], folder, proc, time.monotonic() - 5.0, None)
        Experiment(spec, tmp_path / "out", 1, StopFlag(), show=False)._watch(active)
        if active.stopped_by_rule:
            assert proc.wait(10) == -15  # SIGTERM to the run's process group
        return active.stopped_by_rule
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_accuracy_rule_stops_a_run_once_a_trained_version_reaches_it(tmp_path: Path) -> None:
    stop = {"accuracy": 0.5, "max_steps": 100}
    start = [{"service": "eval-worker", "eval/version": 0, "eval/accuracy": 0.9}]  # the starting model
    assert _watch_one(tmp_path / "a", stop, start) is None
    trained = [*start, {"service": "eval-worker", "eval/version": 5, "eval/accuracy": 0.55}]
    assert _watch_one(tmp_path / "b", stop, trained) == "eval accuracy >= 0.5"


def test_the_seconds_rule_stops_a_run_after_its_wall_clock(tmp_path: Path) -> None:
    assert _watch_one(tmp_path / "a", {"seconds": 60}, []) is None
    assert _watch_one(tmp_path / "b", {"seconds": 1}, []) == "wall-clock 1 s"
