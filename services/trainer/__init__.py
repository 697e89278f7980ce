"""trainer: GRPO on a Hugging Face causal LM, consuming ``{p}:batches`` and publishing weight versions."""
