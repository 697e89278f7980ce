"""The torch side of ``train.precision``: weight dtype, bf16 compute, and what a checkpoint holds.

``shared.precision`` names the modes (``fp32``, ``bf16-mixed``, ``bf16-pure``) and bounds the lr;
this module turns a mode into what the learner does.

Invariants:
* the optimizer steps the model's own parameters, kept in ``weight_dtype``: fp32 unless
  ``bf16-pure``. Under ``bf16-mixed`` the model *is* the fp32 master copy, and AdamW's state is fp32;
* ``bf16-mixed`` computes in bf16. On one process and under DDP the forward and the loss run under
  ``torch.autocast(bf16)``; under FSDP2 the sharded fp32 parameters are gathered as bf16 for
  compute and gradients are reduced in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``), with no autocast on top. Either way gradients land in fp32 on the fp32
  parameters, so accumulation over micro-batches and the all-reduce are fp32;
* the weights published for the engines are cast to ``checkpoint_dtype`` (bf16 under bf16-*: half
  the disk of fp32, the dtype SGLang serves); when that cast loses bits, the durable checkpoint's
  trainer state also holds the fp32 master weights and a restart resumes from them, not from the
  rounded copy.

Why autocast rather than a bf16 working copy beside an fp32 master (the other usual recipe): one
copy of the weights instead of two, no copy-back after every optimizer step to keep in sync, and
the ops autocast keeps in fp32 (softmax, log-softmax, norm reductions, the loss) stay fp32, where a
bf16 copy runs everything in bf16. It costs a cast of each weight per forward, small beside the
matrix products of a training batch; and it matches what FSDP2's policy does for the sharded path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from shared.modeling import parse_dtype
from shared.precision import Precision, compute_dtype, weight_dtype


def weights_dtype(precision: Precision) -> torch.dtype:
    """The dtype the model's parameters and the optimizer state are kept in."""
    return parse_dtype(weight_dtype(precision))


def bf16_compute(precision: Precision) -> bool:
    """Forward and backward run in bf16 over fp32 weights (``bf16-mixed``)."""
    return compute_dtype(precision) != weight_dtype(precision)


def autocast(precision: Precision, device: torch.device, sharded: bool) -> contextlib.AbstractContextManager[Any]:
    """The context forward and loss run in: bf16 autocast under ``bf16-mixed`` (unless FSDP2's policy casts)."""
    if not bf16_compute(precision) or sharded:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def cast_floating(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point tensor in ``dtype`` (others as they are); tied tensors (one
    storage under several names, e.g. embeddings and LM head) stay one tensor."""
    cast: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if t.is_floating_point():
            key = (t.data_ptr(), tuple(t.shape))
            if key not in cast:
                cast[key] = t.detach().to(dtype)
            t = cast[key]
        out[name] = t
    return out
