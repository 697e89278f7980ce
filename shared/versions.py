"""Weight-version labels: which labels are real versions, how two compare, and where one sits.

The one place that says what a version label means. The trainer publishes ``"0"``, ``"1"``, ...:
such labels are numbers and compare as numbers. A label is *real* unless it is None or, stripped and
lower-cased, one of ``""``, ``"-1"``, ``"unknown"``, ``"none"`` (``"-1"`` marks tokens no weight version
produced); a real label is its stripped string, so ``" v1 "`` and ``"v1"`` are one version. A foreign
label (a string the trainer never writes) has no number: it is ordered by its place in the publication
log where an order is needed, and any different label counts as newer on the bus. Pure functions only.
"""

from __future__ import annotations

from shared.errors import DressageError

CONTEXT_VERSION = "-1"  # label of tokens no weight version produced (prompt, tool output, feedback)
NON_REAL_LABELS = frozenset({"", "-1", "unknown", "none"})


class VersionFormatError(DressageError):
    """The published version is not an integer string, so the trainer cannot continue its numbering."""


def real_version(v: object) -> str | None:
    """The stripped label of a real version, or None (``None``, ``""``, ``-1``, ``unknown``, ``none``)."""
    if v is None:
        return None
    s = str(v).strip()
    return None if s.lower() in NON_REAL_LABELS else s


def version_number(label: str) -> int | None:
    """The number an integer label stands for ("3" -> 3), None for any other label."""
    try:
        return int(label)
    except ValueError:
        return None


def trainer_number(label: str) -> int:
    """The number of a published version the trainer can continue from; `VersionFormatError` for a
    foreign label (the trainer publishes "0", "1", ... and cannot number after one)."""
    number = version_number(label)
    if number is None:
        raise VersionFormatError(f"weights:latest version {label!r} is not an integer; the trainer "
                                 "publishes \"0\", \"1\", ... and cannot continue after a foreign label")
    return number


def version_newer(a: str, b: str | None) -> bool:
    """Is version ``a`` newer than ``b``? Integers compare numerically; other labels by inequality."""
    if b is None:
        return True
    na, nb = version_number(a), version_number(b)
    if na is None or nb is None:
        return a != b
    return na > nb


def version_index(latest: str | None, log_length: int) -> int | None:
    """Index of the newest published version: its number for an integer label, else its position in
    a log of ``log_length`` entries; None before any publication (or for a negative number)."""
    if latest is None:
        return None
    value = version_number(latest)
    if value is None:
        return log_length - 1 if log_length > 0 else None
    return value if value >= 0 else None


def versions_behind(current: int, label: str) -> int | None:
    """How many versions ``label`` is behind version number ``current``; None for a foreign label."""
    n = version_number(label)
    return None if n is None else current - n
