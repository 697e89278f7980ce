"""prompt-buffer: emits paced prompt groups from a JSONL dataset into ``{p}:prompts``."""
