"""Reference models for the engine tests: a seeded perturbed checkpoint and the greedy
continuation the engine must reproduce.

``ignore_eos`` (SGLang's semantics) only stops the end-of-sequence token from ending the
request: the token can still be chosen. Hugging Face's ``generate(min_new_tokens=n)`` instead
masks it out, so a model whose argmax is EOS somewhere continues differently there (a random
perturbation of the tiny model does so for about 3 % of draws). `greedy_ignore_eos` takes the
plain argmax at every step, EOS included.

`save_perturbed` draws its noise from a seeded generator, so every run tests the same second
checkpoint (an unseeded draw made a test's outcome depend on the draw).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shared.modeling import load_model


def greedy_ignore_eos(model: Any, ids: list[int], n: int) -> list[int]:
    """The `n` tokens that greedy decoding of `model` appends to `ids`, never stopping."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def save_perturbed(model_dir: Path, out_dir: Path, seed: int = 1, scale: float = 0.05) -> Any:
    """Save the model of `model_dir` with seeded Gaussian noise added to every weight; return it."""
    model = load_model(model_dir)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=noise))
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
