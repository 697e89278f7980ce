"""Which model an experiment's runs started from: its *build*, and the rule that one experiment holds one.

A build is the first 12 hex digits of the sha256 over a model directory's weight files (``*.safetensors``,
else ``*.bin``), in name order. The same ``dressage init-model`` command makes different weights on
different CPUs (float rounding in the warm start differs between instruction sets), and runs that start
from different weights are different experiments: their seeds do not pool. So every run's summary row
records the build it started from, and the harness refuses to add runs to a folder whose finished runs
came from another build (``BuildMismatch``) -- the invariant: one experiment folder, one build.

A model that is not a local directory of weights (a hub id, a path not yet built) has no build (None); it
is never compared. ``check_builds`` is pure; only ``model_build`` reads files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

DIGITS = 12
CHUNK = 1 << 20


class BuildMismatch(RuntimeError):
    """Runs of one experiment folder would start from different model builds."""


def weight_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    if not folder.is_dir():
        return []
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))


def weights_stamp(path: str | Path) -> tuple[tuple[str, int, int], ...]:
    """Name, size and mtime of each weight file: what must change before the build can."""
    return tuple((f.name, st.st_size, st.st_mtime_ns) for f in weight_files(path) for st in (f.stat(),))


def model_build(path: str | Path) -> str | None:
    """The build of the model directory at ``path``; None when it holds no weight files."""
    files = weight_files(path)
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()[:DIGITS]


def check_builds(finished: Mapping[str, str | None], current: str | None, model: str, folder: str) -> None:
    """Raise ``BuildMismatch`` when a finished run (run key -> its build) started from another build than
    ``current``, the build the next runs would start from. Unknown builds (None) are not compared."""
    if current is None:
        return
    other = {key: build for key, build in finished.items() if build is not None and build != current}
    if other:
        shown = ", ".join(f"{key} ({build})" for key, build in sorted(other.items())[:4])
        more = f" and {len(other) - 4} more" if len(other) > 4 else ""
        raise BuildMismatch(
            f"{model} is build {current}, but finished runs in {folder} started from another: {shown}{more}. "
            "Seeds of different builds do not pool: restore that model, or give the new runs their own folder "
            "(--out)")


def builds_text(by_variant: Mapping[str, list[str | None]]) -> str:
    """The report's line from each variant's runs' builds: the one build; one per variant where variants
    start from different models; a warning naming the variant whose own runs were mixed."""
    known = {v: sorted({b for b in builds if b is not None}) for v, builds in by_variant.items()}
    unknown = sum(1 for builds in by_variant.values() for b in builds if b is None)
    tail = f"; {unknown} runs without a recorded build" if unknown else ""
    mixed = [v for v, bs in known.items() if len(bs) > 1]
    if mixed:
        return "MIXED within " + ", ".join(f"{v} ({' '.join(known[v])})" for v in mixed) + \
            ": these seeds do not pool" + tail
    every = sorted({b for bs in known.values() for b in bs})
    if not every:
        return "unknown (no run recorded one)"
    if len(every) == 1:
        return every[0] + tail
    return "per variant: " + "; ".join(f"{v} {bs[0]}" for v, bs in known.items() if bs) + tail
