"""Tiny Hugging Face models and the one loading path shared by engine, proxy, trainer and eval.

* `load_tokenizer`, `load_model`, `chat_input_ids`, `stop_token_ids`: load any local HF
  directory (the tiny CPU models built here, or a real checkpoint such as Qwen3 on a GPU).
* `build_tokenizer`, `ModelSpec`, `build_model_dir`, `ensure_model`, `warm_start`: create a
  char-level model for a task, optionally warm-started to a partial skill RL can improve.
* `generate_text`, `generate_batch`, `evaluate`: sampling and task-level evaluation helpers.
"""

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
    parse_dtype,
    stop_token_ids,
)
from shared.modeling.sampling import Completion, generate_batch, generate_text
from shared.modeling.tokenizer import CHAT_TEMPLATE, build_tokenizer, save_tokenizer
from shared.modeling.warmstart import EvalResult, evaluate

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
    "parse_dtype",
    "read_build_info",
    "save_tokenizer",
    "stop_token_ids",
    "warm_start",
]
