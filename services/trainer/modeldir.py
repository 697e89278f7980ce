"""A version's model directory, written at the cost of its weights alone.

Every published version is a loadable Hugging Face directory: weights, ``config.json``,
``generation_config.json`` and the tokenizer files, made readable by older transformers
(``make_loadable``). Only the weights change from one version to the next. The first directory is
written in full by transformers; each later one gets the unchanging files hard-linked from the previous
directory (copied where links fail) and its weights written straight to ``model.safetensors`` with the
tensor names and metadata transformers chose the first time. On the CPU demo's model that is 1.3 ms
instead of 4.6 ms a version (alone on a quiet machine), on the trainer's critical path at every version.

Invariants:
* a directory this writer fills holds the same files as a full ``save_pretrained`` of the same weights,
  and the same bytes in every file but ``model.safetensors``, whose tensors (names, dtypes, shapes,
  values) and metadata are those of a full save (tested: the file is byte-identical on the demo model);
* the fast path is taken only when the first full save produced one unsharded ``model.safetensors`` whose
  tensor names are all keys of the weights being saved; otherwise every directory is written in full;
* files are never written in place: a linked file is shared with earlier directories, which are never
  written again (``services.trainer.checkpoint``), so linking never changes an earlier version;
* ``config.json`` names the dtype the weights are saved in (``dtype`` and ``torch_dtype``), which is
  ``train.checkpoint_dtype`` and may differ from the trained model's (fp32 master weights published as
  bf16): an engine that loads "auto" gets what was written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from services.trainer.checkpoint import link_or_copy
from shared.modeling.compat import make_loadable

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def _stamp_dtype(config: Path, weights: dict[str, Any]) -> None:
    """Write the saved weights' floating dtype into ``config`` (transformers writes the model's)."""
    dtype = next((str(v.dtype).removeprefix("torch.") for v in weights.values() if v.is_floating_point()), None)
    data = json.loads(config.read_text())
    if dtype is None or (data.get("dtype", dtype) == dtype and data.get("torch_dtype", dtype) == dtype):
        return
    data["dtype"] = data["torch_dtype"] = dtype
    config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


class ModelDirWriter:
    """Fills model directories for one model and tokenizer, version after version (one thread at a time)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._previous: Path | None = None  # the newest finished directory: its unchanging files are linked
        self._learned = False  # a full save has been looked at
        self._names: list[str] | None = None  # tensor names of a full save, when the fast path applies
        self._metadata: dict[str, str] | None = None
        self._static: list[str] = []  # the files besides the weights

    def write(self, out: Path, weights: dict[str, Any] | None) -> None:
        """Fill the empty directory ``out`` with the model directory of ``weights`` (None: the model's own)."""
        if self._names is not None and self._previous is not None and self._link_static(out):
            state = weights if weights is not None else self.model.state_dict()
            save_file({name: state[name].contiguous() for name in self._names}, str(out / WEIGHTS_FILE),
                      metadata=self._metadata)
        else:
            self._write_full(out, weights)

    def finished(self, final: Path) -> None:
        """A directory this writer filled is in place at ``final``: later versions link its unchanging files."""
        self._previous = final

    def _write_full(self, out: Path, weights: dict[str, Any] | None) -> None:
        # a copy: transformers deletes the names of tied tensors from the dict it is given
        self.model.save_pretrained(out, safe_serialization=True, state_dict=None if weights is None else dict(weights))
        self.tokenizer.save_pretrained(out)
        if weights is not None:
            _stamp_dtype(out / "config.json", weights)
        make_loadable(out)  # transformers 4.5x (SGLang's pin) reads the checkpoint too
        if not self._learned:
            self._learned = True
            self._learn_layout(out, weights if weights is not None else self.model.state_dict())

    def _learn_layout(self, out: Path, state: dict[str, Any]) -> None:
        """After the first full save: the fast path's tensor names and metadata, if it can reproduce it."""
        files = sorted(p.name for p in out.iterdir() if p.is_file())
        if SHARD_INDEX in files or WEIGHTS_FILE not in files:
            log.info("model directory written in full at every version: the weights are not one %s (%s)",
                     WEIGHTS_FILE, files)
            return
        with safe_open(str(out / WEIGHTS_FILE), framework="pt") as f:
            names, metadata = list(f.keys()), f.metadata()
        if any(n not in state for n in names):
            log.info("model directory written in full at every version: saved tensor names differ from the "
                     "model's state dict")
            return
        self._names, self._metadata = names, metadata
        self._static = [f for f in files if f != WEIGHTS_FILE]

    def _link_static(self, out: Path) -> bool:
        """Link (or copy) the unchanging files of the previous directory into ``out``; False if it is gone."""
        assert self._previous is not None
        sources = [self._previous / name for name in self._static]
        if not all(p.is_file() for p in sources):  # pruned, or moved behind our back: write in full once more
            return False
        for src in sources:
            link_or_copy(src, out / src.name)
        return True
