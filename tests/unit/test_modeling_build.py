"""Warm start, model-directory building, `ensure_model` and the init-model CLI (no Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.modeling import (
    ModelSpec,
    WarmStartOptions,
    build_model,
    build_model_dir,
    build_tokenizer,
    ensure_model,
    evaluate,
    load_model,
    load_tokenizer,
    missing_files,
    read_build_info,
)
from shared.modeling.build import ModelDirExists
from shared.modeling.warmstart import demonstration_examples, guessed, warm_start_model
from shared.tasks import get_task
from shared.tasks.lookup import LookupTask
from tools.dev.init_model import main

torch.set_num_threads(1)

SMALL = ModelSpec(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
TINY = ModelSpec(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
)
TINY_ARGS = ["--hidden", "32", "--intermediate", "64", "--layers", "1", "--threads", "1"]


def test_demonstration_loss_mask_covers_exactly_the_reply_and_eos() -> None:
    tok, task = build_tokenizer(), get_task("reverse")
    (ex,) = demonstration_examples(task, [{"prompt": "reverse 1234", "reference": "4321"}], tok)
    loss_ids = [t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
    assert tok.decode(loss_ids) == "4321<|im_end|>"
    assert ex.loss_mask == sorted(ex.loss_mask)  # prompt first, reply last


def test_multi_turn_demonstration_becomes_one_sequence_with_loss_on_every_reply() -> None:
    tok, task = build_tokenizer(), get_task("guess")
    row = task.generate(1, seed=4)[0]
    turns = task.demonstration(row["prompt"], row["reference"])
    (ex,) = demonstration_examples(task, [row], tok)
    loss_text = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m])
    assert loss_text == "".join(f"{reply}<|im_end|>" for _, reply in turns)
    assert str(tok.decode(ex.input_ids)).startswith("<|im_start|>user\n" + row["prompt"])


def test_guess_share_demonstrates_that_share_of_rows_by_the_tasks_wrong_guess() -> None:
    tok, task = build_tokenizer(), get_task("lookup")
    rows = task.generate(400, seed=5)
    eos = "<|im_end|>"

    def replies(share: float) -> list[str]:
        return [str(tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]))
                for ex in demonstration_examples(task, rows, tok, guess_share=share)]

    assert all("<tool_call>" in r for r in replies(0.0))
    half = replies(0.5)
    guesses = [(row, r) for row, r in zip(rows, half, strict=True) if "<tool_call>" not in r]
    assert 0.4 < len(guesses) / len(rows) < 0.6  # a hash of the prompt, not every other row
    assert all(r != row["reference"] + eos and r.endswith(eos) and len(r) == 4 + len(eos) for row, r in guesses)
    assert {row["prompt"] for row, _ in guesses} == {row["prompt"] for row in rows if guessed(row["prompt"], 0.5)}
    assert not any("<tool_call>" in r for r in replies(1.0))


def test_a_guessed_answer_earns_only_chance_credit_and_never_solves() -> None:
    task = LookupTask()
    for row in task.generate(300, seed=6):
        ep = task.start(row["prompt"], row["reference"])
        for _, reply in task.guess(row["prompt"], row["reference"]):
            ep.step(reply)
        assert ep.done and not ep.used_tool and not ep.correct() and ep.reward() < 0.7 * 0.9


def test_guess_share_is_refused_outside_its_range_and_for_tasks_without_a_guess() -> None:
    tok = build_tokenizer()
    rows = get_task("reverse").generate(2, seed=1)
    with pytest.raises(ValueError, match="guess_share"):
        demonstration_examples(get_task("lookup"), get_task("lookup").generate(2, seed=1), tok, guess_share=1.5)
    with pytest.raises(ValueError, match="has no guess"):
        demonstration_examples(get_task("reverse"), rows, tok, guess_share=0.5)


def test_warm_start_improves_reward_over_random_init() -> None:
    tok, task = build_tokenizer(), get_task("reverse")
    model = build_model(SMALL, len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    rows = task.generate(40 * 32 + 64, seed=123)
    train, held = rows[:-64], rows[-64:]
    before = evaluate(model, tok, task, held, greedy=False, seed=1)
    report = warm_start_model(model, tok, task, train, steps=40, seed=0)
    after = evaluate(model, tok, task, held, greedy=False, seed=1)
    assert report.steps == 40 and not report.stopped_early
    assert after.reward_mean > before.reward_mean + 0.02


def test_warm_start_stops_once_target_accuracy_is_reached() -> None:
    tok, task = build_tokenizer(), get_task("reverse")
    model = build_model(TINY, len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    rows = task.generate(64, seed=5)
    # A target of 0.0 is met at the first check: the loop must stop there, not run all steps.
    report = warm_start_model(
        model, tok, task, rows[:48], steps=50, heldout_rows=rows[48:], target_accuracy=0.0, eval_every=3
    )
    assert report.steps == 3 and report.stopped_early and report.history == [(3, report.history[0][1])]
    with pytest.raises(ValueError, match="heldout_rows"):
        warm_start_model(model, tok, task, rows, steps=1, target_accuracy=0.5)


def test_build_model_dir_is_complete_loadable_and_records_how_it_was_made(tmp_path: Path) -> None:
    out = tmp_path / "m"
    report = build_model_dir(out, "reverse", spec=TINY, seed=2, warm=WarmStartOptions(steps=2, eval_every=1))
    assert missing_files(out) == []
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directory left behind
    info = read_build_info(out)
    assert info is not None and info["task"] == "reverse" and info["warm_steps"] == 2
    assert set(report.after) == {"greedy", "sampled"}
    model = load_model(out)
    assert model.config.hidden_size == 32 and len(load_tokenizer(out)) == model.config.vocab_size


def test_ensure_model_builds_once_then_leaves_the_directory_alone(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert ensure_model(out, "reverse", spec=TINY) is not None
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_model(out, "reverse", spec=TINY) is None
    assert weights.stat().st_mtime_ns == stamp


def test_ensure_model_refuses_to_overwrite_a_foreign_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ModelDirExists, match="not a complete model"):
        ensure_model(tmp_path, "reverse", spec=TINY)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_ensure_model_fills_an_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert ensure_model(out, "add", spec=TINY) is not None
    assert missing_files(out) == []


def test_cli_builds_prints_one_summary_line_and_honours_if_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "m")
    assert main(["--task", "reverse", "--out", out, "--warm-steps", "0", *TINY_ARGS]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "params=" in lines[0]
    assert main(["--task", "reverse", "--out", out, "--if-missing", *TINY_ARGS]) == 0
    assert "already complete" in capsys.readouterr().out
    assert main(["--task", "reverse", "--out", out, "--warm-steps", "0", *TINY_ARGS]) == 1  # occupied
    assert (
        main(["--task", "reverse", "--out", out, "--warm-steps", "0", "--force", "--seed", "9", *TINY_ARGS])
        == 0
    )
    info = read_build_info(out)
    assert info is not None and info["seed"] == 9


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--task", "nope"], "unknown task"), (["--task", "reverse", "--heads", "5"], "hidden_size"),
     (["--task", "lookup", "--guess-share", "2"], "--guess-share")],
)
def test_cli_rejects_bad_input_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    assert main([*args, "--out", str(tmp_path / "m"), "--warm-steps", "0", "--threads", "1"]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
