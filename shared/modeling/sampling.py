"""Sampling replies from a loaded model with `transformers` `generate`, for evaluation and tests.

Contract: `generate_text` renders `messages` with the chat template, opens an assistant turn,
and returns the reply text (special tokens stripped) and its token ids, stopping at the
tokenizer's stop ids or `max_new_tokens`. Greedy decoding is deterministic; sampling is
reproducible when a `seed` is given. `generate_batch` does the same for many prompts at once
(left padding), which is what evaluation loops should use on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from shared.modeling.loading import chat_input_ids, pad_token_id, stop_token_ids

Messages = Sequence[Mapping[str, Any] | Any]


@dataclass(frozen=True)
class Completion:
    """One sampled reply."""

    text: str  # decoded reply, special tokens removed
    token_ids: list[int]  # reply ids including the stop token when one was produced
    finish_reason: str  # "stop" (a stop id was produced) or "length"


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Messages],
    max_new_tokens: int = 32,
    greedy: bool = True,
    temperature: float = 1.0,
    seed: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[Completion]:
    """Replies to each conversation, decoded together in one left-padded batch (``tools``: the
    tool list the chat template renders, as for a tool-using task; ``template_kwargs``: the template's
    own variables, ``model.chat_template_kwargs``)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature={temperature}: expected > 0 when sampling")
    if not conversations:
        return []
    prompts = [chat_input_ids(tokenizer, c, tools=tools, template_kwargs=template_kwargs) for c in conversations]
    pad_id = pad_token_id(tokenizer)
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    stops = stop_token_ids(tokenizer)
    sampling: dict[str, Any] = (
        {"do_sample": False}
        if greedy
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        out = cast(Any, model).generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=max_new_tokens,
            eos_token_id=stops,
            pad_token_id=pad_id,
            **sampling,
        )
    results: list[Completion] = []
    for row in out[:, width:].tolist():
        reply: list[int] = []
        finish = "length"
        for tid in row:
            reply.append(int(tid))
            if tid in stops:
                finish = "stop"
                break
        text = str(tokenizer.decode(reply, skip_special_tokens=True))
        results.append(Completion(text=text, token_ids=reply, finish_reason=finish))
    return results


def generate_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    max_new_tokens: int = 32,
    greedy: bool = True,
    temperature: float = 1.0,
    seed: int | None = None,
) -> Completion:
    """The reply to one conversation (see `generate_batch`)."""
    return generate_batch(model, tokenizer, [messages], max_new_tokens, greedy, temperature, seed)[0]
