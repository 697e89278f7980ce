"""``model.path`` as a Hugging Face model id: resolved to its folder in the standard Hugging Face cache.

A value that is an existing path is a local folder and is returned as it is. A value shaped like a hub
id (``org/name``) that is not a path is looked up in the cache ``huggingface_hub`` uses (``HF_HOME`` /
``HF_HUB_CACHE``; layout ``models--org--name/snapshots/<revision>/`` with ``refs/main`` naming the
revision): found, its snapshot folder is returned; not found, the value is returned unchanged, so the
service that loads it fails naming it (``ModelNotFound``). Never a download: a service must not fetch
gigabytes at start-up -- ``hf download org/name`` fills the cache first (docs/guides/your-model.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def cache_dir() -> str | None:
    """The hub cache as the environment names it now (``HF_HUB_CACHE``, else ``HF_HOME``/hub); None: the
    library's default. Read at each call: huggingface_hub reads these variables once, at its import."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME")
    return os.path.join(home, "hub") if home else None


def looks_like_hub_id(value: str) -> bool:
    return bool(HUB_ID.fullmatch(value)) and not Path(value).exists()


def resolve_model_path(value: str, revision: str | None = None) -> str:
    """The local folder of ``value`` (a folder, or a hub id present in the Hugging Face cache)."""
    if not looks_like_hub_id(value):
        return value
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # transformers depends on it; without it an id cannot be resolved
        return value
    try:
        return str(snapshot_download(value, revision=revision, local_files_only=True, cache_dir=cache_dir()))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return value
