"""The prompt-id cache: hits only on the identical input, bounded, and the proxy renders as before."""

from __future__ import annotations

from services.proxy.promptcache import PromptCache


def test_only_an_identical_input_hits_and_a_hit_is_a_copy() -> None:
    cache = PromptCache()
    msgs = [{"role": "user", "content": "abc"}]
    key = cache.key(msgs, None)
    assert cache.get(key) is None
    cache.put(key, [1, 2, 3])
    got = cache.get(cache.key([{"content": "abc", "role": "user"}], None))  # same dict, other key order
    assert got == [1, 2, 3]
    got.append(4)  # a caller's change never reaches the cache
    assert cache.get(key) == [1, 2, 3]
    assert cache.get(cache.key([{"role": "user", "content": "abd"}], None)) is None
    assert cache.get(cache.key(msgs, [{"type": "function", "function": {"name": "f"}}])) is None
    assert (cache.hits, cache.misses) == (2, 3)


def test_the_oldest_entry_goes_first_and_huge_keys_are_not_kept() -> None:
    cache = PromptCache(max_entries=2, max_key_bytes=100)
    keys = [cache.key([{"role": "user", "content": c}], None) for c in "abc"]
    cache.put(keys[0], [0])
    cache.put(keys[1], [1])
    assert cache.get(keys[0]) == [0]  # a hit makes it the newest
    cache.put(keys[2], [2])
    assert cache.get(keys[1]) is None and cache.get(keys[0]) == [0] and cache.get(keys[2]) == [2]
    big = cache.key([{"role": "user", "content": "x" * 200}], None)
    cache.put(big, [9])
    assert cache.get(big) is None
