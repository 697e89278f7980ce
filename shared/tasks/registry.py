"""Task registry: the one place that maps a task name to its plugin."""

from __future__ import annotations

from shared.errors import UnknownTask
from shared.tasks.base import Task
from shared.tasks.guess import GuessTask
from shared.tasks.lookup import LookupTask
from shared.tasks.single_turn import AddTask, ReverseTask

_TASKS: dict[str, Task] = {t.name: t for t in (ReverseTask(), AddTask(), GuessTask(), LookupTask())}
TASK_NAMES: tuple[str, ...] = tuple(_TASKS)


def get_task(name: str) -> Task:
    """The task plugin called ``name``; raises :class:`UnknownTask` listing the valid names."""
    try:
        return _TASKS[name]
    except (KeyError, TypeError):
        raise UnknownTask(f"task: unknown task {name!r}; valid names: {', '.join(TASK_NAMES)}") from None
