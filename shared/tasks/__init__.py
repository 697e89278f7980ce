"""Tasks: how a dataset row becomes a trajectory and its reward, shared by rollout workers and evaluation.

``get_task(name)`` loads a task by built-in name (``reverse``, ``add``, multi-turn ``guess``, tool-using
``lookup``), entry point (group ``dressage.tasks``) or import path (``pkg.mod:Class``); a user's task
implements the small interface of ``plugin`` (``score(trajectory, row)`` and optional hooks).
``scan_dataset(path)`` reads JSONL / Parquet / Hugging Face datasets, skipping and counting bad rows.
See ``base`` for the episode protocol, ``reasoning`` for the split of a thinking model's reply.
"""

from shared.errors import UnknownTask
from shared.tasks.base import (
    AgentReward,
    ChatMessage,
    DemoTurn,
    Episode,
    EpisodeFinished,
    InvalidReference,
    Task,
    start_episode,
)
from shared.tasks.dataset import (
    DatasetError,
    ScannedDataset,
    load_dataset,
    scan_dataset,
    validate_row,
    write_dataset,
)
from shared.tasks.plugin import PluginTask, Score, TaskFailed, Trajectory
from shared.tasks.reasoning import answer_text, split_reasoning
from shared.tasks.registry import ENTRY_POINT_GROUP, TASK_NAMES, TaskLoadError, get_task

__all__ = [
    "ENTRY_POINT_GROUP",
    "TASK_NAMES",
    "AgentReward",
    "ChatMessage",
    "DatasetError",
    "DemoTurn",
    "Episode",
    "EpisodeFinished",
    "InvalidReference",
    "PluginTask",
    "ScannedDataset",
    "Score",
    "Task",
    "TaskFailed",
    "TaskLoadError",
    "Trajectory",
    "UnknownTask",
    "answer_text",
    "get_task",
    "load_dataset",
    "scan_dataset",
    "split_reasoning",
    "start_episode",
    "validate_row",
    "write_dataset",
]
