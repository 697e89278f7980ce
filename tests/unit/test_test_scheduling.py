"""How `make test` splits the suite over two test processes (tests/conftest.py): whole files, but one test at
a time from the files in SPREAD."""

from __future__ import annotations

from paths import REPO
from scheduling import FIRST, SPREAD, first_rank, schedule_scope


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
