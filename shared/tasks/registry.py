"""Task loading: the one place that turns a task name into a task object.

A name is resolved, in this order:

1. an import path ``package.module:Class`` (``model.task: mypkg.tasks:CodeTask``), imported from the
   installed packages, then the working directory (the project: ``examples.byo.shop.task:ShopTask``);
2. an entry point of the group ``dressage.tasks`` (``[project.entry-points."dressage.tasks"]`` in the
   package's pyproject.toml: ``code = "mypkg.tasks:CodeTask"``) -- how an installed package names its tasks;
3. a built-in name (``reverse``, ``add``, ``guess``, ``lookup``), which is itself an import path in
   ``BUILTIN_TASKS`` (this project declares the same paths as its own entry points).

The class is instantiated once per process with no arguments. A class with ``start`` implements the
episode protocol itself (``shared.tasks.base``, the built-ins); one with ``score`` is a plugin and is
adapted (``shared.tasks.plugin``). A name that resolves to nothing, a module that fails to import, or
a class that is neither raises :class:`TaskLoadError` (an ``UnknownTask``) naming the task and why.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
from importlib.metadata import entry_points
from typing import Any

from shared.errors import UnknownTask
from shared.tasks.base import Task
from shared.tasks.plugin import PluginTask, TaskFailed

ENTRY_POINT_GROUP = "dressage.tasks"
BUILTIN_TASKS: dict[str, str] = {
    "reverse": "shared.tasks.single_turn:ReverseTask",
    "add": "shared.tasks.single_turn:AddTask",
    "guess": "shared.tasks.guess:GuessTask",
    "lookup": "shared.tasks.lookup:LookupTask",
}
TASK_NAMES: tuple[str, ...] = tuple(BUILTIN_TASKS)
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
MAX_NAME = 256  # PromptGroup.task's bound

_loaded: dict[str, Task] = {}
_lock = threading.Lock()


class TaskLoadError(UnknownTask):
    """A task name that resolves to no usable task; the message names the task and the cause."""


def _entry_point(name: str) -> str | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return str(ep.value)
    return None


def _import(name: str, path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # as ``python -m`` does: the project's own packages, after installed ones
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of user code: named, never a crash of the service
        raise TaskLoadError(f"task {name!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskLoadError(f"task {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _build(name: str, path: str) -> Task:
    cls = _import(name, path)
    try:
        impl = cls() if isinstance(cls, type) else cls
    except Exception as exc:  # user constructor: named
        raise TaskLoadError(f"task {name!r}: {path} could not be constructed: {type(exc).__name__}: {exc}") from exc
    if callable(getattr(impl, "start", None)):
        if not getattr(impl, "name", None):
            impl.name = name
        task: Task = impl
        return task
    try:
        return PluginTask(name, impl)
    except TaskFailed as exc:
        raise TaskLoadError(f"task {name!r}: {exc.reason}") from None


def resolve(name: str) -> str:
    """The import path ``name`` stands for; ``UnknownTask`` listing what is valid when none."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise UnknownTask(f"task: unknown task {name!r}; valid names: {', '.join(TASK_NAMES)}, an import path "
                          f"'package.module:Class' or an entry point of group {ENTRY_POINT_GROUP!r}")
    if ":" in name:
        if not IMPORT_PATH.fullmatch(name):
            raise TaskLoadError(f"task {name!r}: an import path reads 'package.module:Class'")
        return name
    path = _entry_point(name) or BUILTIN_TASKS.get(name)
    if path is None:
        raise UnknownTask(f"task: unknown task {name!r}; valid names: {', '.join(TASK_NAMES)}, an import path "
                          f"'package.module:Class' or an entry point of group {ENTRY_POINT_GROUP!r}")
    return path


def get_task(name: str) -> Task:
    """The task called ``name`` (loaded once per process); raises :class:`UnknownTask` / :class:`TaskLoadError`."""
    task = _loaded.get(name) if isinstance(name, str) else None
    if task is not None:
        return task
    path = resolve(name)
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name, path)
        return _loaded[name]
