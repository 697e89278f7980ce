"""Next-token sampling for a batch of rows, each with its own sampling parameters.

Contract (pure torch, no model, no I/O):

* ``temperature == 0`` is greedy: the token is ``argmax(logits)``, exactly what
  ``transformers`` ``generate(do_sample=False)`` picks. Its reported logprob is the plain
  ``log_softmax(logits)`` of that token (temperature 1), so a trainer can compare it.
* ``temperature > 0``: the token is drawn from ``softmax(logits / T)`` restricted to the
  ``top_k`` most likely tokens and to the smallest nucleus of mass ``top_p`` (renormalised).
  The reported logprob is ``log_softmax(logits / T)[token]``: **temperature applied,
  top-k / top-p truncation not renormalised into it**. At ``T == 1`` it is therefore the plain
  log-softmax of the model's logits, which is what an RL trainer recomputes; with
  ``top_p == 1`` and ``top_k`` off it is also exactly the log-probability under the
  distribution the token was drawn from.
* Every draw is inverse-CDF sampling with one uniform number per row. With a
  ``sampling_seed`` that number is a pure function of ``(seed, absolute position of the token
  in the sequence)`` (``seeded_uniform``), so a seeded request gives the same tokens whatever
  else shares its batch and whenever it runs, and a generation resumed from prompt + partial
  output with the same seed continues the same random stream. Rows without a seed use the
  engine's own RNG.
* Logit processing before temperature, as SGLang does (`adjust_logits`, only for rows that ask):
  ``repetition_penalty`` divides positive / multiplies negative logits of tokens already
  generated (output only, SGLang 0.5); ``frequency_penalty`` subtracts ``count`` and
  ``presence_penalty`` subtracts 1 for every generated token; ``logit_bias`` is added; while
  fewer than ``min_new_tokens`` tokens exist the stop ids are masked out. The reported logprob
  is then taken from these adjusted logits (divided by T). ``min_p`` keeps the tokens whose
  probability is at least ``min_p`` times the most likely one's (a truncation like top-p).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-6  # temperatures below this are greedy (as in SGLang)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingSpec:
    """Per-request sampling parameters, already validated."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = -1  # <= 0 = off
    seed: int | None = None  # sampling_seed; None = engine RNG
    min_p: float = 0.0  # [0, 1]; 0 = off
    frequency_penalty: float = 0.0  # [-2, 2]
    presence_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 2]; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    min_new_tokens: int = 0  # stop ids masked out while fewer tokens were generated

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def adjusts(self) -> bool:
        """True if `adjust_logits` changes this row's logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_new_tokens)


def adjust_logits(logits: torch.Tensor, specs: Sequence[SamplingSpec], outputs: Sequence[Sequence[int]],
                  stop_ids: Sequence[frozenset[int]]) -> torch.Tensor:
    """Penalties, logit bias and the min_new_tokens mask for the rows that ask (see the module doc).

    `outputs[i]` are the tokens row i generated so far; returns `logits` (float32, a copy only
    when some row is adjusted).
    """
    rows = [i for i, s in enumerate(specs) if s.adjusts]
    if not rows:
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    for i in rows:
        s, out, row = specs[i], outputs[i], logits[i]
        if out and (s.frequency_penalty or s.presence_penalty or s.repetition_penalty != 1.0):
            counts = torch.bincount(torch.tensor(list(out), dtype=torch.long), minlength=vocab)[:vocab].float()
            seen = counts > 0
            if s.repetition_penalty != 1.0:
                p = s.repetition_penalty
                row[seen] = torch.where(row[seen] < 0, row[seen] * p, row[seen] / p)
            row -= s.frequency_penalty * counts + s.presence_penalty * seen.float()
        for tok, bias in s.logit_bias:
            row[tok] += bias
        if len(out) < s.min_new_tokens and stop_ids[i]:
            row[[t for t in stop_ids[i] if 0 <= t < vocab]] = float("-inf")
    return logits


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) from (seed, token position): splitmix64 of a combined counter."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


class BatchSampler:
    """Sampling tensors for one batch composition (rebuild it when rows join or leave)."""

    def __init__(self, specs: Sequence[SamplingSpec], vocab_size: int) -> None:
        self.specs = list(specs)
        self.all_greedy = all(s.greedy for s in self.specs)
        self.any_greedy = any(s.greedy for s in self.specs)
        # Greedy rows get temperature 1 so their logprobs are the plain log-softmax.
        self.temps = torch.tensor([[1.0 if s.greedy else s.temperature] for s in self.specs])
        self.greedy = torch.tensor([s.greedy for s in self.specs], dtype=torch.bool)
        self.unit_temp = all(s.greedy or s.temperature == 1.0 for s in self.specs)
        ks = [s.top_k if 0 < s.top_k < vocab_size else vocab_size for s in self.specs]
        ps = [s.top_p for s in self.specs]
        # Which rows truncate depends on each row's own parameters only, so a row draws the
        # same token from the same uniform whatever rows share its batch.
        rows = [k < vocab_size or p < 1.0 or s.min_p > 0 for k, p, s in zip(ks, ps, self.specs, strict=True)]
        self.truncate = any(rows)
        self.row_truncates = torch.tensor(rows, dtype=torch.bool)
        self.top_k = torch.tensor(ks, dtype=torch.long)
        self.top_p = torch.tensor(ps, dtype=torch.float32)
        self.min_p = torch.tensor([s.min_p for s in self.specs], dtype=torch.float32)
        self.logp: torch.Tensor | None = None  # [B, V] of the last `sample` call (top logprobs)

    def uniforms(self, positions: Sequence[int], rng: random.Random) -> torch.Tensor:
        """One uniform per row: seeded rows from (seed, their token's position), others from `rng`."""
        us = [
            seeded_uniform(s.seed, i) if s.seed is not None else rng.random()
            for s, i in zip(self.specs, positions, strict=True)
        ]
        return torch.tensor(us, dtype=torch.float32)

    def sample(self, logits: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B], logprobs [B]) for next-token `logits` [B, V]; `u` may be None if all greedy."""
        logits = logits.float()
        scaled = logits if self.unit_temp else logits / self.temps
        logp = self.logp = torch.log_softmax(scaled, dim=-1)
        if self.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            assert u is not None, "uniforms are needed when some row samples"
            tokens = self._draw(logp, u)
            if self.any_greedy:
                tokens = torch.where(self.greedy, logits.argmax(dim=-1), tokens)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)

    def _draw(self, logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        probs = logp.exp()
        plain = _inverse_cdf(probs, u)  # vocabulary order, for rows that do not truncate
        if not self.truncate:
            return plain
        # Truncating rows: sort once, mask ranks beyond top_k and tokens outside the nucleus.
        sorted_p, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1])[None, :]
        keep = ranks < self.top_k[:, None]
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above this token
        keep &= (before < self.top_p[:, None]) | (self.top_p[:, None] >= 1.0)
        keep &= sorted_p >= self.min_p[:, None] * sorted_p[:, :1]
        keep[:, 0] = True  # the most likely token always stays
        picked = _inverse_cdf(sorted_p * keep, u)
        truncated = order.gather(1, picked[:, None]).squeeze(1)
        return torch.where(self.row_truncates, truncated, plain)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i] per row (never a zero-weight index)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
    # Rounding can push the target onto the total; the first index reaching the total is the
    # last token with positive weight, so clamping there never picks a masked token.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(idx, last).squeeze(1)
