"""A published checkpoint loads with the oldest transformers the project declares (SGLang 0.5's 4.5x pin).

`init-model` output and a trainer checkpoint are loaded in a child process whose `transformers`
(+ its `tokenizers`, `huggingface_hub`) is the declared lower bound from pyproject.toml,
installed with ``pip install --target`` into a cache directory (nothing touches the venv).
Config, tokenizer (encode, decode, special tokens, chat template) and the model's logits must
equal what the installed release gives. Skips, saying why, when the wheel cannot be fetched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from paths import REPO

from shared.modeling import ModelSpec, build_model_dir, load_model, load_tokenizer
from shared.modeling.compat import make_loadable

pytestmark = pytest.mark.slow
CACHE = Path(os.environ.get("DRESSAGE_COMPAT_CACHE", Path.home() / ".cache" / "dressage-compat"))
TEXT = "Hello, world!\nabc"
MESSAGES = [{"role": "user", "content": "reverse: abc"}]
IDS = [5, 40, 41, 42, 7, 9]

CHILD = """
import json, sys
import torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
path, text, messages, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
cfg = AutoConfig.from_pretrained(path)
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path).eval()
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].tolist()
print(json.dumps({
    "version": transformers.__version__,
    "rope_theta": getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta"),
    "encode": tok.encode(text), "decode": tok.decode(tok.encode(text)),
    "eos": tok.eos_token, "pad": tok.pad_token, "specials": sorted(tok.all_special_tokens),
    "chat": tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
    "logits": logits,
}))
"""


def declared_floor() -> str:
    m = re.search(r'"transformers>=([0-9.]+)', (REPO / "pyproject.toml").read_text())
    assert m, "pyproject.toml declares no transformers lower bound"
    return m.group(1)


def old_transformers() -> Path:
    """A --target directory holding the declared-floor transformers (installed once, then cached)."""
    floor = declared_floor()
    target = CACHE / f"transformers-{floor}"
    if (target / "transformers").is_dir():
        return target
    major, minor = (int(x) for x in floor.split(".")[:2])
    tokenizers = "tokenizers>=0.22,<0.23" if (major, minor) >= (4, 56) else "tokenizers>=0.21,<0.22"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
           f"transformers=={floor}.*" if floor.count(".") == 1 else f"transformers=={floor}", tokenizers,
           "huggingface_hub>=0.34,<1.0", "requests", "urllib3", "idna", "charset-normalizer", "certifi"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip could not fetch transformers {floor} within 600 s")
    if done.returncode != 0:
        pytest.skip(f"transformers {floor} wheel unavailable (pip: {done.stderr.strip()[-300:]})")
    return target


def load_with(target: Path, path: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(target), "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), TEXT, json.dumps(MESSAGES), json.dumps(IDS)],
                          capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def load_here(path: Path) -> dict[str, Any]:
    tok, model = load_tokenizer(path), load_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0].tolist()
    return {"encode": tok.encode(TEXT), "decode": tok.decode(tok.encode(TEXT)), "eos": tok.eos_token,
            "pad": tok.pad_token, "specials": sorted(tok.all_special_tokens),
            "chat": tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
            "logits": logits}


def assert_same(old: dict[str, Any], new: dict[str, Any]) -> None:
    for key in ("encode", "decode", "eos", "pad", "specials", "chat"):
        assert old[key] == new[key], key
    diff = (torch.tensor(old["logits"]) - torch.tensor(new["logits"])).abs().max().item()
    assert diff < 1e-4, f"logits differ by {diff}"


@pytest.fixture(scope="module")
def target() -> Path:
    return old_transformers()


def test_init_model_output_loads_with_the_declared_oldest_transformers(tmp_path: Path, target: Path) -> None:
    out = tmp_path / "model"
    build_model_dir(out, "reverse", ModelSpec(rope_theta=50000.0), seed=3)  # non-default theta must survive
    old = load_with(target, out)
    assert old["version"].startswith(declared_floor())
    assert old["rope_theta"] == 50000.0
    assert_same(old, load_here(out))


def test_a_trainer_style_checkpoint_loads_with_the_declared_oldest_transformers(tmp_path: Path,
                                                                               target: Path) -> None:
    src = tmp_path / "model"
    build_model_dir(src, "reverse", ModelSpec(), seed=4)
    tok, model = load_tokenizer(src), load_model(src)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt, safe_serialization=True)  # what the trainer's checkpoint writer does
    tok.save_pretrained(ckpt)
    make_loadable(ckpt)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert not isinstance(cfg.get("extra_special_tokens"), list)
    assert_same(load_with(target, ckpt), load_here(ckpt))
