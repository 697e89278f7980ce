"""Engine sampling: greedy, temperature, top-k/top-p truncation, seeded determinism, reported logprobs."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from services.engine.protocol import SamplingParams
from services.engine.sampling import BatchSampler, SamplingSpec, seeded_uniform

torch.set_num_threads(1)


def logits(rows: int = 3, vocab: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_picks_argmax_and_reports_plain_log_softmax() -> None:
    x = logits()
    tokens, lps = BatchSampler([SamplingSpec(temperature=0.0)] * 3, 10).sample(x, None)
    assert tokens.tolist() == x.argmax(-1).tolist()
    assert torch.allclose(lps, torch.log_softmax(x, -1).gather(1, tokens[:, None]).squeeze(1))


def test_sampled_logprob_applies_temperature_but_not_truncation() -> None:
    x = logits()
    specs = [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.5), SamplingSpec(temperature=2.0, top_k=3)]
    s = BatchSampler(specs, 10)
    tokens, lps = s.sample(x, s.uniforms([0, 0, 0], random.Random(0)))
    for row, t in enumerate((1.0, 0.5, 2.0)):
        want = torch.log_softmax(x[row] / t, -1)[tokens[row]]
        assert abs(lps[row].item() - want.item()) < 1e-6


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = logits(rows=2)
    s = BatchSampler([SamplingSpec(temperature=1.0, top_k=1), SamplingSpec(temperature=1.0, top_p=1e-6)], 10)
    rng = random.Random(0)
    for _ in range(20):
        tokens, _ = s.sample(x, s.uniforms([0, 0], rng))
        assert tokens.tolist() == x.argmax(-1).tolist()


def test_top_k_never_leaves_the_k_most_likely_tokens() -> None:
    x = logits(rows=1, vocab=20)
    allowed = set(x[0].topk(4).indices.tolist())
    s, rng = BatchSampler([SamplingSpec(temperature=3.0, top_k=4)], 20), random.Random(1)
    seen = {int(s.sample(x, s.uniforms([0], rng))[0]) for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_draws_follow_the_softmax_distribution() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0]])
    s, rng = BatchSampler([SamplingSpec(temperature=1.0)], 3), random.Random(7)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[int(s.sample(x, s.uniforms([0], rng))[0])] += 1
    assert torch.allclose(counts / 3000, torch.softmax(x[0], -1), atol=0.03)


def test_seeded_uniforms_depend_only_on_seed_and_index() -> None:
    a = [seeded_uniform(42, i) for i in range(100)]
    assert a == [seeded_uniform(42, i) for i in range(100)]
    assert a != [seeded_uniform(43, i) for i in range(100)]
    assert all(0.0 <= u < 1.0 for u in a) and len(set(a)) == 100
    s = BatchSampler([SamplingSpec(seed=42), SamplingSpec(seed=None)], 10)
    u = s.uniforms([5, 5], random.Random(0))
    assert u[0].item() == torch.tensor(seeded_uniform(42, 5)).item()


def test_a_rows_draw_does_not_depend_on_truncating_neighbours() -> None:
    x = logits(rows=2, vocab=50, seed=3)
    plain = BatchSampler([SamplingSpec(seed=5)], 50)
    mixed = BatchSampler([SamplingSpec(seed=5), SamplingSpec(top_p=0.5, seed=6)], 50)
    rng = random.Random(0)
    for i in range(30):
        alone = plain.sample(x[:1], plain.uniforms([i], rng))[0]
        together = mixed.sample(x, mixed.uniforms([i, i], rng))[0]
        assert int(alone[0]) == int(together[0])


def test_top_k_zero_is_refused_as_sglang_does_and_minus_one_is_off() -> None:
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=5).top_k == 5
    with pytest.raises(ValidationError, match="top_k must be -1"):
        SamplingParams(top_k=0)
