"""The staleness experiment specs (issue 11: E1 window, E2 span, E3 adaptive; issue 40: E4 offpolicy): valid,
complete, and their quick presets run.

The quick runs check the plumbing only (every run of the preset finishes and lands in summary.csv),
not the science; each is a few trainer steps per variant with a random-init tiny model.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from paths import REPO

from tools.experiments.harness import main as experiment_main
from tools.experiments.spec import load_spec
from tools.reports.decisionlog import load_records
from tools.reports.replay import main as replay_main

SPECS = ["window", "span", "adaptive", "offpolicy"]


def spec_path(name: str) -> Path:
    return REPO / "configs" / "experiments" / f"{name}.yaml"


@pytest.mark.parametrize("name", SPECS)
def test_spec_is_valid_with_three_seeds_a_naive_arm_and_a_quick_preset(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the spec's base is relative to the repository root
    spec = load_spec(spec_path(name))
    assert len(spec.seeds) >= 3
    assert any(r.config.get("train", {}).get("policy_loss") == "naive" for r in spec.runs)
    quick = load_spec(spec_path(name), quick=True)
    assert quick.baseline in quick.variants and len(quick.runs) <= 3 and quick.stop.steps is not None


def test_window_spec_covers_off_1_2_4_and_span_spec_every_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    keeps = {r.config["staleness"]["keep_versions"] for r in load_spec(spec_path("window")).runs}
    assert keeps == {0, 1, 2, 4}
    span = load_spec(spec_path("span")).runs
    caps = {(r.config["proxy"]["partial_rollout"], r.config["proxy"]["max_partial_rollout_preempts"],
             r.config["train"]["mask_nonlast_version_tokens"]) for r in span}
    assert {(True, n, m) for n in (0, 1, 2, None) for m in (False, True)} | {(False, None, False)} <= caps
    adaptive = load_spec(spec_path("adaptive")).runs
    assert any(r.config.get("window_controller", {}).get("enabled") for r in adaptive)
    assert {r.config["train"].get("staleness_weight") for r in adaptive} >= {"exp", "inverse"}


def test_offpolicy_spec_crosses_eta_loss_and_staleness_control_at_4_minibatches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    spec = load_spec(spec_path("offpolicy"))
    assert len(spec.seeds) >= 5 and spec.stop.steps is not None  # every arm trains the same number of steps
    arms = set()
    for r in spec.runs:
        c = r.config
        assert c["train"]["minibatches_per_batch"] == 4 and c["model"]["task"] == "guess"
        assert c["proxy"]["partial_rollout"] is True
        control = "wait" if c["staleness"]["mode"] == "wait" else f"keep{c['staleness']['keep_versions']}"
        arms.add((c["pacing"]["max_versions_ahead"], c["train"]["policy_loss"], control,
                  c["proxy"]["max_partial_rollout_preempts"]))
    losses = ("naive", "clipped", "decoupled")
    assert {(0, loss, "keep0", None) for loss in losses} <= arms
    assert {(eta, loss, control, None) for eta in (2, 4, 8) for loss in losses
            for control in ("keep0", "keep2", "wait")} <= arms
    assert {(8, "naive", "keep0", 1), (8, "clipped", "keep0", 1)} <= arms  # the span cap at the highest eta
    steered = {r.config["window_controller"]["signal"] for r in spec.runs if r.config["window_controller"].get("enabled")}
    assert steered == {"logprob_diff", "mismatch_kl", "ess"}  # the adaptive window, by each measure
    estimated = [r.config for r in spec.runs if r.config["train"].get("proximal_logprobs") == "loglinear"]
    assert {(c["pacing"]["max_versions_ahead"], c["train"]["policy_loss"]) for c in estimated} == {(8, "decoupled")}
    quick = load_spec(spec_path("offpolicy"), quick=True)
    assert {r.config["staleness"]["mode"] for r in quick.runs} == {"drop", "wait"}


@pytest.fixture(scope="module")
def guess_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "guess-tiny"
    subprocess.run([sys.executable, "-m", "services", "init-model", "--task", "guess", "--out", str(out),
                    "--warm-steps", "0"], cwd=REPO, check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", SPECS)
def test_quick_preset_runs_end_to_end(name: str, guess_model: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    data = yaml.safe_load(spec_path(name).read_text())
    data["base"] = str(REPO / data["base"])
    data["quick"]["overrides"]["model"] = {"path": str(guess_model), "warm_steps": 0}
    data["quick"]["overrides"]["ops"] = {**data["quick"]["overrides"].get("ops", {}), "run_dir": str(tmp_path)}
    copy = tmp_path / f"{name}.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    assert experiment_main([str(copy), "--quick", "--out", str(tmp_path / "exp"), "--quiet"]) == 0
    folder = tmp_path / "exp" / f"{name}-quick"
    with (folder / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["variant"] for r in rows) == sorted(data["quick"]["variants"])
    for variant in data["quick"]["variants"]:
        run = folder / variant / "seed0"
        assert (run / "decisions.jsonl").exists()  # every run keeps its collector decisions for replay
        # The recorded decisions of a real run, replayed under the run's own windows, are reproduced
        # exactly (exit 0; 1 would name the decisions that differ).
        assert load_records(run / "decisions.jsonl"), variant
        assert replay_main([str(run)]) == 0, variant
        row = next(r for r in rows if r["variant"] == variant)
        assert int(row["trained_n"]) > 0 and row["in_flight_s_mean"] != "", variant  # whom it drops; the age split
        config = yaml.safe_load((run / "config.yaml").read_text())
        if (config.get("window_controller") or {}).get("enabled"):  # the adaptive window keeps its log too
            assert (run / "window_decisions.jsonl").read_text().strip(), variant
