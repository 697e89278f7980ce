"""The running batch's KV cache: one left-padded tensor pair per layer, rebuilt only when rows change.

Invariant (checked by the unit tests): row ``i`` holds ``lengths[i]`` cached tokens, stored in
the last ``lengths[i]`` columns of every layer (``[width - lengths[i], width)``); ``mask[i, c]``
is 1 exactly on those columns; the cached tokens have positions ``0 .. lengths[i] - 1``, so the
next token of row ``i`` is fed at position ``lengths[i]``. Left padding makes every row write
its next key/value into the same column, which is what a plain ``DynamicCache`` does.

Rows join (`concat`: both sides are left-padded to the wider width) and leave (`select`: the
rows are gathered and the columns no remaining row uses are trimmed) only between forward
passes, so a decode step always sees one consistent cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from shared.errors import DressageError


class UnsupportedCache(DressageError):
    """The model's cache layout (e.g. sliding-window layers) cannot be left-padded and merged."""


def _kv_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise UnsupportedCache("this transformers version has no DynamicCache.layers")
    out = []
    for i, layer in enumerate(layers):
        if type(layer).__name__ != "DynamicLayer" or layer.keys is None:
            raise UnsupportedCache(f"cache layer {i} is {type(layer).__name__}; only full attention is supported")
        out.append((layer.keys, layer.values))
    return out


def _set_kv(cache: DynamicCache, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        layer.keys, layer.values = k, v  # type: ignore[union-attr]  # DynamicLayer, checked by _kv_tensors


class PaddedKV:
    """A left-padded batch cache plus its attention mask and per-row lengths."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        self.cache = cache  # per layer keys/values [B, H_kv, width, D]
        self.mask = mask  # [B, width] int64, 1 = real token
        self.lengths = lengths  # [B] int64, cached tokens per row = position of the next token
        self._next_mask = mask  # set by decode_inputs, committed by advance

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention mask [B, 1, 1, width + 1] bool, position ids [B, 1]) for one token per row.

        The mask is already 4-D (True = attend), so `transformers` uses it as is instead of
        rebuilding a causal mask every step: a single query token may see every real column.
        """
        ones = torch.ones((self.batch_size, 1), dtype=self.mask.dtype)
        self._next_mask = torch.cat([self.mask, ones], dim=1)
        return self._next_mask.bool()[:, None, None, :], self.lengths.unsqueeze(1)

    def advance(self) -> None:
        """Record that one token per row was appended (the model already grew the cache)."""
        self.mask = self._next_mask
        self.lengths = self.lengths + 1

    def select(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order) and trim columns that no kept row uses."""
        index = torch.tensor(list(rows), dtype=torch.long)
        lengths = self.lengths.index_select(0, index)
        start = self.width - int(lengths.max()) if len(rows) else self.width
        kv = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in _kv_tensors(self.cache)
        ]
        _set_kv(self.cache, kv)
        self.mask = self.mask.index_select(0, index)[:, start:]
        self.lengths = lengths

    @staticmethod
    def concat(a: PaddedKV, b: PaddedKV) -> PaddedKV:
        """The rows of `a` then the rows of `b`, left-padded to the wider of the two widths."""
        width = max(a.width, b.width)
        pa, pb = width - a.width, width - b.width
        kv = [
            (
                torch.cat([F.pad(ka, (0, 0, pa, 0)), F.pad(kb, (0, 0, pb, 0))], dim=0),
                torch.cat([F.pad(va, (0, 0, pa, 0)), F.pad(vb, (0, 0, pb, 0))], dim=0),
            )
            for (ka, va), (kb, vb) in zip(_kv_tensors(a.cache), _kv_tensors(b.cache), strict=True)
        ]
        _set_kv(a.cache, kv)
        mask = torch.cat([F.pad(a.mask, (pa, 0)), F.pad(b.mask, (pb, 0))], dim=0)
        return PaddedKV(a.cache, mask, torch.cat([a.lengths, b.lengths]))

    def check(self) -> None:
        """Assert the layout invariant (tests and debugging; O(B * width))."""
        cols = torch.arange(self.width)[None, :]
        expected = (cols >= (self.width - self.lengths)[:, None]).to(self.mask.dtype)
        assert torch.equal(self.mask, expected), "mask is not the left-padded layout of lengths"
        for k, v in _kv_tensors(self.cache):
            assert k.shape[0] == v.shape[0] == self.batch_size and k.shape[2] == self.width
