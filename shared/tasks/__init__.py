"""Task plugins with verifiable rewards, shared by rollout workers and evaluation.

``get_task(name)`` returns a :class:`Task` (``reverse``, ``add``, multi-turn ``guess``);
``load_dataset(path)`` reads and validates a JSONL dataset. See ``base`` for the invariants.
"""

from shared.errors import UnknownTask
from shared.tasks.base import ChatMessage, DemoTurn, Episode, EpisodeFinished, InvalidReference, Task
from shared.tasks.dataset import DatasetError, load_dataset, validate_row, write_dataset
from shared.tasks.registry import TASK_NAMES, get_task

__all__ = [
    "TASK_NAMES",
    "ChatMessage",
    "DatasetError",
    "DemoTurn",
    "Episode",
    "EpisodeFinished",
    "InvalidReference",
    "Task",
    "UnknownTask",
    "get_task",
    "load_dataset",
    "validate_row",
    "write_dataset",
]
