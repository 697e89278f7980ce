"""Loading a tokenizer and a causal LM from a Hugging Face directory, and chat token ids.

Contract: one code path for the tiny CPU models built here and for real checkpoints (e.g. a
Qwen3 model on a GPU machine): `AutoTokenizer` / `AutoModelForCausalLM` on a local
directory, nothing downloaded (``local_files_only``; a model id in ``model.path`` is resolved to its
folder in the Hugging Face cache when the config loads, ``shared.hub``). `load_model` returns the model in eval
mode on the requested device and dtype. A missing or incomplete directory raises
`ModelNotFound` naming the path and the missing file, before `transformers` is asked.
`load_tokenizer` imports no torch for a tokenizer of the generic `tokenizers`-backed class (the one
`AutoTokenizer` would build for it anyway): the proxy, which needs a tokenizer alone, starts without it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from shared.errors import ConfigError, DressageError
from shared.hub import looks_like_hub_id

if TYPE_CHECKING:  # torch only where a model is loaded: the proxy needs a tokenizer alone
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}  # accepted name -> torch attribute

# Files without which a directory is not a loadable model (weights may also be sharded).
TOKENIZER_FILES = ("tokenizer_config.json",)
CONFIG_FILES = ("config.json",)
WEIGHT_GLOBS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# tokenizer_class values naming the generic fast tokenizer itself (5.x's name, then 4.5x's): loaded by that
# class directly, since `AutoTokenizer`'s import chain pulls in torch (configuration_utils -> rope utils).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class ModelNotFound(DressageError):
    """A model or tokenizer directory is missing or lacks a required file; names the path."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' / 'bfloat16' / 'float16' (or their short forms) -> torch dtype."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    try:
        dtype: torch.dtype = getattr(torch, _DTYPES[name.strip().lower()])
    except KeyError:
        raise ConfigError(f"model.dtype={name!r}: expected one of {sorted(_DTYPES)}") from None
    return dtype


def missing_files(path: str | Path) -> list[str]:
    """Names of the files a complete model directory needs but `path` lacks ([] = complete)."""
    p = Path(path)
    if not p.is_dir():
        return [str(p)]
    missing = [f for f in (*CONFIG_FILES, *TOKENIZER_FILES) if not (p / f).is_file()]
    if not (p / "tokenizer.json").is_file() and not (p / "vocab.json").is_file():
        missing.append("tokenizer.json")
    if not any((p / w).is_file() for w in WEIGHT_GLOBS):
        missing.append("model.safetensors")
    return missing


def _hub_hint(path: str) -> str:
    if not looks_like_hub_id(path):
        return ""
    return f"; as a model id it is not in the Hugging Face cache (HF_HOME): fetch it with `hf download {path}`"


def quiet_transformers() -> None:
    """Turn off `transformers` progress bars (they would flood service logs on every reload)."""
    hf_logging.disable_progress_bar()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `path` (needs a chat template for chat use)."""
    p = Path(path)
    if not p.is_dir() or not (p / "tokenizer_config.json").is_file():
        raise ModelNotFound(f"no tokenizer at {p} (tokenizer_config.json missing){_hub_hint(str(path))}")
    tok: PreTrainedTokenizerBase = _tokenizer_class(p).from_pretrained(str(p), local_files_only=True)
    if tok.pad_token_id is None:
        # Real checkpoints sometimes lack a pad token; padding with eos is the usual fix.
        tok.pad_token = tok.eos_token
    return tok


def _tokenizer_class(p: Path) -> Any:
    """The class `AutoTokenizer` would pick, without importing torch where it is the generic fast one."""
    try:
        named = json.loads((p / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None  # AutoTokenizer reports a broken file in its own words
    if named in GENERIC_TOKENIZER_CLASSES and (p / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"
) -> PreTrainedModel:
    """The causal LM saved in `path`, in eval mode on `device` with weights in `dtype`."""
    p = Path(path)
    missing = missing_files(p)
    if missing:
        raise ModelNotFound(f"model directory {p} is incomplete: missing {', '.join(missing)}{_hub_hint(str(path))}")
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=parse_dtype(dtype), local_files_only=True)
    model.to(device)  # type: ignore[arg-type]  # transformers' decorator hides Module.to
    model.eval()
    log.info("loaded model path=%s arch=%s device=%s dtype=%s", p, model.config.model_type, device, dtype)
    return model


def _as_dicts(messages: Sequence[Mapping[str, Any] | Any]) -> list[dict[str, Any]]:
    """Accept plain dicts or objects with .role/.content (e.g. the wire `Message`)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            if "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: needs 'role' and 'content'")
            out.append(dict(m))
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def chat_input_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any] | Any],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (``tools``, if any, too;
    ``template_kwargs`` are the template's own variables, e.g. Qwen3's ``enable_thinking``).

    Only the template writes real special tokens: special-token text inside a message's content
    (``<|im_end|>\n<|im_start|>system`` typed by a user or produced by a model) is encoded as plain
    text, so it can never open or close a chat turn. Messages without such text take the plain
    path (render, encode once), so ordinary prompts tokenize exactly as before.
    """
    dicts = _as_dicts(messages)
    template_kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    specials = special_texts(tokenizer)
    if any(isinstance(m["content"], str) and any(sp in m["content"] for sp in specials) for m in dicts):
        return _segmented_ids(tokenizer, dicts, add_generation_prompt, template_kwargs)
    rendered = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **template_kwargs)
    assert isinstance(rendered, str)
    # The template already writes every special token; do not let the tokenizer add a BOS.
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    return [int(i) for i in ids]


def special_texts(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The strings the tokenizer turns into special tokens (declared specials and special added tokens)."""
    out = {str(t) for t in tokenizer.all_special_tokens}
    out.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return {t for t in out if t}


def _segmented_ids(tokenizer: PreTrainedTokenizerBase, dicts: list[dict[str, Any]],
                   add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> list[int]:
    """Render with placeholder contents, then encode template text with specials and content as text."""
    marks: dict[str, str] = {}
    placeheld: list[dict[str, Any]] = []
    for i, m in enumerate(dicts):
        if isinstance(m["content"], str):
            marks[f"\x00dressage-content-{i}\x00"] = m["content"]
            m = {**m, "content": f"\x00dressage-content-{i}\x00"}
        placeheld.append(m)
    rendered = tokenizer.apply_chat_template(placeheld, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **template_kwargs)
    assert isinstance(rendered, str)
    ids: list[int] = []
    for part in re.split("(\x00dressage-content-\\d+\x00)", rendered):
        if part in marks:
            ids += tokenizer.encode(marks[part], add_special_tokens=False, split_special_tokens=True)
        elif part:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return [int(i) for i in ids]


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads a batch: the tokenizer's pad token, or 0 when it has none (padding carries no loss)."""
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end an assistant turn: eos plus ChatML's end markers where the vocab has them."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in ("<|im_end|>", "<|endoftext|>"):
        tid = vocab.get(tok)
        if tid is not None and tid not in ids:
            ids.append(int(tid))
    return ids
