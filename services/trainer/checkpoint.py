"""Checkpoints on the checkpoint volume: atomic write, completeness, resume state, pruning.

Layout under ``train.checkpoint_dir``::

    v00000003/                  a complete checkpoint of version "3" (Hugging Face layout)
        config.json  generation_config.json  model.safetensors  tokenizer files
        trainer_state.pt        optimizer, scheduler, RNG, step, version, counters, consumed batch ids
        checkpoint.json         manifest written last: version, step, every file with its size
    .tmp-v00000004-<random>/    being written (or left by a crash): never loaded, removed at start
    .trash-v00000001-<random>/  being pruned: never loaded, removed at start
    snapshots/v00000005/        weights only (``train.checkpoint_every_versions`` > 1): what engines
                                load for a version published between two durable checkpoints

Invariants:
* a directory named ``v<version>`` is complete: it is written under a temporary name, every file
  and the directory are fsynced, then it is renamed into place (one atomic rename) and the parent
  is fsynced. ``complete()`` also checks the manifest against the files, so even a directory damaged
  behind our back is skipped, never loaded;
* a version directory is never overwritten (versions are never reused);
* pruning renames a directory to ``.trash-*`` before deleting it, so a crash mid-delete leaves
  nothing that looks like a checkpoint;
* a *snapshot* (``snapshots/v<version>``) is a complete model directory (weights, config, tokenizer)
  without trainer state, renamed into place like a checkpoint but **not fsynced**: it survives a
  process crash (the page cache keeps it), not a power loss, and it is never resumed from. Only
  ``v<version>`` directories in the root are checkpoints (``complete``); a snapshot's version becomes
  durable when it is *promoted*: its files hard-linked (copied where links fail) into a checkpoint
  of the same version beside the trainer state, fsynced and renamed like any checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.trainer.faults import fault_point
from shared.errors import DressageError
from shared.modeling import missing_files

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
MANIFEST = "checkpoint.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
SNAPSHOTS = "snapshots"
# Modes of everything placed under the checkpoint root, whatever the umask: the engines that load a
# version may run as another user than the trainer (a non-root SGLang image, root-squashed NFS), and
# a temporary directory is created 0700. Nothing here is secret; only the trainer may write.
DIR_MODE, FILE_MODE = 0o755, 0o644


class CheckpointError(DressageError):
    """A checkpoint cannot be written or read (e.g. its version directory already exists)."""


@dataclass(frozen=True)
class CheckpointInfo:
    version: int  # the weight version this checkpoint is published as
    step: int  # optimizer steps taken when it was written
    path: Path  # the complete directory


def dir_name(version: int) -> str:
    return f"v{version:08d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _readable_by_all(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, DIR_MODE)
        for name in files:
            os.chmod(Path(dirpath) / name, FILE_MODE)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def rng_state() -> dict[str, Any]:
    """Python and torch RNG states (CUDA too when present), loadable with ``weights_only``."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _require_model(d: Path) -> None:
    missing = missing_files(d)
    if missing:
        raise CheckpointError(f"{d} lacks {', '.join(missing)}")


def _place(final: Path, fill: Callable[[Path], None], durable: bool) -> Path:
    """``fill`` a fresh temporary directory beside ``final``, then rename it to ``final`` (atomic);
    ``durable``: every file and both directories fsynced. Never overwrites; on any error nothing is left.
    What lands is readable by every user (``DIR_MODE``, ``FILE_MODE``)."""
    if final.exists():
        raise CheckpointError(f"{final} already exists; versions are never reused")
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        fill(tmp)
        _readable_by_all(tmp)
        if durable:
            _fsync_tree(tmp)
        os.rename(tmp, final)
        if durable:
            _fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def pinned_names(root: Path, referenced: Iterable[str | Path]) -> set[str]:
    """Names of the entries directly under ``root`` that ``referenced`` paths point at (after symlinks).

    The trainer prunes after every version against every path an evaluation still needs, and those
    are the resolved paths it published: such a path is matched as written, with no system call. Any
    other (relative, through a symlink) is resolved. Resolving every path (an ``lstat`` per component)
    made pruning grow with the run: 12.6 ms for 300 pinned paths against 0.34 ms now, and 17 % of a
    1,500-step trainer's profile samples with deferred evaluation (every 5th version pinned).
    """
    real = str(root.resolve())
    names = set()
    for p in referenced:
        parent, name = os.path.split(os.path.abspath(p))  # lexical: ".." and "." folded, no system call
        if parent != real:
            parent, name = os.path.split(os.path.realpath(p))
        if parent == real:
            names.add(name)
    return names


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (a file never written again), or a copy where links fail."""
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or no hard links
        shutil.copy2(src, dst)


class CheckpointStore:
    """The checkpoint directory of one trainer."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # Checkpoints this process wrote or found complete: ``prune`` runs after every version and
        # must not re-read every manifest and stat every file of up to ``keep`` checkpoints each time
        # (it took 27 % of the trainer's time in the async bench). ``complete()`` still checks them all.
        self._known: dict[str, CheckpointInfo] = {}

    def path_for(self, version: int) -> Path:
        return self.root / dir_name(version)

    @property
    def snapshot_root(self) -> Path:
        return self.root / SNAPSHOTS

    def snapshot_path(self, version: int) -> Path:
        return self.snapshot_root / dir_name(version)

    def cleanup_temp(self) -> list[Path]:
        """Remove temporary and trash directories left by a crash; returns what was removed."""
        removed = []
        for parent in (self.root, self.snapshot_root):
            for p in parent.iterdir() if parent.is_dir() else ():
                if p.is_dir() and p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
                    log.warning("removed leftover checkpoint directory %s", p)
        return removed

    def _read_complete(self, p: Path) -> CheckpointInfo | None:
        try:
            manifest = json.loads((p / MANIFEST).read_text())
            files: dict[str, int] = manifest["files"]
            if any((p / name).stat().st_size != size for name, size in files.items()):
                raise ValueError("a file's size differs from the manifest")
            if STATE_FILE not in files or missing_files(p):
                raise ValueError("required files missing")
            info = CheckpointInfo(int(manifest["version"]), int(manifest["step"]), p)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("skipping incomplete checkpoint %s: %s", p, exc)
            self._known.pop(p.name, None)
            return None
        if p.name != dir_name(info.version):
            log.warning("skipping checkpoint %s: manifest says version=%d", p, info.version)
            self._known.pop(p.name, None)
            return None
        self._known[p.name] = info
        return info

    def complete(self, recheck: bool = True) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest version first, each checked against its manifest
        (``recheck=False``: only those this process has not already checked or written)."""
        found = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit():
                info = None if recheck else self._known.get(p.name)
                if info is None:
                    info = self._read_complete(p)
                if info is not None:
                    found.append(info)
        return sorted(found, key=lambda i: i.version)

    def newest(self) -> CheckpointInfo | None:
        done = self.complete()
        return done[-1] if done else None

    def write(self, version: int, step: int, save_weights: Callable[[Path], None],
              state: dict[str, Any]) -> CheckpointInfo:
        """Write checkpoint ``version`` atomically; ``save_weights(dir)`` writes the HF files."""

        def fill(tmp: Path) -> None:
            save_weights(tmp)
            torch.save(state, tmp / STATE_FILE)
            _require_model(tmp)
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            fault_point("mid_checkpoint")
            (tmp / MANIFEST).write_text(json.dumps({"version": version, "step": step, "files": files},
                                                   indent=1, sort_keys=True))

        info = CheckpointInfo(version, step, _place(self.path_for(version), fill, durable=True))
        log.info("checkpoint written version=%d step=%d path=%s", version, step, info.path)
        self._known[info.path.name] = info
        return info

    # --- snapshots: weights only, between durable checkpoints ---------------------------------

    def write_snapshot(self, version: int, step: int, save_weights: Callable[[Path], None]) -> CheckpointInfo:
        """Write the weights-only snapshot of ``version``: a loadable model directory renamed into
        place, not fsynced (see the module docstring)."""

        def fill(tmp: Path) -> None:
            save_weights(tmp)
            _require_model(tmp)
            fault_point("mid_snapshot")

        self.snapshot_root.mkdir(exist_ok=True)
        info = CheckpointInfo(version, step, _place(self.snapshot_path(version), fill, durable=False))
        log.info("snapshot written version=%d step=%d path=%s", version, step, info.path)
        return info

    def promote(self, snapshot: CheckpointInfo, state: dict[str, Any]) -> CheckpointInfo:
        """The durable checkpoint of a snapshot's version: its files linked beside ``state``."""

        def link_files(d: Path) -> None:
            for f in sorted(snapshot.path.iterdir()):
                if f.is_file():
                    link_or_copy(f, d / f.name)  # a snapshot's files are never written again

        return self.write(snapshot.version, snapshot.step, link_files, state)

    def snapshots(self) -> list[CheckpointInfo]:
        """The snapshot directories, oldest version first (step unknown: 0)."""
        root = self.snapshot_root
        found = [CheckpointInfo(int(p.name[1:]), 0, p) for p in (root.iterdir() if root.is_dir() else ())
                 if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit()]
        return sorted(found, key=lambda i: i.version)

    def drop_snapshots_above(self, version: int) -> list[Path]:
        """Delete snapshots of versions > ``version``: left by a lineage a restart abandoned (only
        when the version bus lost what was published; their numbers are about to be reused)."""
        gone = [self._discard(i) for i in self.snapshots() if i.version > version]
        for p in gone:
            log.warning("removed snapshot %s of an abandoned version", p)
        return gone

    def prune_snapshots(self, keep: int, referenced: Iterable[str | Path] = ()) -> list[Path]:
        """Delete all but the newest ``keep`` snapshots and those in ``referenced``."""
        done = self.snapshots()
        survivors = {i.path.name for i in done[-keep:]} | pinned_names(self.snapshot_root, referenced)
        return [self._discard(i) for i in done if i.path.name not in survivors]

    def _discard(self, info: CheckpointInfo) -> Path:
        trash = info.path.parent / f"{TRASH_PREFIX}{info.path.name}-{os.urandom(4).hex()}"
        os.rename(info.path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        return info.path

    def load_state(self, info: CheckpointInfo) -> dict[str, Any]:
        """The trainer state of a checkpoint (tensors and plain values only; nothing unpickled)."""
        state: dict[str, Any] = torch.load(info.path / STATE_FILE, map_location="cpu", weights_only=True)
        return state

    def prune(self, keep: int, referenced: Iterable[str | Path] = ()) -> list[Path]:
        """Delete all but the newest ``keep`` checkpoints and those in ``referenced``."""
        done = self.complete(recheck=False)
        survivors = {i.path.name for i in done[-keep:]} | pinned_names(self.root, referenced)
        removed = []
        for info in done:
            if info.path.name in survivors:
                continue
            self._known.pop(info.path.name, None)
            removed.append(self._discard(info))
            log.info("pruned checkpoint version=%d path=%s", info.version, info.path)
        return removed
