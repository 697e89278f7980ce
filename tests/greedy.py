"""The greedy continuation the engine must reproduce for a request with ``ignore_eos``.

``ignore_eos`` (SGLang's semantics) only stops the end-of-sequence token from ending the
request: the token can still be chosen. Hugging Face's ``generate(min_new_tokens=n)`` instead
masks it out, so a model whose argmax is EOS somewhere continues differently there (a random
perturbation of the tiny model does so for about 3 % of seeds). This reference takes the plain
argmax at every step, EOS included.
"""

from __future__ import annotations

from typing import Any

import torch


def greedy_ignore_eos(model: Any, ids: list[int], n: int) -> list[int]:
    """The `n` tokens that greedy decoding of `model` appends to `ids`, never stopping."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]
