"""The rows decoded together: one sequence per row of a left-padded KV cache.

Invariants: ``rows[i]`` owns KV row ``i`` and feeds ``last[i]`` at the next decode step; rows
join (`join`, one prefill pass for all joiners) and leave (`decode` finishing them, `remove`)
only between forward passes; every token appended to a sequence is tagged with the weight
version passed for the forward pass that produced it. The batch never calls callbacks: it hands
finished sequences back to the scheduler, which finishes them exactly once. A row finishes on a
stop token, a stop string / regex (``GenRequest.stop_check``) or its budget, never on a stop
before ``min_new_tokens`` tokens exist.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.engine.kv import PaddedKV
from services.engine.requests import DoneCallback, GenRequest, ProgressCallback, length_reason, stop_reason
from services.engine.runner import ModelRunner
from services.engine.sampling import BatchSampler, adjust_logits

TopList = list[tuple[float, int]]

Finished = list[tuple["Seq", dict[str, Any]]]  # (sequence, finish reason)


@dataclass
class Seq:
    """One request inside the engine (waiting or running)."""

    req: GenRequest
    on_done: DoneCallback
    budget: int  # max_new_tokens clamped to the context
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    arrived: float = field(default_factory=time.monotonic)  # when submitted
    on_progress: ProgressCallback | None = None  # streaming: called by the scheduler after each token
    top: list[TopList] | None = None  # output top logprobs (top_logprobs_num > 0)
    ids_lp: list[TopList] | None = None  # output token_ids_logprob
    input_top: list[TopList | None] | None = None
    input_ids_lp: list[TopList | None] | None = None

    def __post_init__(self) -> None:
        if self.req.top_logprobs_num > 0:
            self.top = []
        if self.req.token_ids_logprob:
            self.ids_lp = []


def _top(lp: torch.Tensor, n: int) -> TopList:
    vals, idx = lp.topk(min(n, lp.shape[-1]))
    return list(zip(vals.tolist(), idx.tolist(), strict=True))


def _pick(lp: torch.Tensor, ids: tuple[int, ...]) -> TopList:
    return list(zip(lp[list(ids)].tolist(), ids, strict=True))


class RunningBatch:
    def __init__(self, runner: ModelRunner, rng: random.Random) -> None:
        self.runner = runner
        self.rng = rng  # draws for rows without a sampling_seed
        self.rows: list[Seq] = []
        self.generated = 0  # tokens appended so far (stats)
        self._kv: PaddedKV | None = None
        self._last = torch.zeros(0, dtype=torch.long)
        self._sampler: BatchSampler | None = None  # rebuilt when rows change

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, joiners: list[Seq], version: str) -> Finished:
        """Prefill `joiners` together, give each its first token, merge the unfinished ones in."""
        want = [i for i, s in enumerate(joiners) if s.req.logprob_start_len >= 0]
        dists = [i for i in want if joiners[i].req.top_logprobs_num or joiners[i].req.token_ids_logprob]
        out = self.runner.prefill([s.req.input_ids for s in joiners], logprob_rows=want, dist_rows=dists)
        for i in want:
            s = joiners[i]
            lps: list[float | None] = [None, *out.logprobs[i]] if out.logprobs else []
            s.input_logprobs = lps[s.req.logprob_start_len:]
            if out.dists is not None and i in out.dists:
                rows = out.dists[i][max(s.req.logprob_start_len - 1, 0):]
                first: list[TopList | None] = [None] if s.req.logprob_start_len == 0 else []
                if s.req.top_logprobs_num:
                    s.input_top = first + [_top(r, s.req.top_logprobs_num) for r in rows]
                if s.req.token_ids_logprob:
                    s.input_ids_lp = first + [_pick(r, s.req.token_ids_logprob) for r in rows]
        sampler = BatchSampler([s.req.sampling for s in joiners], self.runner.vocab_size)
        tokens = self._sample(sampler, joiners, out.last_logits)
        done = {i: length_reason(0) for i, s in enumerate(joiners) if s.budget <= 0}  # prompt logprobs only
        done.update(self._record(joiners, tokens, version, sampler, skip=done))
        keep = [i for i in range(len(joiners)) if i not in done]
        if keep:
            out.kv.select(keep)
            self._kv = out.kv if self._kv is None else PaddedKV.concat(self._kv, out.kv)
            self.rows.extend(joiners[i] for i in keep)
            self._last = torch.cat([self._last, tokens[0][keep]])
            self._sampler = None
        return [(joiners[i], reason) for i, reason in done.items()]

    def decode(self, version: str) -> Finished:
        """One forward pass for every row; rows that finish leave the batch and are returned."""
        assert self._kv is not None
        logits = self.runner.decode(self._kv, self._last)
        if self._sampler is None:
            self._sampler = BatchSampler([s.req.sampling for s in self.rows], self.runner.vocab_size)
        tokens = self._sample(self._sampler, self.rows, logits)
        self._last = tokens[0]
        done = self._record(self.rows, tokens, version, self._sampler)
        finished = [(self.rows[i], reason) for i, reason in done.items()]
        if done:
            self.remove(done)
        return finished

    def remove(self, rows: Iterable[int]) -> list[Seq]:
        """Drop `rows` (indices) from the batch and return their sequences."""
        gone = set(rows)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        removed = [self.rows[i] for i in sorted(gone)]
        self.rows = [self.rows[i] for i in keep]
        self._last = self._last[keep]
        self._sampler = None
        if not keep:
            self._kv = None
        elif self._kv is not None:
            self._kv.select(keep)
        return removed

    def check(self) -> None:
        """Assert the cache layout and the row alignment (tests)."""
        if self._kv is not None:
            self._kv.check()
            assert self._kv.batch_size == len(self.rows) == len(self._last)

    def _sample(self, sampler: BatchSampler, seqs: list[Seq],
                logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Seeded draws are keyed by the token's absolute position, so a request resumed from
        # prompt + partial output (same seed) continues the random stream it was cut from.
        positions = [len(s.req.input_ids) + len(s.out) for s in seqs]
        logits = adjust_logits(logits, sampler.specs, [s.out for s in seqs], [s.req.stop_token_ids for s in seqs])
        u = None if sampler.all_greedy else sampler.uniforms(positions, self.rng)
        return sampler.sample(logits, u)

    def _record(self, seqs: list[Seq], tokens: tuple[torch.Tensor, torch.Tensor], version: str,
                sampler: BatchSampler, skip: dict[int, Any] | None = None) -> dict[int, dict[str, Any]]:
        """Append each row's new token; return {row: finish reason} for rows that finished."""
        done: dict[int, dict[str, Any]] = {}
        for i, (tok, lp) in enumerate(zip(tokens[0].tolist(), tokens[1].tolist(), strict=True)):
            if skip and i in skip:
                continue
            s, req = seqs[i], seqs[i].req
            s.out.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            if (s.top is not None or s.ids_lp is not None) and sampler.logp is not None:
                row = sampler.logp[i]
                if s.top is not None:
                    s.top.append(_top(row, req.top_logprobs_num))
                if s.ids_lp is not None:
                    s.ids_lp.append(_pick(row, req.token_ids_logprob))
            may_stop = len(s.out) >= req.min_new_tokens
            matched = req.stop_check(s.out) if may_stop and req.stop_check is not None else None
            if may_stop and tok in req.stop_token_ids:
                done[i] = stop_reason(tok)
            elif matched is not None:
                done[i] = stop_reason(matched)
            elif len(s.out) >= s.budget:
                done[i] = length_reason(len(s.out))
        self.generated += len(seqs) - len(skip or ())
        return done
