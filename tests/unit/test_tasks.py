"""Task plugins: verifiers, multi-turn flow, determinism, demonstrations, validation at the edge."""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from shared.errors import DressageError, UnknownTask
from shared.tasks import (
    TASK_NAMES,
    DatasetError,
    EpisodeFinished,
    InvalidReference,
    get_task,
    load_dataset,
    write_dataset,
)
from shared.tasks.guess import parse_guess
from tools.dev.make_data import main as make_data_main
from tools.dev.make_data import split_rows

VOCAB = set(string.printable[:95]) | {"\n"}  # printable ASCII 32..126 and newline
GUESS_REF = {"low": 20, "high": 34, "secret": 30}


def _score(task: str, prompt: str, reference: object, reply: str) -> float:
    ep = get_task(task).start(prompt, reference)
    ep.step(reply)
    return ep.reward()


def test_registry_knows_the_four_tasks() -> None:
    assert set(TASK_NAMES) == {"reverse", "add", "guess", "lookup"}
    assert get_task("guess").multi_turn and not get_task("reverse").multi_turn


def test_unknown_task_names_the_valid_ones() -> None:
    with pytest.raises(UnknownTask, match="reverse, add, guess"):
        get_task("sort")
    assert issubclass(UnknownTask, DressageError)


def test_reverse_exact_answer_scores_one() -> None:
    ep = get_task("reverse").start("reverse 4821", "1284")
    ep.step("1284")
    assert ep.done and ep.turns == 1 and ep.reward() == 1.0 and ep.correct()


def test_reverse_partial_credit_per_position_never_one() -> None:
    assert _score("reverse", "reverse 4821", "1284", "1294") == pytest.approx(0.9 * 3 / 4)
    assert _score("reverse", "reverse 4821", "1284", "12845") == pytest.approx(0.9 * 4 / 5)
    assert _score("reverse", "reverse 4821", "1284", "4821") == 0.0


def test_reverse_reply_is_first_line_stripped() -> None:
    assert _score("reverse", "reverse 4821", "1284", "  1284 \nnoise") == 1.0
    assert _score("reverse", "reverse 4821", "1284", "\n\n1284") == 1.0


@pytest.mark.parametrize("reply", ["", "   ", "\n", "abc", "~" * 500, "é€"])
def test_garbage_reply_scores_zero_without_raising(reply: str) -> None:
    ep = get_task("reverse").start("reverse 4821", "1284")
    ep.step(reply)
    assert ep.done and ep.reward() == 0.0 and not ep.correct()


def test_add_partial_credit_is_right_aligned() -> None:
    assert _score("add", "12+7=", "19", "19") == 1.0
    assert _score("add", "95+98=", "193", "93") == pytest.approx(0.9 * 2 / 3)  # ones and tens right
    assert _score("add", "95+98=", "193", "183") == pytest.approx(0.9 * 2 / 3)
    assert _score("add", "12+7=", "19", "x") == 0.0


def test_single_turn_step_after_done_raises_named_error() -> None:
    ep = get_task("add").start("1+1=", "2")
    ep.step("2")
    with pytest.raises(EpisodeFinished):
        ep.step("2")


def test_guess_feedback_flow_and_reward_within_par() -> None:
    ep = get_task("guess").start("guess 20-34", GUESS_REF)
    assert ep.messages() == [{"role": "user", "content": "guess 20-34"}]
    ep.step("27")
    assert not ep.done and ep.messages()[-1] == {"role": "user", "content": "higher"}
    ep.step("31")
    assert ep.messages()[-1] == {"role": "user", "content": "lower"}
    ep.step("30")
    assert ep.done and ep.turns == 3 and ep.correct() and ep.reward() == 1.0
    assert [m["role"] for m in ep.messages()] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]


def test_guess_garbage_is_a_wasted_turn_and_reward_decreases_after_par() -> None:
    ep = get_task("guess").start("guess 20-34", GUESS_REF)
    for reply in ["", "no idea", "9" * 5000, "-", "banana"]:  # par = 15.bit_length() = 4
        ep.step(reply)
        assert ep.messages()[-1] == {"role": "user", "content": "invalid"}
    ep.step("30")
    assert ep.done and ep.turns == 6 and ep.correct() is False
    assert 0.0 < ep.reward() < 1.0


def test_guess_rewards_decrease_with_turns_past_par() -> None:
    rewards = []
    for wasted in range(0, 6):
        ep = get_task("guess").start("guess 20-34", GUESS_REF)
        for _ in range(wasted):
            ep.step("20")
        ep.step("30")
        rewards.append(ep.reward())
    assert rewards[:4] == [1.0, 1.0, 1.0, 1.0]
    assert rewards[3] > rewards[4] > rewards[5] > 0.0


def test_guess_never_found_scores_zero_and_ends_at_max_turns() -> None:
    task = get_task("guess")
    ep = task.start("guess 20-34", GUESS_REF)
    for _ in range(task.max_turns):
        ep.step("21")
    assert ep.done and ep.turns == task.max_turns and ep.reward() == 0.0 and not ep.correct()
    assert ep.messages()[-1]["role"] == "assistant"  # no feedback after the last turn


def test_parse_guess_reads_first_integer_robustly() -> None:
    assert parse_guess(" 12 ") == 12
    assert parse_guess("I say 7, maybe 8") == 7
    assert parse_guess("\n5\n9") == 5
    assert parse_guess("x") is None
    assert parse_guess("1" * 10000) is None


@pytest.mark.parametrize("name", TASK_NAMES)
def test_generate_is_deterministic_and_seed_dependent(name: str) -> None:
    task = get_task(name)
    a, b, c = task.generate(50, seed=7), task.generate(50, seed=7), task.generate(50, seed=8)
    assert a == b and a != c
    assert json.loads(json.dumps(a)) == a
    keys = {(r["prompt"], json.dumps(r["reference"], sort_keys=True)) for r in a}
    assert len(keys) == 50 and len({r["prompt_id"] for r in a}) == 50


@pytest.mark.parametrize("name", TASK_NAMES)
def test_generated_text_fits_the_char_vocabulary_and_length_limits(name: str) -> None:
    task = get_task(name)
    for row in task.generate(300, seed=1):
        assert set(row["prompt"]) <= VOCAB and len(row["prompt"]) < 40
        for messages, reply in task.demonstration(row["prompt"], row["reference"]):
            assert set(reply) <= VOCAB and (len(reply) < 12 or reply.startswith("<tool_call>"))
            assert all(set(m["content"]) <= VOCAB for m in messages)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_replaying_the_demonstration_is_correct(name: str) -> None:
    task = get_task(name)
    for row in task.generate(200, seed=3):
        ep = task.start(row["prompt"], row["reference"])
        for messages, reply in task.demonstration(row["prompt"], row["reference"]):
            assert not ep.done and ep.messages() == messages
            ep.step(reply)
        assert ep.done and ep.reward() == 1.0 and ep.correct()
        assert ep.turns <= task.max_turns


def test_guess_demonstration_is_multi_turn_with_feedback() -> None:
    demo = get_task("guess").demonstration("guess 20-34", GUESS_REF)
    assert [reply for _, reply in demo] == ["27", "31", "29", "30"]
    assert demo[-1][0][-1] == {"role": "user", "content": "higher"}


def test_start_accepts_chat_messages_as_prompt() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse 12"}]
    ep = get_task("reverse").start(msgs, "21")
    assert ep.messages() == msgs
    ep.step("21")
    assert ep.correct()


@pytest.mark.parametrize(
    ("name", "prompt", "reference", "field"),
    [
        ("reverse", "reverse 123", 321, "reference"),
        ("reverse", "reverse 123", "12a", "reference"),
        ("reverse", "reverse 123", "322", "reference"),  # not the answer to the prompt
        ("add", "1+2=", "4", "reference"),
        ("add", "", "3", "prompt"),
        ("add", [{"role": "user"}], "3", "prompt[0]"),
        ("guess", "guess 20-34", 30, "reference"),
        ("guess", "guess 20-34", {"low": 20, "high": 34}, "reference.secret"),
        ("guess", "guess 20-34", {"low": 20, "high": 34, "secret": 40}, "reference.secret"),
        ("guess", "guess 20-34", {"low": 20, "high": 34, "secret": True}, "reference.secret"),
        ("guess", "guess 20-90", {"low": 20, "high": 90, "secret": 40}, "reference.high"),
        ("guess", "guess 20-33", GUESS_REF, "reference"),  # range disagrees with the prompt
    ],
)
def test_bad_reference_raises_named_error_naming_the_field(
    name: str, prompt: str | Sequence[Any], reference: object, field: str
) -> None:
    with pytest.raises(InvalidReference) as info:
        get_task(name).start(prompt, reference)
    assert info.value.field == field and field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_split_rows_are_disjoint_with_stable_ids() -> None:
    for name in TASK_NAMES:
        train, test = split_rows(name, 100, 20, seed=5)
        key = lambda r: (r["prompt"], json.dumps(r["reference"], sort_keys=True))  # noqa: E731
        assert not {key(r) for r in train} & {key(r) for r in test}
        assert (
            train[0]["prompt_id"] == f"{name}-train-00000" and test[-1]["prompt_id"] == f"{name}-test-00019"
        )


def test_make_data_writes_loadable_files(tmp_path: Path) -> None:
    assert (
        make_data_main(["--out", str(tmp_path), "--train", "30", "--test", "5", "--tasks", "add", "guess"])
        == 0
    )
    assert len(load_dataset(tmp_path / "add" / "train.jsonl")) == 30
    assert len(load_dataset(tmp_path / "guess" / "test.jsonl")) == 5
    assert not (tmp_path / "reverse").exists()


def test_shipped_datasets_load_and_are_disjoint() -> None:
    root = Path(__file__).resolve().parents[2] / "data"
    for name in TASK_NAMES:
        train, test = load_dataset(root / name / "train.jsonl"), load_dataset(root / name / "test.jsonl")
        assert len(train) == 2000 and len(test) == 200
        assert {r["task"] for r in train + test} == {name}
        assert not {r["prompt"] + json.dumps(r["reference"]) for r in train} & {
            r["prompt"] + json.dumps(r["reference"]) for r in test
        }


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = '{"prompt_id": "a", "task": "add", "prompt": "1+2=", "reference": "3"}'


@pytest.mark.parametrize(
    ("bad", "field", "reason"),
    [
        ("{not json", "line", "invalid JSON"),
        ("[1, 2]", "row", "JSON object"),
        ('{"prompt_id": "b", "task": "add", "reference": "3"}', "prompt", "missing"),
        ('{"prompt_id": "b", "task": "sort", "prompt": "1+2=", "reference": "3"}', "task", "unknown task"),
        (
            '{"prompt_id": "b", "task": "add", "prompt": "1+2=", "reference": "4"}',
            "reference",
            "not the answer",
        ),
        (
            '{"prompt_id": "b", "task": "add", "prompt": "1+2=", "reference": "3", "x": 1}',
            "x",
            "unknown field",
        ),
        (
            '{"prompt_id": "b", "task": "add", "prompt": "1+2=", "reference": "3", "meta": 1}',
            "meta",
            "object",
        ),
        ('{"prompt_id": "", "task": "add", "prompt": "1+2=", "reference": "3"}', "prompt_id", "non-empty"),
        (GOOD, "prompt_id", "duplicate of line 1"),
    ],
)
def test_load_dataset_errors_name_line_and_field(tmp_path: Path, bad: str, field: str, reason: str) -> None:
    path = _write(tmp_path, [GOOD, "", bad])
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    err = info.value
    assert (err.line, err.field) == (3, field) and reason in err.reason
    assert f"d.jsonl:3: {field}:" in str(err)


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    rows = get_task("guess").generate(10, seed=0)
    assert write_dataset(tmp_path / "x" / "g.jsonl", rows) == 10
    assert load_dataset(tmp_path / "x" / "g.jsonl") == rows


def test_lookup_episode_runs_the_tool_loop_and_counts_malformed_calls() -> None:
    task = get_task("lookup")
    row = task.generate(1, seed=5)[0]
    key = row["prompt"][len("code of "):-1]
    ep = task.start(row["prompt"], row["reference"])
    ep.step(f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>')
    assert ep.messages()[-1] == {"role": "tool", "content": row["reference"]} and not ep.done
    ep.step(row["reference"])
    assert ep.done and ep.correct() and ep.reward() == 1.0 and (ep.tool_calls, ep.malformed) == (1, 0)
    bad = task.start(row["prompt"], row["reference"])
    bad.step("<tool_call>\n{oops}\n</tool_call>")  # not a call: the raw text is the answer, as the proxy returns it
    assert bad.done and bad.reward() == 0.0 and (bad.tool_calls, bad.malformed) == (0, 1)
    guess = task.start(row["prompt"], row["reference"])
    guess.step("1234" if row["reference"] != "1234" else "4321")  # answering without the tool
    assert guess.done and not guess.correct() and guess.tool_calls == 0
