"""Factories for trainer tests: tiny models, batches of GRPO groups, configs.

``batch("b1", n_groups=2, version="3")`` is a trainer ``Batch`` whose samples are valid for the
char-level tokenizer (ids inside its vocabulary); rewards differ inside a group so every group
has non-zero advantages.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from shared.codec import encode_entry
from shared.config import DressageConfig, load_config
from shared.modeling import ModelSpec, build_model_dir
from shared.schemas import Batch, RolloutGroup, Sample, Window
from shared.staleness import sample_version_fields

VOCAB = 100  # the char-level tokenizer has ~101 ids; stay inside
SMALL_SPEC = ModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=64)


def tiny_model(path: Path, spec: ModelSpec = SMALL_SPEC, seed: int = 0) -> Path:
    """A randomly initialised tiny model directory (HF layout) at ``path``."""
    build_model_dir(path, "reverse", spec=spec, seed=seed)
    return path


def sample(traj_id: str, rng: random.Random, version: str = "0", reward: float = 0.0, n_prompt: int = 5,
           n_response: int = 4, segment_index: int = 0) -> Sample:
    ids = [rng.randrange(4, VOCAB) for _ in range(n_prompt + n_response)]
    mask = [0] * n_prompt + [1] * n_response
    versions = ["-1"] * n_prompt + [version] * n_response
    logprobs = [0.0] * n_prompt + [round(-rng.uniform(0.5, 4.0), 3) for _ in range(n_response)]
    return Sample(traj_id=traj_id, segment_index=segment_index, token_ids=ids, loss_mask=mask, logprobs=logprobs,
                  token_versions=versions, reward=reward, **sample_version_fields(mask, versions))


def group(group_id: str, rng: random.Random, n_samples: int = 4, version: str = "0") -> RolloutGroup:
    samples = [sample(f"{group_id}-t{i}", rng, version, reward=float(i % 2)) for i in range(n_samples)]
    return RolloutGroup(group_id=group_id, prompt_id=f"p-{group_id}", attempt=0, status="completed",
                        samples=samples)


def batch(batch_id: str, n_groups: int = 2, version: str = "0", seed: int = 0) -> Batch:
    rng = random.Random(f"{batch_id}:{seed}")
    groups = [group(f"{batch_id}-g{i}", rng, version=version) for i in range(n_groups)]
    return Batch(batch_id=batch_id, groups=groups, trainer_version=version,
                 window=Window(keep_versions=0, current_version=version))


def changed_fraction(cfg: Any, steps: int = 10, device: str = "cpu", seed: int = 0) -> float:
    """Share of the tiny model's trained weights (the optimizer's own copy: the fp32 master, or the bf16
    weights under ``bf16-pure``) that ``steps`` real learner steps under the ``TrainConfig`` ``cfg`` moved.
    The model is handed to the learner in bf16, as GPU checkpoints are."""
    import torch

    from services.trainer.learner import Learner
    from shared.modeling import build_model

    model = build_model(SMALL_SPEC, VOCAB, 0, 2, seed=seed)
    torch.nn.Module.to(model, device=device, dtype=torch.bfloat16)  # transformers' decorator hides Module.to's type
    learner = Learner(model, cfg, pad_id=0)
    before = [p.detach().clone() for p in learner.model.parameters()]
    for step in range(steps):
        learner.train_step([batch(f"b{step}", n_groups=4, seed=seed)])
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(learner.model.parameters(), before, strict=True))
    return moved / sum(b.numel() for b in before)


def batch_fields(batch_id: str, **kw: Any) -> dict[str, bytes]:
    return encode_entry(batch(batch_id, **kw))


def trainer_config(tmp: Path, model_dir: Path, redis_url: str, prefix: str, **train: Any) -> DressageConfig:
    """Defaults for a fast CPU trainer in tests; ``train`` overrides ``train.*``."""
    return load_config(None, env={}, overrides={
        "redis": {"url": redis_url, "prefix": prefix},
        "model": {"path": str(model_dir)},
        "train": {"checkpoint_dir": str(tmp / "ckpt"), "keep_checkpoints": 100, "micro_batch_size": 8,
                  "lr": 1e-3, "block_ms": 50, **train},
    })


def write_config_yaml(path: Path, cfg: DressageConfig) -> Path:
    """The config as YAML for a trainer subprocess (``--config``)."""
    import yaml

    data = {"redis": {"url": cfg.redis.url, "prefix": cfg.redis.prefix},
            "model": {"path": cfg.model.path},
            "train": cfg.train.model_dump(mode="json"),
            "eval": cfg.eval.model_dump(mode="json")}
    path.write_text(yaml.safe_dump(data))
    return path


def rollout_batch(model: Any, tok: Any, task_name: str, rows: list[dict[str, Any]], n_samples: int, seed: int,
                  batch_id: str, version: str = "0") -> Batch:
    """Roll ``rows`` out with the model itself (temperature 1), score them with the task verifier and
    record each reply token's behaviour logprob, as the proxy would: one GRPO group per row."""
    import torch

    from services.trainer.batching import TrainRow, collate
    from services.trainer.loss import token_logprobs
    from shared.modeling import chat_input_ids, generate_batch
    from shared.tasks import get_task

    task = get_task(task_name)
    convs = [[{"role": "user", "content": r["prompt"]}] for r in rows for _ in range(n_samples)]
    model.eval()
    replies = generate_batch(model, tok, convs, max_new_tokens=task.max_new_tokens, greedy=False,
                             temperature=1.0, seed=seed)
    seqs = [(chat_input_ids(tok, c), reply) for c, reply in zip(convs, replies, strict=True)]
    padded = collate([TrainRow(p + r.token_ids, [0] * (len(p) + len(r.token_ids)), [0.0] * (len(p) + len(r.token_ids)),
                               0.0) for p, r in seqs], int(tok.pad_token_id))
    with torch.no_grad():
        logp = token_logprobs(model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits,
                              padded.input_ids)
    groups = []
    for g, row in enumerate(rows):
        samples = []
        for j in range(n_samples):
            k = g * n_samples + j
            prompt, reply = seqs[k]
            episode = task.start(row["prompt"], row["reference"])
            episode.step(reply.text)
            mask = [0] * len(prompt) + [1] * len(reply.token_ids)
            versions = ["-1"] * len(prompt) + [version] * len(reply.token_ids)
            lps = [float(x) if m else 0.0 for x, m in zip(logp[k, : len(mask)].tolist(), mask, strict=True)]
            samples.append(Sample(traj_id=f"{batch_id}-{g}-{j}", token_ids=prompt + reply.token_ids, loss_mask=mask,
                                  logprobs=lps, token_versions=versions, reward=episode.reward(),
                                  finish_reason=reply.finish_reason, **sample_version_fields(mask, versions)))
        groups.append(RolloutGroup(group_id=f"{batch_id}-{g}", prompt_id=row["prompt_id"], attempt=0,
                                   status="completed", samples=samples))
    return Batch(batch_id=batch_id, groups=groups, trainer_version=version, window=Window(keep_versions=0))
