"""The shop's one tool, ``price``: the price of an item, which only the shop knows.

Shared by the agent (which runs the tool for the model) and the task (which runs it in a white-box
episode), so both agree on what the tool answers. Prices are two digits derived from a keyed hash of
the item, so a model cannot compute or remember them: it has to call the tool and copy the answer.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

ITEM = re.compile(r"[a-z]{3}")
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "price", "description": "The price of an item in the shop.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}]


def price_of(item: str) -> str:
    """The shop's price of ``item``: "10".."99"."""
    digest = hashlib.blake2b(item.encode(), digest_size=8, person=b"byo-shop-price").digest()
    return str(10 + int.from_bytes(digest, "big") % 90)


def remembered_price(item: str) -> str:
    """A price written from memory: another hash, never the right one (a habit RL has to unlearn)."""
    digest = hashlib.blake2b(item.encode(), digest_size=8, person=b"byo-shop-memory").digest()
    guess = str(10 + int.from_bytes(digest, "big") % 90)
    return guess if guess != price_of(item) else str(10 + (int(guess) - 9) % 90)


def run_tool(name: str, arguments: str) -> tuple[str, bool]:
    """The tool's answer to one call and whether the call was a good one (errors are answers too)."""
    if name != "price":
        return f"error: unknown tool {name}", False
    try:
        item = json.loads(arguments).get("item")
    except (ValueError, AttributeError):
        return "error: arguments must be a JSON object", False
    if not isinstance(item, str) or not ITEM.fullmatch(item):
        return "error: item must be 3 lowercase letters", False
    return price_of(item), True
