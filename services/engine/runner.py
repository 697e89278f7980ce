"""Forward passes of a Hugging Face causal LM over a left-padded batch, and in-place weight loads.

Contract: `prefill` runs the prompts of joining requests (left-padded together) and returns a
`PaddedKV` for them plus the next-token logits of each row; `decode` feeds one token per row of
a `PaddedKV` and returns the next-token logits. Both run under ``torch.inference_mode`` and are
called only from the scheduler thread. `load_state` copies a validated state dict into the
live parameters; the scheduler calls it only between two forward passes, so no token is ever
computed with a mix of old and new weights.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from services.engine.kv import PaddedKV


@dataclass
class PrefillOut:
    kv: PaddedKV  # the joiners' cache, rows in input order
    last_logits: torch.Tensor  # [b, V] logits after each row's last prompt token
    logprobs: list[list[float]] | None  # per row, logprob of prompt token j (j >= 1) when asked
    dists: dict[int, torch.Tensor] | None = None  # row -> [n - 1, V] log-softmax (top logprobs), when asked


class ModelRunner:
    """Owns the model; every method must be called from one thread (the scheduler's)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int = 0) -> None:
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.context_len = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        # transformers >= 5 calls the cache argument `cache`; older releases `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                 cache: DynamicCache, keep: int) -> torch.Tensor:
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device),
            use_cache=True,
            logits_to_keep=keep,
            **{self._cache_kw: cache},
        )
        logits: torch.Tensor = out.logits
        return logits

    def prefill(self, prompts: Sequence[Sequence[int]], logprob_rows: Sequence[int] = (),
                dist_rows: Sequence[int] = ()) -> PrefillOut:
        """Run `prompts` together; prompt logprobs are computed for the rows in `logprob_rows`,
        whole prompt distributions kept for the rows in `dist_rows` (a subset of it)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[row, width - len(p):] = 1
        # Positions count real tokens only, so a padded row sees the same positions as alone.
        pos = (mask.cumsum(dim=1) - 1).clamp_(min=0)
        cache = DynamicCache()
        with torch.inference_mode():
            logits = self._forward(ids, mask, pos, cache, keep=0 if logprob_rows else 1)
            last = logits[:, -1, :].float()
            logprobs: list[list[float]] | None = None
            dists: dict[int, torch.Tensor] = {}
            if logprob_rows:
                logprobs = [[] for _ in prompts]
                for row in logprob_rows:
                    n = len(prompts[row])
                    lp = torch.log_softmax(logits[row, width - n:-1, :].float(), dim=-1)
                    tok = ids[row, width - n + 1:].to(lp.device)
                    logprobs[row] = lp.gather(1, tok[:, None]).squeeze(1).tolist()
                    if row in dist_rows:
                        dists[row] = lp.cpu()
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return PrefillOut(PaddedKV(cache, mask, lengths), last.cpu(), logprobs, dists or None)

    def decode(self, kv: PaddedKV, tokens: torch.Tensor) -> torch.Tensor:
        """Feed `tokens` [B] (one per row) and return next-token logits [B, V] (float32, cpu)."""
        mask, pos = kv.decode_inputs()
        with torch.inference_mode():
            logits = self._forward(tokens.unsqueeze(1), mask, pos, kv.cache, keep=1)
        kv.advance()
        return logits[:, -1, :].float().cpu()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy `state` (validated by `weights.check_state`) into the live parameters."""
        live = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in state.items():
                live[name].copy_(tensor)
