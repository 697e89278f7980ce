"""Model builds: every run records the weights it started from, and one experiment folder holds one build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from paths import REPO

from shared.lifecycle import StopFlag
from tools.experiments.build import BuildMismatch, builds_text, check_builds, model_build
from tools.experiments.harness import RESULT, Experiment
from tools.experiments.spec import load_spec


def weights(folder: Path, **files: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name.replace("_", ".")).write_bytes(data)
    return folder


def test_a_build_follows_the_weight_bytes_and_nothing_else(tmp_path: Path) -> None:
    a = weights(tmp_path / "a", model_safetensors=b"w" * 3000, config_json=b"{}")
    b = weights(tmp_path / "b", model_safetensors=b"w" * 3000, config_json=b'{"other": 1}')
    c = weights(tmp_path / "c", model_safetensors=b"w" * 2999 + b"x")
    build = model_build(a)
    assert build is not None and len(build) == 12 and int(build, 16) >= 0
    assert model_build(b) == build  # the config is not the weights
    assert model_build(c) != build  # one byte of the weights is


def test_sharded_weights_hash_in_name_order_and_bin_is_the_fallback(tmp_path: Path) -> None:
    one = weights(tmp_path / "one", **{"model-00001_safetensors": b"first", "model-00002_safetensors": b"second"})
    both = weights(tmp_path / "both", model_safetensors=b"firstsecond")
    assert model_build(one) == model_build(both)  # the shards' bytes in name order
    legacy = weights(tmp_path / "legacy", pytorch_model_bin=b"firstsecond")
    assert model_build(legacy) == model_build(both)
    weights(legacy, model_safetensors=b"other")
    assert model_build(legacy) != model_build(both)  # safetensors win where both are present


def test_no_local_weights_means_no_build(tmp_path: Path) -> None:
    assert model_build("Qwen/Qwen3-0.6B") is None  # a hub id
    assert model_build(tmp_path / "not-built-yet") is None
    assert model_build(weights(tmp_path / "empty", config_json=b"{}")) is None


def test_check_builds_refuses_another_build_and_names_the_runs() -> None:
    check_builds({"a/seed0": "aaa", "b/seed0": "aaa"}, "aaa", "models/m", "runs/x")
    check_builds({"a/seed0": None}, "aaa", "models/m", "runs/x")  # an older row without a build
    check_builds({"a/seed0": "aaa"}, None, "models/m", "runs/x")  # nothing to compare yet
    with pytest.raises(BuildMismatch, match=r"models/m is build bbb.*a/seed0 \(aaa\)"):
        check_builds({"a/seed0": "aaa", "b/seed0": "bbb"}, "bbb", "models/m", "runs/x")


def test_the_report_line_names_one_build_or_warns() -> None:
    assert builds_text({"a": ["aaa", "aaa"], "b": ["aaa"]}) == "aaa"
    assert builds_text({"a": ["aaa"], "b": ["bbb"]}) == "per variant: a aaa; b bbb"
    mixed = builds_text({"a": ["aaa", "bbb"], "b": ["aaa"]})
    assert mixed.startswith("MIXED within a (aaa bbb)") and "do not pool" in mixed
    assert builds_text({"a": [None]}) == "unknown (no run recorded one)"
    assert builds_text({"a": ["aaa", None]}) == "aaa; 1 runs without a recorded build"


def spec_with_model(tmp_path: Path, model: Path) -> Path:
    spec = {"name": "t", "base": str(REPO / "configs/test.yaml"), "baseline": "sync", "seeds": [0, 1],
            "stop": {"steps": 3}, "targets": [0.5], "overrides": {"model": {"path": str(model)}},
            "variants": {"sync": {"pacing.max_versions_ahead": 0}, "async": {"pacing.max_versions_ahead": 2}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def finish(exp: Experiment, key: str, build: str | None) -> None:
    run = next(r for r in exp.spec.runs if r.key == key)
    folder = exp.folder(run)
    folder.mkdir(parents=True)
    (folder / RESULT).write_text(json.dumps({"row": {"variant": run.variant, "seed": run.seed,
                                                     "model_build": build}, "duration_s": 1.0}))


def test_the_harness_refuses_to_add_runs_from_another_build(tmp_path: Path) -> None:
    model = weights(tmp_path / "model", model_safetensors=b"the weights of this host")
    exp = Experiment(load_spec(spec_with_model(tmp_path, model)), tmp_path / "out", 1, StopFlag(), show=False)
    finish(exp, "sync/seed0", "0123456789ab")  # made on another host
    assert exp.run_all() == 2
    started = [p for p in (tmp_path / "out" / "t").rglob("*") if p.is_dir() and p.name.startswith("seed")]
    assert [p.relative_to(tmp_path / "out" / "t").as_posix() for p in started] == ["sync/seed0"]  # nothing launched


def test_the_same_build_is_accepted_and_the_check_follows_the_weights(tmp_path: Path) -> None:
    model = weights(tmp_path / "model", model_safetensors=b"weights")
    exp = Experiment(load_spec(spec_with_model(tmp_path, model)), tmp_path / "out", 1, StopFlag(), show=False)
    finish(exp, "sync/seed0", model_build(model))
    exp.check_build(exp.spec.runs[1])  # same build: no error
    (model / "model.safetensors").write_bytes(b"weights rebuilt elsewhere")  # size changes: hashed again
    with pytest.raises(BuildMismatch):
        exp.check_build(exp.spec.runs[1])
