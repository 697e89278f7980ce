"""Version ordering lives in shared.versionbus alone: integer labels compare as numbers, foreign ones don't."""

from __future__ import annotations

from shared.versions import version_index, version_newer, version_number, versions_behind


def test_integer_labels_are_numbers_and_foreign_labels_are_not() -> None:
    assert version_number("12") == 12 and version_number(" 3 ") == 3
    assert version_number("step-b") is None and version_number("") is None


def test_newer_compares_numbers_numerically_and_foreign_labels_by_inequality() -> None:
    assert version_newer("10", "9") and not version_newer("9", "10") and not version_newer("9", "9")
    assert version_newer("a", "b") and not version_newer("a", "a") and version_newer("x", None)
    assert version_newer("a", "3") and version_newer("3", "a")  # no order between a number and a label


def test_index_of_the_newest_is_its_number_else_its_place_in_the_log() -> None:
    assert version_index(None, 5) is None and version_index("4", 0) == 4
    assert version_index("step-b", 4) == 3 and version_index("step-b", 0) is None
    assert version_index("-2", 3) is None


def test_gap_counts_versions_behind_and_skips_foreign_labels() -> None:
    assert versions_behind(5, "3") == 2 and versions_behind(5, "5") == 0 and versions_behind(5, "v3") is None
