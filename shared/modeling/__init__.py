"""Tiny Hugging Face models and the one loading path shared by engine, proxy, trainer and eval.

* `load_tokenizer`, `load_model`, `chat_input_ids`, `stop_token_ids`: load any local HF
  directory (the tiny CPU models built here, or a real checkpoint such as Qwen3 on a GPU).
* `build_tokenizer`, `ModelSpec`, `build_model_dir`, `ensure_model`, `warm_start`: create a
  char-level model for a task, optionally warm-started to a partial skill RL can improve.
* `generate_text`, `generate_batch`, `evaluate`: sampling and task-level evaluation helpers.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use (PEP 562): the proxy needs the tokenizer path alone and should not pay for
# torch and the model classes at start.
_HOME = {
    "BuildReport": "shared.modeling.build",
    "CHAT_TEMPLATE": "shared.modeling.tokenizer",
    "Completion": "shared.modeling.sampling",
    "EvalResult": "shared.modeling.warmstart",
    "ModelDirExists": "shared.modeling.build",
    "ModelNotFound": "shared.modeling.loading",
    "ModelSpec": "shared.modeling.architecture",
    "WarmStartOptions": "shared.modeling.build",
    "build_model": "shared.modeling.architecture",
    "build_model_dir": "shared.modeling.build",
    "build_tokenizer": "shared.modeling.tokenizer",
    "chat_input_ids": "shared.modeling.loading",
    "count_parameters": "shared.modeling.architecture",
    "ensure_model": "shared.modeling.build",
    "evaluate": "shared.modeling.warmstart",
    "generate_batch": "shared.modeling.sampling",
    "generate_text": "shared.modeling.sampling",
    "load_model": "shared.modeling.loading",
    "load_tokenizer": "shared.modeling.loading",
    "missing_files": "shared.modeling.loading",
    "pad_token_id": "shared.modeling.loading",
    "parse_dtype": "shared.modeling.loading",
    "read_build_info": "shared.modeling.build",
    "save_tokenizer": "shared.modeling.tokenizer",
    "stop_token_ids": "shared.modeling.loading",
    "warm_start": "shared.modeling.build",
}

if TYPE_CHECKING:
    from shared.modeling.architecture import ModelSpec, build_model, count_parameters
    from shared.modeling.build import (
        BuildReport,
        ModelDirExists,
        WarmStartOptions,
        build_model_dir,
        ensure_model,
        read_build_info,
        warm_start,
    )
    from shared.modeling.loading import (
        ModelNotFound,
        chat_input_ids,
        load_model,
        load_tokenizer,
        missing_files,
        pad_token_id,
        parse_dtype,
        stop_token_ids,
    )
    from shared.modeling.sampling import Completion, generate_batch, generate_text
    from shared.modeling.tokenizer import CHAT_TEMPLATE, build_tokenizer, save_tokenizer
    from shared.modeling.warmstart import EvalResult, evaluate


def __getattr__(name: str) -> Any:
    try:
        module = _HOME[name]
    except KeyError:
        raise AttributeError(f"module 'shared.modeling' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CHAT_TEMPLATE",
    "BuildReport",
    "Completion",
    "EvalResult",
    "ModelDirExists",
    "ModelNotFound",
    "ModelSpec",
    "WarmStartOptions",
    "build_model",
    "build_model_dir",
    "build_tokenizer",
    "chat_input_ids",
    "count_parameters",
    "ensure_model",
    "evaluate",
    "generate_batch",
    "generate_text",
    "load_model",
    "load_tokenizer",
    "missing_files",
    "pad_token_id",
    "parse_dtype",
    "read_build_info",
    "save_tokenizer",
    "stop_token_ids",
    "warm_start",
]
