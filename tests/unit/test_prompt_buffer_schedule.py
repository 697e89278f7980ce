"""Dataset schedule (pure): per-epoch seeded shuffles, cursors across epochs, stable group ids."""

from __future__ import annotations

import pytest

from services.prompt_buffer.schedule import Cursor, Schedule, epoch_order, group_id, prompt_group


def test_each_epoch_is_a_seeded_permutation_that_differs_between_epochs() -> None:
    a0, a1 = epoch_order(50, seed=7, epoch=0), epoch_order(50, seed=7, epoch=1)
    assert sorted(a0) == list(range(50)) and sorted(a1) == list(range(50))
    assert a0 != a1
    assert epoch_order(50, 7, 0) == a0  # deterministic
    assert epoch_order(50, 8, 0) != a0


def test_taking_in_chunks_from_stored_cursors_equals_one_pass() -> None:
    s = Schedule(7, seed=1, epochs=3)
    whole, end = s.take(Cursor(), 100)
    assert len(whole) == 21 and s.exhausted(end)
    got, cursor = [], Cursor()
    for k in (1, 5, 2, 6, 3, 4, 10):  # a "restart" between every chunk
        items, cursor = Schedule(7, seed=1, epochs=3).take(cursor, k)
        got += items
    assert got == whole
    assert len({group_id(e, i, "p") for e, i in got}) == 21  # unique per (epoch, index)


def test_forever_never_exhausts_and_cursor_rolls_over() -> None:
    s = Schedule(3, seed=0, epochs=None)
    items, cursor = s.take(Cursor(5, 2), 2)
    assert [e for e, _ in items] == [5, 6] and cursor == Cursor(6, 1)
    assert not s.exhausted(Cursor(10**6, 0))


def test_empty_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_buffer.dataset"):
        Schedule(0, 0, None)


def test_prompt_group_carries_ids_and_attempt_zero() -> None:
    row = {"prompt_id": "r-1", "task": "reverse", "prompt": "reverse 12", "reference": "21", "meta": {"k": 1}}
    g = prompt_group(row, epoch=2, index=5, n_samples=4, now=9.5)
    assert (g.group_id, g.attempt, g.n_samples, g.enqueued_at) == ("e2-i5-r-1", 0, 4, 9.5)
    assert g.meta == {"k": 1, "epoch": 2, "dataset_index": 5}
