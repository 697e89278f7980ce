"""A bounded cache of rendered prompt ids, keyed by the exact chat input.

Invariant: ``get(messages, tools)`` returns what rendering the same messages and tools (and chat-template
variables) with the proxy's (fixed) tokenizer returned before, or None; it never returns ids of any other
input. The key is the canonical JSON of ``(messages, tools[, template kwargs])``, so only an identical request body part hits. A GRPO
group sends its prompt once per sample (8 identical renders per group in the demo), and a multi-turn
episode re-sends every earlier turn; rendering and tokenizing was the proxy's largest single cost in a
profile (13 % of its CPU). Entries whose key exceeds ``max_key_bytes`` are not cached, so the cache holds
at most ``max_entries × max_key_bytes`` of keys. A lock makes it safe from any thread.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any


class PromptCache:
    def __init__(self, max_entries: int = 1024, max_key_bytes: int = 65_536) -> None:
        self.max_entries, self.max_key_bytes = max_entries, max_key_bytes
        self._items: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            template_kwargs: dict[str, Any] | None = None) -> str:
        parts: list[Any] = [messages, tools, template_kwargs] if template_kwargs else [messages, tools]
        return json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr)

    def get(self, key: str) -> list[int] | None:
        with self._lock:
            ids = self._items.get(key)
            if ids is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
        return list(ids)

    def put(self, key: str, ids: list[int]) -> None:
        if len(key) > self.max_key_bytes or self.max_entries == 0:
            return
        with self._lock:
            self._items[key] = tuple(ids)
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)
