"""``dressage proxy``: OpenAI-compatible LLM proxy with partial rollout and version-span control."""
