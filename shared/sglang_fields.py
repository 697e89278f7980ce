"""SGLang request fields no part of this system implements, each with the reason (one table).

The engine refuses them on ``/generate`` and the proxy on ``/v1/generate`` with a 400 naming the
field, so docs/engine.md, docs/proxy.md and the refusal messages agree. A field counts as set when
it is not null / false / empty (``is_set``), as SGLang treats an unset field. Also the two names the
other way round: the fields only this project's engine knows (never sent to SGLang) and the
``version`` it answers with, so the proxy can tell it from SGLang.
"""

from __future__ import annotations

from typing import Any

# The ``version`` this project's engine reports in ``/get_server_info`` and ``/v1/loads`` (SGLang reports
# its release, "0.5.12"): how the proxy tells the two apart (shared/sglang_compat.py).
OWN_ENGINE_VERSION = "dressage-engine"

# ``/generate`` fields this project's engine adds to SGLang's: SGLang does not know them, so they are
# sent to this project's engine only.
EXTENSION_FIELDS = frozenset({"continue_across_weight_updates"})

# What SGLang would do with these needs a part this system does not have.
REFUSED: dict[str, str] = {
    "input_embeds": "input embeddings are not supported; send text or input_ids",
    "image_data": "this engine serves text-only models (no image input)",
    "video_data": "this engine serves text-only models (no video input)",
    "audio_data": "this engine serves text-only models (no audio input)",
    "mm_hashes": "no multimodal input on this engine",
    "mm_content_hashes": "no multimodal input on this engine",
    "use_audio_in_video": "no multimodal input on this engine",
    "video_config": "no multimodal input on this engine",
    "modalities": "no multimodal input on this engine",
    "need_wait_for_mm_inputs": "no multimodal input on this engine",
    "num_items_assigned": "no multimodal input on this engine",
    "encoder_urls": "no multimodal input on this engine",
    "max_dynamic_patch": "no multimodal input on this engine",
    "min_dynamic_patch": "no multimodal input on this engine",
    "image_max_dynamic_patch": "no multimodal input on this engine",
    "video_max_dynamic_patch": "no multimodal input on this engine",
    "images_config": "no multimodal input on this engine",
    "lora_path": "LoRA adapters are not supported by this engine",
    "lora_id": "LoRA adapters are not supported by this engine",
    "custom_logit_processor": "custom logit processors are not supported (no code is loaded from requests)",
    "positional_embed_overrides": "embedding overrides are not supported",
    "session_params": "continual-prompting sessions are not supported; send the whole prompt "
                      "(session_id alone is accepted)",
    "bootstrap_host": "prefill/decode disaggregation is not supported",
    "bootstrap_port": "prefill/decode disaggregation is not supported",
    "bootstrap_room": "prefill/decode disaggregation is not supported",
    "bootstrap_pair_key": "prefill/decode disaggregation is not supported",
    "decode_tp_size": "prefill/decode disaggregation is not supported",
    "disagg_prefill_dp_rank": "prefill/decode disaggregation is not supported",
    "http_worker_ipc": "internal SGLang field; not accepted over HTTP",
    "return_hidden_states": "hidden states are not returned by this engine",
    "return_routed_experts": "the served models are dense: there are no routed experts to return",
    "return_indexer_topk": "the served models have no sparse-attention indexer",
    "return_sampling_mask": "sampling masks are not returned by this engine",
    "return_flat_raw_top_logprobs": "flat raw top logprobs are not supported; use top_logprobs_num",
    "return_flat_raw_top_logprobs_b64": "flat raw top logprobs are not supported; use top_logprobs_num",
    "return_entropy": "token entropy is not returned by this engine",
    "return_prompt_token_ids": "not supported; the prompt ids are the input_ids you sent "
                               "(or use return_logprob with logprob_start_len=0)",
    "return_bytes": "byte outputs are for image generation; not supported",
    "background": "background responses are not supported",
    "require_reasoning": "no hybrid-reasoning control on this engine",
    "max_thinking_tokens": "no thinking budget on this engine",
    "priority": "priority scheduling is not enabled on this engine",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
    "sampling_params.json_schema": "constrained decoding (json_schema) is not supported",
    "sampling_params.regex": "constrained decoding (regex) is not supported; stop_regex is",
    "sampling_params.ebnf": "constrained decoding (ebnf) is not supported",
    "sampling_params.structural_tag": "constrained decoding (structural_tag) is not supported",
}


def is_set(v: Any) -> bool:
    return v is not None and v is not False and v != [] and v != {} and v != ""
