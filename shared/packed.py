"""Raw little-endian token arrays: the wire form of a Sample's ``token_ids`` (int32),
``logprobs`` (float32) and ``loss_mask`` (uint8). Pure helpers shared by the schema and the codec."""

from __future__ import annotations

import sys
from array import array
from typing import Any

_LITTLE = sys.byteorder == "little"
TYPECODES = {"token_ids": "i", "logprobs": "f", "loss_mask": "B"}  # packed Sample fields
ITEMSIZE = {name: array(code).itemsize for name, code in TYPECODES.items()}


def pack(values: Any, code: str) -> bytes:
    arr = array(code, values)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def unpack(raw: bytes, code: str) -> list[Any]:
    arr = array(code)
    arr.frombytes(raw)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()
