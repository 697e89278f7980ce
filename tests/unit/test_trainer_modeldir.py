"""A version's model directory written at the cost of its weights: the same files as a full save."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from trainer_factory import SMALL_SPEC, VOCAB

from services.trainer.modeldir import WEIGHTS_FILE, ModelDirWriter
from shared.modeling import build_model, build_tokenizer, load_model
from shared.modeling.compat import make_loadable

torch.set_num_threads(1)


@pytest.fixture()
def model_and_tok():
    return build_model(SMALL_SPEC, VOCAB, 0, 2, seed=1), build_tokenizer(64)


def full_save(model, tok, out: Path, weights) -> Path:
    out.mkdir()
    copy = None if weights is None else dict(weights)  # transformers drops tied names from the dict it gets
    model.save_pretrained(out, safe_serialization=True, state_dict=copy)
    tok.save_pretrained(out)
    make_loadable(out)
    return out


def fill(writer: ModelDirWriter, out: Path, weights) -> Path:
    out.mkdir()
    writer.write(out, weights)
    writer.finished(out)
    return out


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    """New weights, tied tensors still one tensor (as the trainer's own state dict has them)."""
    g = torch.Generator().manual_seed(seed)
    new: dict[int, torch.Tensor] = {}
    return {k: new.setdefault(v.data_ptr(), v + 0.01 * torch.randn(v.shape, generator=g))
            for k, v in model.state_dict().items()}


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_later_versions_are_the_files_a_full_save_writes(tmp_path: Path, model_and_tok) -> None:
    model, tok = model_and_tok
    writer = ModelDirWriter(model, tok)
    fill(writer, tmp_path / "v1", None)
    for version in (2, 3):
        weights = perturbed(model, version)
        fast = fill(writer, tmp_path / f"v{version}", weights)
        reference = full_save(model, tok, tmp_path / f"ref{version}", weights)
        assert files(fast) == files(reference)  # every file, the weights byte for byte
        loaded = load_model(fast).state_dict()
        assert all(torch.equal(loaded[k], weights[k]) for k in loaded)
    assert files(tmp_path / "v2")[WEIGHTS_FILE] != files(tmp_path / "v3")[WEIGHTS_FILE]


def test_unchanging_files_are_linked_not_rewritten(tmp_path: Path, model_and_tok) -> None:
    model, tok = model_and_tok
    writer = ModelDirWriter(model, tok)
    first = fill(writer, tmp_path / "v1", None)
    second = fill(writer, tmp_path / "v2", perturbed(model, 2))
    for p in second.iterdir():
        linked = os.path.samefile(p, first / p.name)
        assert linked == (p.name != WEIGHTS_FILE), p.name


def test_a_pruned_previous_directory_means_one_full_write(tmp_path: Path, model_and_tok) -> None:
    model, tok = model_and_tok
    writer = ModelDirWriter(model, tok)
    fill(writer, tmp_path / "v1", None)
    shutil.rmtree(tmp_path / "v1")  # pruned before the next version
    weights = perturbed(model, 2)
    second = fill(writer, tmp_path / "v2", weights)
    assert files(second) == files(full_save(model, tok, tmp_path / "ref2", weights))
    third = fill(writer, tmp_path / "v3", perturbed(model, 3))
    assert os.path.samefile(third / "config.json", second / "config.json")  # linked again from v2


def test_the_models_own_weights_when_none_are_given(tmp_path: Path, model_and_tok) -> None:
    model, tok = model_and_tok
    writer = ModelDirWriter(model, tok)
    fill(writer, tmp_path / "v1", perturbed(model, 1))
    own = fill(writer, tmp_path / "v2", None)
    assert files(own) == files(full_save(model, tok, tmp_path / "ref", None))


def test_sharded_weights_are_written_in_full_every_time(tmp_path: Path, model_and_tok) -> None:
    model, tok = model_and_tok

    class Sharding:  # the model as a large one saves: an index and several weight files
        def __getattr__(self, name):
            return getattr(model, name)

        def save_pretrained(self, out, **kw):
            return model.save_pretrained(out, max_shard_size="20KB", **kw)

    writer = ModelDirWriter(Sharding(), tok)
    fill(writer, tmp_path / "v1", None)
    assert (tmp_path / "v1" / "model.safetensors.index.json").is_file()
    second = fill(writer, tmp_path / "v2", perturbed(model, 2))
    assert not any(os.path.samefile(p, tmp_path / "v1" / p.name) for p in second.iterdir())
    loaded = load_model(second).state_dict()
    assert all(torch.allclose(loaded[k], v) for k, v in perturbed(model, 2).items() if k in loaded)
