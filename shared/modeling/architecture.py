"""Tiny causal LMs built from an architecture that `transformers` ships.

Contract: `build_model(spec, vocab_size, ...)` returns a randomly initialised
`Qwen3ForCausalLM` (or `LlamaForCausalLM` / `Qwen2ForCausalLM` when `spec.arch` says so), so
the code that loads a tiny CPU model here is the same `AutoModelForCausalLM` path that loads a
real Qwen3 checkpoint on a GPU machine. Initialisation is a pure function of `seed`.

The default sizes fit two shared CPU cores: ~0.2 M parameters, a forward pass of a batch of 32
short sequences in milliseconds. Every size is a field of `ModelSpec`, validated up front.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from shared.errors import ConfigError

# name -> (config class, model class); typed loosely because each config takes its own kwargs.
_ARCHS: dict[str, tuple[Any, Any]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a tiny model. All counts are positive; `hidden_size` splits into heads."""

    arch: str = "qwen3"  # one of _ARCHS
    hidden_size: int = 96  # residual width
    intermediate_size: int = 256  # MLP width
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention, as in Qwen3; divides the heads
    max_position_embeddings: int = 256  # context length in tokens (prompt + reply)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True  # as in small Qwen3 checkpoints; halves embedding params

    def validate(self) -> None:
        """Raise ConfigError naming the first field that is out of range."""
        if self.arch not in _ARCHS:
            raise ConfigError(f"model.arch={self.arch!r}: expected one of {sorted(_ARCHS)}")
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name}={value!r}: expected an integer >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size}: must be divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_config(spec: ModelSpec, vocab_size: int, pad_token_id: int, eos_token_id: int) -> PretrainedConfig:
    """The `transformers` config for `spec` (float32 weights, KV cache on)."""
    spec.validate()
    config_cls, _ = _ARCHS[spec.arch]
    config: PretrainedConfig = config_cls(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        use_cache=True,
        dtype="float32",
    )
    return config


def build_model(
    spec: ModelSpec, vocab_size: int, pad_token_id: int, eos_token_id: int, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised causal LM for `spec`; same `seed` -> same weights."""
    config = build_config(spec, vocab_size, pad_token_id, eos_token_id)
    _, model_cls = _ARCHS[spec.arch]
    # Seed a private generator's worth of state: fork_rng keeps the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = model_cls(config)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.bos_token_id = None
    model.eval()
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct trainable parameters (tied tensors counted once)."""
    return sum(p.numel() for p in model.parameters())
