"""How `make test` splits the suite over its test processes (pytest-xdist; the hook is in tests/conftest.py).

Whole files by default, so a file's module and session fixtures (the compose stack, the chaos engine) are built
once and its tests run in their order; the files in SPREAD are handed out one test at a time. The files in
FIRST are handed out before the rest, longest first, and the many short files fill the end: without it a
minute-long test handed out last leaves the other process idle for that minute.

The order is the scheduler's, in the main process: xdist's workers collect with ``--dist no`` (their
``pytest_collection_modifyitems`` never sees loadfile), and xdist's own order puts the scopes holding most
tests first, so one-test SPREAD scopes came last.
"""

from __future__ import annotations

from typing import Any

# Files whose tests each start a whole deployment of their own and share no fixture worth keeping (a tiny
# model built in seconds at most): each of their tests is scheduled alone.
SPREAD = frozenset({
    "tests/integration/test_experiment_staleness_specs.py",  # four quick presets, 1-2 min each
    "tests/integration/test_up_e2e.py",
    "tests/integration/test_trainer_crash.py",
    "tests/integration/test_trainer_distributed.py",
})


# The longest files (or, in SPREAD files, tests): about a minute or more each on two busy cores.
FIRST = (
    "tests/integration/test_experiment_staleness_specs.py",
    "tests/compose/test_stack.py",
    "tests/integration/test_experiment.py",
    "tests/integration/test_byo_example.py",
    "tests/chaos/test_chaos_soak.py",
    "tests/integration/test_gpu_smoke.py",
    "tests/integration/test_up_e2e.py",
    "tests/integration/test_trainer_crash.py",
    "tests/integration/test_trainer_distributed.py",
    "tests/integration/test_proxy_load.py",
)


def first_rank(nodeid: str) -> int:
    """Sort key for a test or a scope: a FIRST file's place in FIRST, every other file after them (a stable sort
    keeps the order within each file and among the rest)."""
    path = nodeid.split("::", 1)[0]
    return FIRST.index(path) if path in FIRST else len(FIRST)


def schedule_scope(nodeid: str) -> str:
    """The unit xdist hands to one test process: the test itself in a SPREAD file, else its file."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPREAD else path


def make_scheduler(config: Any, log: Any) -> Any:
    """xdist's loadfile scheduler with this module's scopes and order (``pytest_xdist_make_scheduler``)."""
    from xdist.scheduler import LoadFileScheduling

    class FileOrTest(LoadFileScheduling):  # type: ignore[misc]  # xdist ships no type hints
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return schedule_scope(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the first unit handed out: the queue is whole, put FIRST ahead (stable)
                for scope in sorted(self.workqueue, key=first_rank):
                    self.workqueue.move_to_end(scope)
                self.ordered = True
            super()._assign_work_unit(node)

    return FileOrTest(config, log)
