"""CPU learning test: GRPO steps of the trainer raise the reward of a warm-started tiny model on ``reverse``.

Rollouts are generated in-test by the model itself (temperature 1, behaviour logprobs recorded),
scored by the task verifier, packed as trainer ``Batch``es and fed to ``Learner.train_step`` —
the same step function the service runs. Seeds are fixed; the assertion is an improvement of the
mean reward of the last steps over the first ones, not convergence.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from trainer_factory import rollout_batch

from services.trainer.learner import Learner
from shared.config import TrainConfig
from shared.modeling import WarmStartOptions, ensure_model, load_model, load_tokenizer
from shared.tasks import get_task

STEPS, PROMPTS, GROUP = 40, 8, 16
WINDOW = 8  # steps averaged at each end


@pytest.mark.slow
def test_grpo_steps_raise_the_reward_on_reverse(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path = tmp_path / "reverse-tiny"
    # A partial skill (≈0.2 sampled reward): RL needs rewards that vary inside a group.
    ensure_model(path, "reverse", seed=0, warm=WarmStartOptions(steps=60, batch_size=32, lr=3e-3, eval_every=1000))
    model, tok = load_model(path), load_tokenizer(path)
    learner = Learner(model, TrainConfig(lr=2e-3, micro_batch_size=64, std_normalize=True), int(tok.pad_token_id))
    rows = get_task("reverse").generate(STEPS * PROMPTS, seed=1235)
    rewards: list[float] = []
    t0 = time.perf_counter()
    for step in range(STEPS):
        batch = rollout_batch(model, tok, "reverse", rows[step * PROMPTS : (step + 1) * PROMPTS], GROUP,
                              seed=100_000 + step, batch_id=f"s{step}", version=str(step))
        metrics = learner.train_step([batch])
        rewards.append(metrics["train/reward_mean"])
        assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-4  # on-policy: same weights, same logprobs
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    print(f"reward first {WINDOW} steps {first:.3f} -> last {WINDOW} steps {last:.3f} "
          f"({time.perf_counter() - t0:.1f}s for {STEPS} steps)")
    assert last > first + 0.05, rewards
