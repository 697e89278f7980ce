#!/usr/bin/env python3
"""Writes the example's own dataset: ``data/train.jsonl`` and ``data/test.jsonl`` (distinct items)."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from shop.tools import price_of

HERE = Path(__file__).resolve().parent


def main() -> None:
    rng = random.Random(7)
    items: list[str] = []
    while len(items) < 464:
        item = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
        if item not in items:
            items.append(item)
    for name, part in (("train", items[:400]), ("test", items[400:])):
        with open(HERE / "data" / f"{name}.jsonl", "w") as fh:
            for i, item in enumerate(part):
                row = {"prompt_id": f"shop-{name}-{i:04d}", "prompt": f"price of {item}?", "reference": price_of(item)}
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
