"""How `make test` splits the suite over two test processes (tests/conftest.py): whole files, but one test at
a time from the files in SPREAD."""

from __future__ import annotations

from types import SimpleNamespace

from paths import REPO
from scheduling import FIRST, SPREAD, first_rank, make_scheduler, schedule_scope


def test_every_named_file_exists_so_a_rename_cannot_silently_drop_it() -> None:
    assert SPREAD and all((REPO / path).is_file() for path in SPREAD)
    assert FIRST and all((REPO / path).is_file() for path in FIRST) and len(set(FIRST)) == len(FIRST)


def test_first_files_sort_ahead_in_their_order_and_the_rest_keep_theirs() -> None:
    ids = ["tests/unit/test_a.py::t", FIRST[1] + "::t1", "tests/chaos/test_b.py::t", FIRST[0] + "::t", FIRST[1] + "::t2"]
    assert sorted(ids, key=first_rank) == [FIRST[0] + "::t", FIRST[1] + "::t1", FIRST[1] + "::t2",
                                           "tests/unit/test_a.py::t", "tests/chaos/test_b.py::t"]


def test_a_spread_file_is_split_by_test_and_any_other_file_stays_whole() -> None:
    spread = sorted(SPREAD)[0]
    assert schedule_scope(f"{spread}::test_a[x]") == f"{spread}::test_a[x]"
    assert schedule_scope("tests/compose/test_stack.py::test_up") == "tests/compose/test_stack.py"
    assert schedule_scope("tests/unit/test_loss.py::TestX::test_y") == "tests/unit/test_loss.py"


class _Node:
    """What xdist's scheduler asks of a worker: run these collection indices, or stop."""

    def __init__(self, name: str, handed: list[list[int]]) -> None:
        self.gateway, self.shutting_down = SimpleNamespace(id=name), False
        self.handed = handed  # every node's units, in the order the scheduler sent them

    def send_runtest_some(self, indices: list[int]) -> None:
        self.handed.append(list(indices))

    def shutdown(self) -> None:
        pass


class _Config:
    option = SimpleNamespace(loadscopereorder=True)  # xdist's default

    def getvalue(self, name: str) -> object:
        return ["popen", "popen"] if name == "tx" else None  # two test processes


def test_xdists_scheduler_hands_out_first_files_first_and_a_spread_file_test_by_test() -> None:
    """Through xdist's own scheduler. Its default order (the scopes holding most tests first) put SPREAD's
    one-test scopes last, and the workers' collection hook, where the order was set before, never runs under
    loadfile: the minute-long quick presets started at the end of the suite."""
    spread = next(f for f in FIRST if f in SPREAD)
    whole = next(f for f in FIRST if f not in SPREAD)
    collection = [f"tests/unit/test_many.py::t{i}" for i in range(5)] + ["tests/chaos/test_one.py::t"] + \
        [f"{whole}::t{i}" for i in range(3)] + [f"{spread}::a", f"{spread}::b"]
    handed: list[list[int]] = []
    sched = make_scheduler(_Config(), None)
    for node in (_Node("gw0", handed), _Node("gw1", handed)):
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    units = [[collection[i] for i in unit] for unit in handed]
    assert FIRST.index(spread) < FIRST.index(whole)
    assert units == [[f"{spread}::a"], [f"{spread}::b"], [f"{whole}::t{i}" for i in range(3)],
                     [f"tests/unit/test_many.py::t{i}" for i in range(5)]]  # two units each; the short one waits
