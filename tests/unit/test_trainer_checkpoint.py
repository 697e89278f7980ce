"""Checkpoint store: atomic write, only complete checkpoints load, temp dirs cleaned, pruning."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import pytest
import torch
from trainer_factory import SMALL_SPEC, VOCAB

from services.trainer.checkpoint import (
    DIR_MODE,
    FILE_MODE,
    MANIFEST,
    STATE_FILE,
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    pinned_names,
    rng_state,
    set_rng_state,
)
from shared.modeling import build_model, build_tokenizer, load_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_and_tok():
    return build_model(SMALL_SPEC, VOCAB, 0, 2, seed=1), build_tokenizer(64)


def write(store: CheckpointStore, version: int, model_and_tok, state: dict | None = None):
    model, tok = model_and_tok

    def save(d: Path) -> None:
        model.save_pretrained(d)
        tok.save_pretrained(d)

    return store.write(version, version * 2, save, state or {"version": version, "ids": ["1-0"]})


def test_written_checkpoint_is_complete_loadable_and_leaves_no_temp(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    info = write(store, 3, model_and_tok)
    assert info.path == tmp_path / "v00000003" and info.step == 6
    assert [p.name for p in tmp_path.iterdir()] == ["v00000003"]
    assert store.newest() == info
    assert store.load_state(info) == {"version": 3, "ids": ["1-0"]}
    model = load_model(info.path)
    ref = model_and_tok[0].state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def test_checkpoints_and_snapshots_are_readable_by_another_user_under_a_strict_umask(tmp_path: Path,
                                                                                    model_and_tok) -> None:
    old = os.umask(0o077)  # a hardened host; the engine (a non-root SGLang, NFS root-squash) is another user
    try:
        store = CheckpointStore(tmp_path)
        placed = [write(store, 1, model_and_tok).path, snapshot(store, 2, model_and_tok).path]
    finally:
        os.umask(old)
    for root in placed:
        for path in [root, *root.rglob("*")]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (DIR_MODE if path.is_dir() else FILE_MODE) == (0o755 if path.is_dir() else 0o644), path


def test_a_version_directory_is_never_overwritten(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    write(store, 1, model_and_tok)
    with pytest.raises(CheckpointError, match="already exists"):
        write(store, 1, model_and_tok)


def test_temp_and_damaged_directories_are_never_loaded(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    good = write(store, 1, model_and_tok)
    newer = write(store, 2, model_and_tok)
    # A crash mid-write leaves a temp dir; a v3 without manifest and a v2 whose file was truncated.
    (tmp_path / ".tmp-v00000003-abc").mkdir()
    (tmp_path / ".tmp-v00000003-abc" / STATE_FILE).write_bytes(b"half")
    (tmp_path / "v00000003").mkdir()
    weights = newer.path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert store.newest() == good
    assert store.cleanup_temp() == [tmp_path / ".tmp-v00000003-abc"]
    assert not (tmp_path / ".tmp-v00000003-abc").exists()


def test_manifest_must_name_its_own_directory(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    info = write(store, 4, model_and_tok)
    manifest = json.loads((info.path / MANIFEST).read_text())
    manifest["version"] = 9
    (info.path / MANIFEST).write_text(json.dumps(manifest))
    assert store.newest() is None


def test_prune_keeps_the_newest_and_the_referenced(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    infos = [write(store, v, model_and_tok) for v in range(5)]
    removed = store.prune(2, referenced=[infos[1].path])
    assert sorted(p.name for p in removed) == ["v00000000", "v00000002"]
    assert [i.version for i in store.complete()] == [1, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001", "v00000003", "v00000004"]


def test_prune_checks_only_checkpoints_it_does_not_know(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    for v in range(4):
        write(store, v, model_and_tok)
    checked: list[str] = []
    real = store._read_complete

    def spy(p: Path) -> CheckpointInfo | None:
        checked.append(p.name)
        return real(p)

    store._read_complete = spy  # type: ignore[method-assign]  # test spy shadows the method
    store.prune(3)
    assert checked == []  # it wrote them all: nothing re-read
    # A checkpoint it did not write (another process's, or one from before a restart) is checked once;
    # a damaged one is never counted among the kept.
    fresh = CheckpointStore(tmp_path)
    (tmp_path / "v00000009").mkdir()  # no manifest: not complete
    assert [p.name for p in fresh.prune(2)] == ["v00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003", "v00000009"]


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path: Path) -> None:
    random.seed(5)
    torch.manual_seed(5)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (random.random(), torch.rand(3).tolist())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), torch.rand(3).tolist()) == want


def snapshot(store: CheckpointStore, version: int, model_and_tok) -> CheckpointInfo:
    model, tok = model_and_tok

    def save(d: Path) -> None:
        model.save_pretrained(d)
        tok.save_pretrained(d)

    return store.write_snapshot(version, version * 2, save)


def test_a_snapshot_is_a_loadable_model_but_never_a_checkpoint(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    write(store, 0, model_and_tok)
    info = snapshot(store, 1, model_and_tok)
    assert info.path == tmp_path / "snapshots" / "v00000001" and info.path.is_dir()
    load_model(info.path)  # engines and evaluations load it like any model directory
    assert not (info.path / STATE_FILE).exists()
    assert [i.version for i in store.complete()] == [0]  # never resumed from
    assert [i.version for i in store.snapshots()] == [1]
    with pytest.raises(CheckpointError, match="never reused"):
        snapshot(store, 1, model_and_tok)


def test_promoting_a_snapshot_links_its_files_beside_the_state(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    snap = snapshot(store, 3, model_and_tok)
    info = store.promote(snap, {"version": 3, "ids": ["7-0"]})
    assert info.path == tmp_path / "v00000003" and [i.version for i in store.complete()] == [3]
    weights, linked = snap.path / "model.safetensors", info.path / "model.safetensors"
    assert weights.stat().st_ino == linked.stat().st_ino  # hard-linked, not written again
    assert store.load_state(info)["ids"] == ["7-0"]
    snapshot(store, 4, model_and_tok)
    assert store.prune_snapshots(1) == [snap.path]  # the snapshot can go: the checkpoint keeps its own link
    assert not snap.path.exists() and linked.is_file() and load_model(info.path) is not None


def test_snapshots_are_pruned_to_the_newest_and_the_referenced(tmp_path: Path, model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    paths = [snapshot(store, v, model_and_tok).path for v in range(1, 6)]
    removed = store.prune_snapshots(2, referenced=[paths[0]])
    assert removed == paths[1:3]
    assert [i.version for i in store.snapshots()] == [1, 4, 5]
    assert not [p for p in store.snapshot_root.iterdir() if p.name.startswith(".")]


def test_leftover_snapshot_temp_dirs_go_at_start_and_abandoned_ones_on_request(tmp_path: Path,
                                                                                model_and_tok) -> None:
    store = CheckpointStore(tmp_path)
    for v in (1, 2, 3):
        snapshot(store, v, model_and_tok)
    (store.snapshot_root / ".tmp-v00000004-x").mkdir()
    assert [p.name for p in store.cleanup_temp()] == [".tmp-v00000004-x"]
    assert store.drop_snapshots_above(1) == [store.snapshot_path(2), store.snapshot_path(3)]
    assert [i.version for i in store.snapshots()] == [1]


def test_pinned_names_match_published_relative_and_symlinked_paths(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "ckpt"
    (root / "v1").mkdir(parents=True)
    (tmp_path / "elsewhere" / "v9").mkdir(parents=True)
    (tmp_path / "via").symlink_to(root)
    monkeypatch.chdir(tmp_path)
    referenced: list[str | Path] = [str((root / "v1").resolve()),  # as the trainer publishes it: no system call
                  "ckpt/v2",  # relative to the working directory
                  tmp_path / "via" / "v3",  # through a symlink to the root
                  root / "sub" / ".." / "v4",  # folded lexically
                  tmp_path / "elsewhere" / "v9",  # another directory: not ours
                  root / "v1" / "model.safetensors"]  # a file inside a version: not a version
    assert pinned_names(root, referenced) == {"v1", "v2", "v3", "v4"}
    assert pinned_names(tmp_path / "via", [root / "v5"]) == {"v5"}  # the root itself given via a symlink
    assert pinned_names(root, []) == set()
