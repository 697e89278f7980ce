"""Training precision: what each ``train.precision`` keeps in which dtype, and the smallest lr it can apply.

Pure (no torch): ``shared.config`` refuses at start a learning rate the weights cannot take, and the
trainer (``services.trainer.precision``) maps these names to torch dtypes.

Modes:
* ``fp32``: fp32 weights, AdamW state and compute;
* ``bf16-mixed``: fp32 master weights and AdamW state, forward and backward in bf16, gradients in fp32
  (what GPU runs want: bf16 speed, nothing rounded away);
* ``bf16-pure``: bf16 weights, AdamW state and compute. Half the memory of the weights, but every
  update is rounded to a bf16 weight, and one smaller than half a bf16 step of its weight is lost.

The lr bound (``min_lr``). AdamW moves a weight by about ``lr`` per step: its update is
``lr * m / (sqrt(v) + eps)`` and ``|m / sqrt(v)| <= 1``, close to 1 while a gradient keeps its sign
(less when it is noisy, so the real update is smaller still). A weight ``w`` stored with ``p``
significand bits (the implicit one included) sits on a grid of spacing ``ulp(w) = 2**(floor(log2|w|) - p + 1)``;
round-to-nearest gives ``w`` back for any update below half of that. An ``lr`` at or below
``ulp(w) / 2`` therefore never changes a weight of magnitude ``|w|`` or more. The check takes
``|w| = 1e-2``, the small end of the typical magnitude of LLM weights (1e-2 to 1e-1; norm gains near
1 need far more): bfloat16 (p = 8) needs lr > 3.05e-5, float16 (p = 11) lr > 3.8e-6, float32
(p = 24) lr > 4.7e-10. The lr of GRPO on LLMs, ~1e-6, is 30 times below the bfloat16 bound: only
fp32 weights (``fp32`` or ``bf16-mixed``) apply it.
"""

from __future__ import annotations

import math
from typing import Literal

Precision = Literal["fp32", "bf16-mixed", "bf16-pure"]
WeightDtype = Literal["float32", "bfloat16", "float16"]

PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16-mixed", "bf16-pure")
SIGNIFICAND_BITS: dict[WeightDtype, int] = {"float32": 24, "bfloat16": 8, "float16": 11}  # implicit bit included
TYPICAL_WEIGHT = 1e-2  # |w| the lr check is made at: the small end of typical LLM weight magnitudes


def weight_dtype(precision: Precision) -> WeightDtype:
    """The dtype the trained weights and the optimizer state are kept in."""
    return "bfloat16" if precision == "bf16-pure" else "float32"


def compute_dtype(precision: Precision) -> WeightDtype:
    """The dtype forward and backward run in."""
    return "float32" if precision == "fp32" else "bfloat16"


def checkpoint_dtype(precision: Precision, setting: str = "auto") -> WeightDtype:
    """The dtype of the weights published for the engines (``train.checkpoint_dtype``): ``auto`` = the
    compute dtype (what the engine runs in: bfloat16 under bf16-*, float32 under fp32)."""
    if setting == "auto":
        return compute_dtype(precision)
    for name in SIGNIFICAND_BITS:
        if name == setting:
            return name
    raise ValueError(f"train.checkpoint_dtype must be auto or one of {sorted(SIGNIFICAND_BITS)}, got {setting!r}")


def ulp(magnitude: float, dtype: WeightDtype) -> float:
    """Spacing of ``dtype``'s values around ``magnitude`` (> 0, in the normal range of ``dtype``)."""
    if not magnitude > 0:
        raise ValueError(f"magnitude must be > 0, got {magnitude}")
    _, exponent = math.frexp(magnitude)  # magnitude = f * 2**exponent with 0.5 <= f < 1
    return 2.0 ** (exponent - SIGNIFICAND_BITS[dtype])


def min_lr(dtype: WeightDtype, magnitude: float = TYPICAL_WEIGHT) -> float:
    """The lr at or below which an AdamW step (about ``lr`` per weight) leaves a ``dtype`` weight of
    ``magnitude`` unchanged: half its ``ulp`` (see the module docstring)."""
    return ulp(magnitude, dtype) / 2


def lr_problem(lr: float, precision: Precision, magnitude: float = TYPICAL_WEIGHT) -> str | None:
    """Why ``lr`` is too small for the weights of ``precision`` (a message naming both keys), or None."""
    dtype = weight_dtype(precision)
    bound = min_lr(dtype, magnitude)
    if lr > bound:
        return None
    advice = "use train.precision bf16-mixed (fp32 master weights, bf16 compute) or fp32, or raise train.lr"
    return (f"train.lr={lr:g} is too small for {dtype} weights (train.precision={precision}): an AdamW step "
            f"moves a weight by about lr, and a {dtype} weight of magnitude {magnitude:g} only changes for a "
            f"step above {bound:.3g} (half its spacing), so the updates would be rounded away; {advice}")
