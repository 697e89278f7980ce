"""Reading a same-architecture checkpoint from disk and checking it against the live model.

Contract: `read_checkpoint(path)` returns every tensor of the safetensors files of a Hugging
Face directory (single file or sharded), and `check_state(model, state)` raises
`WeightLoadError` naming the first offending tensor unless every live parameter is present
with the same shape (tied parameters may be absent: they share storage with one that is
present) and no unknown tensor is given. Both run off the scheduler thread, so a slow disk
never stalls decoding; the copy itself (`ModelRunner.load_state`) is the only part done between
two decode steps, and it only starts once the whole checkpoint was read and checked.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.errors import DressageError


class WeightLoadError(DressageError):
    """A checkpoint is missing, unreadable, or does not match the live model; names the tensor."""


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in directory `path` (or of the file `path`)."""
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(p.glob("*.safetensors"))
    else:
        raise WeightLoadError("model_path does not exist")  # messages name no path (they reach callers)
    if not files:
        raise WeightLoadError("model_path has no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises several types for a corrupt file
            raise WeightLoadError(f"cannot read checkpoint file {f.name!r} ({type(exc).__name__})") from exc
    return state


def check_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise WeightLoadError unless `state` can replace every parameter of `model` in place."""
    live = model.state_dict()
    unexpected = sorted(set(state) - set(live))
    if unexpected:
        raise WeightLoadError(f"checkpoint tensor {unexpected[0]!r} is not in the model ({len(unexpected)} unknown)")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(live[name].shape):
            raise WeightLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, model has {tuple(live[name].shape)}"
            )
    present = {live[n].data_ptr() for n in state}
    for name in sorted(set(live) - set(state)):
        if live[name].data_ptr() not in present:  # a tied weight is covered by its twin
            raise WeightLoadError(f"checkpoint lacks tensor {name!r}")
