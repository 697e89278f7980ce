"""Raw little-endian token arrays: the wire form of a Sample's ``token_ids`` (int32),
``logprobs`` (float32) and ``loss_mask`` (uint8). Pure helpers shared by the schema and the codec."""

from __future__ import annotations

import re
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


# The high two bytes of a non-finite little-endian float32: exponent all ones (0x7F80 under the sign).
_NONFINITE_HIGH = re.compile(rb"[\x80-\xff][\x7f\xff]")


def finite_f32(raw: bytes) -> bool:
    """No NaN or infinity among the little-endian float32 values in ``raw`` (a C-speed scan: candidate
    byte pairs are rare in real logprobs, and only those aligned as a value's high half count)."""
    return not any(m.start() % 4 == 2 for m in _NONFINITE_HIGH.finditer(raw))


def unpack(raw: bytes, code: str) -> list[Any]:
    arr = array(code)
    arr.frombytes(raw)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()
