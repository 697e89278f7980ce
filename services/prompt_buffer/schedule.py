"""Where the prompt-buffer is in its dataset: epochs, per-epoch shuffles, and the group ids they give.

Contract: the sequence of ``(epoch, dataset index)`` pairs is a pure function of the dataset size,
``shuffle_seed`` and ``epochs``; a ``Cursor(epoch, position)`` names a point in it. Emitting the
items before the cursor and storing the cursor in the same transaction (see ``buffer.py``) means a
restart resumes exactly there: no prompt skipped, none emitted twice. Group ids are stable and
unique per ``(epoch, dataset index)``, so every attempt of one prompt group shares one id.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from shared.schemas import PromptGroup
from shared.tasks import PluginTask, get_task


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0  # 0-based epoch
    position: int = 0  # how many items of this epoch's order were already emitted


def epoch_order(n_rows: int, seed: int, epoch: int) -> list[int]:
    """Dataset indices in the order epoch ``epoch`` emits them (a seeded shuffle per epoch)."""
    order = list(range(n_rows))
    random.Random(f"dressage-prompt-buffer:{seed}:{epoch}").shuffle(order)
    return order


def group_id(epoch: int, index: int, prompt_id: str) -> str:
    """Stable id of the prompt group of dataset row ``index`` in ``epoch`` (all attempts share it)."""
    return f"e{epoch}-i{index}-{prompt_id}"[:256]


class Schedule:
    """Walks ``epochs`` shuffled passes over ``n_rows`` rows (``epochs=None`` walks forever)."""

    def __init__(self, n_rows: int, seed: int, epochs: int | None) -> None:
        if n_rows < 1:
            raise ValueError("prompt_buffer.dataset: the dataset has no rows")
        self.n_rows, self.seed, self.epochs = n_rows, seed, epochs
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            self._orders[epoch] = epoch_order(self.n_rows, self.seed, epoch)
        return self._orders[epoch]

    def normalize(self, cursor: Cursor) -> Cursor:
        """Roll a cursor at the end of an epoch over to the start of the next."""
        if cursor.position >= self.n_rows:
            return Cursor(cursor.epoch + 1, 0)
        return cursor

    def exhausted(self, cursor: Cursor) -> bool:
        cursor = self.normalize(cursor)
        return self.epochs is not None and cursor.epoch >= self.epochs

    def take(self, cursor: Cursor, k: int) -> tuple[list[tuple[int, int]], Cursor]:
        """Up to ``k`` next ``(epoch, index)`` items after ``cursor`` and the cursor after them."""
        items: list[tuple[int, int]] = []
        cursor = self.normalize(cursor)
        while len(items) < k and not self.exhausted(cursor):
            order = self._order(cursor.epoch)
            end = min(self.n_rows, cursor.position + (k - len(items)))
            items.extend((cursor.epoch, order[i]) for i in range(cursor.position, end))
            cursor = self.normalize(Cursor(cursor.epoch, end))
        return items, cursor


def prompt_group(row: dict[str, Any], epoch: int, index: int, n_samples: int, now: float) -> PromptGroup:
    """Attempt 0 of the prompt group of dataset ``row`` (validated by ``shared.tasks.load_dataset``)."""
    meta = {**(row.get("meta") or {}), "epoch": epoch, "dataset_index": index}
    return PromptGroup(group_id=group_id(epoch, index, row["prompt_id"]), prompt_id=row["prompt_id"],
                       task=row["task"], prompt=row["prompt"], reference=row.get("reference"),
                       n_samples=n_samples, attempt=0, enqueued_at=now, meta=meta,
                       row=row if isinstance(get_task(row["task"]), PluginTask) else None)
