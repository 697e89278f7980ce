"""Tasks as plugins: loading by import path and entry point, the small interface, datasets in every
format with malformed rows skipped, the reasoning split, and model ids from a Hugging Face cache."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from shared.config import load_config
from shared.hub import resolve_model_path
from shared.tasks import (
    AgentReward,
    DatasetError,
    PluginTask,
    TaskFailed,
    TaskLoadError,
    UnknownTask,
    get_task,
    load_dataset,
    scan_dataset,
    split_reasoning,
    start_episode,
)
from shared.tasks.base import first_line
from shared.tasks.registry import TASK_NAMES


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def play(task: str, row: dict[str, Any], *replies: str) -> Any:
    ep = start_episode(get_task(task), row)
    for r in replies:
        ep.step(r)
    return ep


def test_a_task_loads_by_import_path_and_the_builtins_by_the_same_mechanism() -> None:
    task = get_task("byo_tasks:EchoTask")
    assert isinstance(task, PluginTask) and task.max_new_tokens == 8 and task is get_task("byo_tasks:EchoTask")
    assert type(get_task("shared.tasks.single_turn:ReverseTask")) is type(get_task("reverse"))
    assert set(TASK_NAMES) == {"reverse", "add", "guess", "lookup"}


def test_a_task_loads_by_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "my_tasks-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-tasks\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[dressage.tasks]\nechoes = byo_tasks:EchoTask\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = get_task("echoes")
    assert isinstance(task, PluginTask) and task.name == "echoes"
    assert play("echoes", {"prompt_id": "a", "word": "hi"}, "hi").reward() == 1.0


@pytest.mark.parametrize(("name", "why"), [
    ("broken_task_module:Task", "cannot import module 'broken_task_module': ImportError: this plugin needs"),
    ("byo_tasks:Missing", "has no attribute 'Missing'"),
    ("byo_tasks:NoScore", "must define score(trajectory, row)"),
    ("not a path:X", "import path reads"),
])
def test_a_broken_task_is_refused_naming_the_task_and_why(name: str, why: str) -> None:
    with pytest.raises(TaskLoadError) as info:
        get_task(name)
    assert why in str(info.value) and name in str(info.value) and isinstance(info.value, UnknownTask)


def test_the_interface_builds_messages_from_the_row_and_scores_named_components() -> None:
    ep = play("byo_tasks:EchoTask", {"prompt_id": "r1", "word": "cat"}, "<think>say it</think>cat")
    assert ep.messages()[0] == {"role": "user", "content": "say cat"}
    assert ep.done and ep.reward() == 1.0 and ep.components() == {"exact": 1.0, "short": 1.0} and ep.correct()
    wrong = play("byo_tasks:EchoTask", {"prompt_id": "r1", "word": "cat"}, "a long wrong answer")
    assert wrong.reward() == 0.0 and not wrong.correct()


def test_a_multi_turn_plugin_answers_through_env_step_until_done() -> None:
    ep = play("byo_tasks:CountdownTask", {"prompt": "count down from 2"}, "2", "1", "0")
    assert ep.done and ep.turns == 3 and ep.reward() == 1.0
    assert [m["role"] for m in ep.messages()] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    capped = play("byo_tasks:CountdownTask", {"prompt": "count"}, "5", "5", "5", "5")
    assert capped.done and capped.turns == 4 and capped.reward() == 0.0


@pytest.mark.parametrize(("task", "reason"), [("byo_tasks:RaisingTask", "KeyError: 'no such column'"),
                                              ("byo_tasks:NanTask", "reward must be finite, got nan")])
def test_a_raising_or_nan_score_is_a_named_task_failure_naming_the_row(task: str, reason: str) -> None:
    ep = play(task, {"prompt_id": "row-7", "prompt": "hi"}, "x")
    with pytest.raises(TaskFailed) as info:
        ep.reward()
    msg = str(info.value)
    assert task in msg and "score" in msg and "'row-7'" in msg and reason in msg


@pytest.mark.parametrize(("task", "taken", "reward"), [("byo_tasks:AgentCombined", True, 0.75),
                                                       ("byo_tasks:AgentAccepted", True, 0.5),
                                                       ("byo_tasks:AgentRefused", False, 0.5)])
def test_the_task_decides_what_an_agent_reported_reward_counts_for(task: str, taken: bool, reward: float) -> None:
    ep = play(task, {"prompt": "q", "reference": "42"}, "42")
    assert ep.offer_agent_reward(AgentReward(0.5, {"tests": 0.5})) is taken
    assert math.isclose(ep.reward(), reward)
    assert not play("reverse", {"prompt": "reverse 12", "reference": "21"}, "21").offer_agent_reward(AgentReward(0.0))


def test_a_black_box_agents_turns_are_scored_without_env_step() -> None:
    ep = start_episode(get_task("byo_tasks:CountdownTask"), {"prompt": "count"})
    ep.take_agent_turns(["2", "1", "0"])
    assert ep.done and ep.turns == 3 and ep.reward() == 1.0


@pytest.mark.parametrize(("text", "parser", "split"), [
    ("42", "qwen3", (None, "42")),
    ("<think>a\nb</think>\n\n42", "qwen3", ("a\nb", "42")),
    ("thinking...</think>42", "qwen3", ("thinking...", "42")),  # the template opened the block
    ("<think>ran out of tokens", "qwen3", ("ran out of tokens", "")),
    ("reasoning</think> 7", "deepseek-r1", ("reasoning", "7")),
    ("no end yet", "deepseek-r1", ("no end yet", "")),
])
def test_the_reasoning_split(text: str, parser: Any, split: tuple[str | None, str]) -> None:
    assert split_reasoning(text, parser) == split


def test_builtin_verifiers_score_a_thinking_models_answer_after_its_reasoning() -> None:
    assert first_line("<think>1284? let me check\n4821</think>\n1284") == "1284"
    assert play("reverse", {"prompt": "reverse 4821", "reference": "1284"}, "<think>4821</think>1284").reward() == 1.0


def test_datasets_skip_count_and_name_every_malformed_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "words.jsonl", [
        {"word": "cat"}, "{broken", {"word": 3}, [1], {"prompt_id": "words-1", "word": "dup"}, "", {"word": "dog"}])
    scanned = scan_dataset(path, task="byo_tasks:EchoTask")
    assert [r["word"] for r in scanned.rows] == ["cat", "dog"] and scanned.skipped == 4
    assert [(e.line, e.field) for e in scanned.errors] == [(2, "line"), (3, "row"), (4, "row"), (5, "prompt_id")]
    assert "word must be a string" in str(scanned.errors[1]) and str(scanned.errors[0]).startswith(f"{path}:2:")
    assert scanned.rows[0]["prompt_id"] == "words-1" and scanned.rows[0]["task"] == "byo_tasks:EchoTask"
    with pytest.raises(DatasetError, match=":2: line: invalid JSON"):
        load_dataset(path, task="byo_tasks:EchoTask")
    with pytest.raises(DatasetError, match="task: missing"):
        load_dataset(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "x"}]))


def test_parquet_datasets_read_like_jsonl(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist([{"word": "cat"}, {"word": None}, {"word": "dog"}]), tmp_path / "w.parquet")
    scanned = scan_dataset(tmp_path / "w.parquet", task="byo_tasks:EchoTask")
    assert [r["word"] for r in scanned.rows] == ["cat", "dog"] and [e.line for e in scanned.errors] == [2]


def test_hf_datasets_folders_read_like_jsonl(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"word": "cat"}, {"word": "dog"}]).save_to_disk(str(tmp_path / "hf"))
    assert [r["word"] for r in scan_dataset(tmp_path / "hf", task="byo_tasks:EchoTask").rows] == ["cat", "dog"]


def hf_cache(home: Path, repo: str, files: dict[str, str]) -> Path:
    """A model in huggingface_hub's cache layout: models--org--name/snapshots/<rev>/ + refs/main."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123abc")
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


def test_a_model_id_resolves_to_its_snapshot_in_the_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = hf_cache(tmp_path, "someone/tiny", {"config.json": "{}"})
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("someone/tiny") == str(snap)
    assert resolve_model_path("someone/absent") == "someone/absent"  # left for the loader to name
    local = tmp_path / "folder"
    local.mkdir()
    assert resolve_model_path(str(local)) == str(local)
    assert load_config(env={"DRESSAGE_MODEL_PATH": "someone/tiny"}).model.path == str(snap)
