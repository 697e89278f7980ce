"""Model directories every supported `transformers` reads: the one installed and the 4.5x line SGLang pins.

Contract: after `make_loadable(out)` on a directory written by ``save_pretrained`` (every
writer here calls it: ``init-model``, the trainer's checkpoints), ``AutoConfig`` / ``AutoTokenizer`` / ``AutoModelForCausalLM``
of transformers 4.57 (pinned by ``sglang[srt]`` 0.5.x) load ``out`` to the same model and the
same tokenizer as the installed release does. transformers 5 writes three things 4.5x misreads:

* ``tokenizer_config.json``: ``tokenizer_class: "TokenizersBackend"`` (no such class in 4.5x)
  -> ``PreTrainedTokenizerFast``; ``extra_special_tokens`` as a *list* (4.5x wants a dict of
  named tokens and fails with ``'list' object has no attribute 'keys'``) -> folded into
  ``additional_special_tokens``, which both releases read;
* ``config.json``: ``rope_parameters`` only (4.5x reads ``rope_theta`` / ``rope_scaling`` and
  would silently fall back to its default theta) -> both spellings written; ``dtype`` ->
  also ``torch_dtype``.

Only keys are added or renamed; the installed release reads the result unchanged (tested).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _rewrite(path: Path, fix: Any) -> None:
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    fixed = fix(dict(data))
    if fixed != data:
        path.write_text(json.dumps(fixed, indent=2, ensure_ascii=False) + "\n")


def tokenizer_config_compat(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, list):
        merged = list(cfg.get("additional_special_tokens") or [])
        merged += [t for t in extra if t not in merged]
        cfg["additional_special_tokens"] = merged
        del cfg["extra_special_tokens"]
    return cfg


def model_config_compat(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
        kind = rope.get("rope_type", rope.get("type", "default"))
        extra = {k: v for k, v in rope.items() if k != "rope_theta"}
        cfg.setdefault("rope_scaling", None if kind == "default" else extra)
    if "dtype" in cfg and "torch_dtype" not in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    return cfg


def make_loadable(out_dir: str | Path) -> None:
    """Rewrite `out_dir`'s config and tokenizer config so transformers 4.5x reads them too."""
    out = Path(out_dir)
    _rewrite(out / "tokenizer_config.json", tokenizer_config_compat)
    _rewrite(out / "config.json", model_config_compat)
