"""Character-level tokenizer in the Hugging Face layout.

Contract: `build_tokenizer()` returns a `PreTrainedTokenizerFast` whose saved directory
`transformers.AutoTokenizer.from_pretrained` loads back unchanged, with:

* one token per character of printable ASCII (32..126) plus ``"\\n"``; any other
  character maps to ``<|unk|>`` (so encoding never fails, but it is lossy for non-ASCII);
* ChatML special tokens ``<|im_start|>`` / ``<|im_end|>``, and ``<|endoftext|>`` as pad;
* ``eos_token == "<|im_end|>"`` so generation stops at the end of an assistant turn;
* a ChatML ``chat_template`` (the same shape Qwen models use), stored in
  ``tokenizer_config.json``, so `apply_chat_template(..., add_generation_prompt=True)` works.

Decoding concatenates characters without separators: ``decode(encode(s)) == s`` for
every string made of the vocabulary's characters.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)

# Every character the model can read or write, in id order after the special tokens.
CHARACTERS: tuple[str, ...] = ("\n", *(chr(c) for c in range(32, 127)))

# ChatML, as in Qwen: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then an
# open assistant turn when a generation prompt is asked for. Tools follow Qwen's Hermes format,
# compacted for a 256-token character model: a system turn listing the tool names in
# <tools>...</tools> (merged into a leading system message), assistant tool calls as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, and tool results as a ChatML ``tool``
# turn (Qwen wraps them in <tool_response> inside a user turn; the short form keeps the result
# close to the answer that copies it). Without tools and tool turns the rendering is plain ChatML.
# As in Qwen3's template, ``enable_thinking=False`` (a chat_template_kwargs variable) writes an empty
# reasoning block after the generation prompt, so the model answers without thinking.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(skip=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n' -}}{%- set ns.skip = 1 -%}"
    "{%- endif -%}"
    "{{- '<tools>' -}}"
    "{%- for tool in tools -%}"
    "{{- (tool['function']['name'] if tool['function'] is defined else tool['name']) -}}"
    "{{- ',' if not loop.last else '' -}}"
    "{%- endfor -%}"
    "{{- '</tools><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.skip:] -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>tool\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{{- fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def vocabulary() -> dict[str, int]:
    """Token -> id: special tokens first (pad is id 0), then the characters."""
    tokens = [*SPECIAL_TOKENS, *CHARACTERS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """A fresh char-level tokenizer; `model_max_length` should match the model's context."""
    core = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK_TOKEN))
    # Split every character into its own pre-token; "[\s\S]" also matches "\n".
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins decoded tokens with no separator (WordLevel would otherwise add spaces).
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Save `tok` so that both current and older `transformers` releases load it.

    `save_pretrained` writes the chat template to ``chat_template.jinja``; we also keep it in
    ``tokenizer_config.json`` (where older releases and serving stacks look for it), and name
    the generic fast-tokenizer class instead of a release-specific backend class.
    """
    out = Path(out_dir)
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["additional_special_tokens"] = [IM_START]
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
