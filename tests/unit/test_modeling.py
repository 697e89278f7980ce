"""Tokenizer, chat template, model layout and loading helpers of shared.modeling (no Redis)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.errors import ConfigError
from shared.modeling import (
    CHAT_TEMPLATE,
    ModelNotFound,
    ModelSpec,
    build_model,
    build_tokenizer,
    chat_input_ids,
    generate_batch,
    generate_text,
    load_model,
    load_tokenizer,
    missing_files,
    parse_dtype,
    save_tokenizer,
    stop_token_ids,
)

torch.set_num_threads(1)

TINY = ModelSpec(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer()
    model = build_model(TINY, len(tok), tok.pad_token_id, tok.eos_token_id, seed=3)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out)
    return out


def test_tokenizer_round_trips_every_printable_character_and_newline() -> None:
    tok = build_tokenizer()
    text = "".join(chr(c) for c in range(32, 127)) + "\nreverse 0123\n  x"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text


def test_tokenizer_maps_unknown_characters_to_unk_instead_of_failing() -> None:
    tok = build_tokenizer()
    ids = tok.encode("aéb", add_special_tokens=False)
    assert ids[1] == tok.unk_token_id and len(ids) == 3


def test_special_tokens_are_single_ids_and_eos_is_im_end() -> None:
    tok = build_tokenizer()
    ids = tok.encode("<|im_start|>user\n1<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id


def test_auto_tokenizer_loads_saved_directory_with_chat_template(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.decode(tok.encode("reverse 123", add_special_tokens=False)) == "reverse 123"
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE  # where older releases look for it
    messages = [{"role": "user", "content": "reverse 123"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nreverse 123<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == tok.encode(text, add_special_tokens=False)


def test_chat_input_ids_match_template_and_generation_prompt_is_optional(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}]
    closed = chat_input_ids(tok, messages, add_generation_prompt=False)
    opened = chat_input_ids(tok, messages, add_generation_prompt=True)
    assert tok.decode(closed) == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n"
    assert opened[: len(closed)] == closed
    assert tok.decode(opened[len(closed) :]) == "<|im_start|>assistant\n"
    assert closed.count(tok.eos_token_id) == 2


def test_chat_input_ids_accepts_message_objects_and_rejects_bad_dicts(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)

    class Msg:
        role = "user"
        content = "hi"

    assert chat_input_ids(tok, [Msg()]) == chat_input_ids(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        chat_input_ids(tok, [{"role": "user"}])


def test_stop_token_ids_start_with_eos(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    stops = stop_token_ids(tok)
    assert stops[0] == tok.eos_token_id
    assert tok.convert_tokens_to_ids("<|endoftext|>") in stops


def test_model_saves_as_safetensors_qwen3_and_reloads_identically(model_dir: Path) -> None:
    assert (model_dir / "model.safetensors").is_file()
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    a = AutoModelForCausalLM.from_pretrained(str(model_dir))
    b = load_model(model_dir, dtype="float32")
    assert not b.training
    x = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(a(x).logits, b(x).logits)


def test_load_model_casts_to_requested_dtype(model_dir: Path) -> None:
    model = load_model(model_dir, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_same_seed_same_weights_and_other_archs_build() -> None:
    tok = build_tokenizer()
    a = build_model(TINY, len(tok), 0, 2, seed=1)
    b = build_model(TINY, len(tok), 0, 2, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    for arch in ("llama", "qwen2"):
        m = build_model(ModelSpec(**{**TINY.as_dict(), "arch": arch}), len(tok), 0, 2)
        assert m.config.model_type == arch


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("hidden_size", 30, "hidden_size"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("num_hidden_layers", 0, "num_hidden_layers"),
        ("arch", "gpt9", "arch"),
    ],
)
def test_model_spec_rejects_bad_sizes_naming_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelSpec(**{**TINY.as_dict(), field: value}).validate()


def test_parse_dtype_names_the_key_on_bad_values() -> None:
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ConfigError, match="model.dtype"):
        parse_dtype("float8")


def test_loading_an_incomplete_directory_names_what_is_missing(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ModelNotFound, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    assert "model.safetensors" in missing_files(tmp_path)
    with pytest.raises(ModelNotFound, match="model.safetensors"):
        load_model(tmp_path)


def test_generate_text_greedy_is_deterministic_and_stops_or_hits_length(model_dir: Path) -> None:
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    messages = [{"role": "user", "content": "reverse 123"}]
    a = generate_text(model, tok, messages, max_new_tokens=6)
    b = generate_text(model, tok, messages, max_new_tokens=6)
    assert a == b
    assert 1 <= len(a.token_ids) <= 6
    assert (a.finish_reason == "stop") == (a.token_ids[-1] in stop_token_ids(tok))


def test_generate_batch_pads_left_so_each_reply_matches_its_single_run(model_dir: Path) -> None:
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    convs = [[{"role": "user", "content": "reverse 12"}], [{"role": "user", "content": "reverse 123456"}]]
    batched = generate_batch(model, tok, convs, max_new_tokens=5)
    single = [generate_text(model, tok, c, max_new_tokens=5) for c in convs]
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]


def test_sampling_is_reproducible_with_a_seed(model_dir: Path) -> None:
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    messages = [{"role": "user", "content": "reverse 123"}]
    a = generate_text(model, tok, messages, max_new_tokens=8, greedy=False, seed=11)
    b = generate_text(model, tok, messages, max_new_tokens=8, greedy=False, seed=11)
    assert a == b


def test_load_tokenizer_builds_what_auto_tokenizer_builds_without_importing_torch(model_dir: Path) -> None:
    """The generic fast class is loaded directly (AutoTokenizer's imports pull in torch): same class, same ids,
    same chat text; a fresh interpreter that loads it and imports the proxy has no torch."""
    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(ours) is type(auto)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse 9081 <|im_end|>"}]
    assert chat_input_ids(ours, messages) == chat_input_ids(auto, messages)
    assert ours.encode("x\n<|endoftext|>y") == auto.encode("x\n<|endoftext|>y")
    assert (ours.pad_token_id, ours.eos_token_id) == (auto.pad_token_id, auto.eos_token_id)
    probe = ("import sys; from shared.modeling.loading import load_tokenizer; import services.proxy.main; "
             f"load_tokenizer({str(model_dir)!r}); print(sorted(m for m in ('torch', 'safetensors.torch') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_model_specific_tokenizer_class_still_goes_through_auto_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"  # a real checkpoint's class: AutoTokenizer resolves it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert type(tok).__name__ == type(AutoTokenizer.from_pretrained(str(tmp_path))).__name__ == "Qwen2Tokenizer"
