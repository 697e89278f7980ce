"""Runs inside the compose network (``docker compose run status``: Redis user `ops`, read-only), mounted
at / by the tier with tests/chaos/history.py beside it as /history.py: ``python /history_check.py CONFIG``.

Feeds every entry of the streams into tests/chaos/history.py (the chaos tests' checker: every group
trained once or dead-lettered, in at most one batch, within its attempts) and checks that the
prompt-buffer emitted exactly its schedule's prefix, in order: no prompt skipped, none emitted twice,
the stored cursor not past them. Prints one JSON object; exit 0 when both hold. The streams must be
whole: the full tier runs the collector with trimming off (tests/compose/test_stack.py).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from history import collect

from services.prompt_buffer.schedule import Cursor, Schedule
from shared.config import DressageConfig, load_config
from shared.keys import Keys
from shared.tasks.dataset import scan_dataset


def emitted_in_order(cfg: DressageConfig, r: Any, keys: Keys) -> tuple[bool, int]:
    """The attempt-0 groups of {p}:prompts are the schedule's first N items, in order, and the stored
    cursor is not past them (read first: the prompt-buffer may emit meanwhile)."""
    stored = r.hgetall(keys.prompt_buffer_cursor)
    ids = [f[b"group_id"].decode() for _, f in r.xrange(keys.prompts) if f.get(b"attempt", b"0") == b"0"]
    rows = scan_dataset(cfg.prompt_buffer.dataset, task=cfg.model.task).rows
    schedule = Schedule(len(rows), cfg.prompt_buffer.shuffle_seed, cfg.prompt_buffer.epochs)
    items, after = schedule.take(Cursor(), len(ids))
    in_order = all(g.startswith(f"e{e}-i{i}-") for g, (e, i) in zip(ids, items, strict=True))
    cursor = schedule.normalize(Cursor(int(stored.get(b"epoch", 0)), int(stored.get(b"position", 0))))
    return in_order and (cursor.epoch, cursor.position) <= (after.epoch, after.position), len(ids)


def main(config: str) -> int:
    cfg = load_config(config)  # the services' config, with the same environment
    r, keys = cfg.redis.client(), cfg.keys()
    h = collect(r, keys, max_retries=cfg.rollout.max_retries)
    in_order, emitted = emitted_in_order(cfg, r, keys)
    print(json.dumps({"ok": h.ok, "history": h.render(), "prompts_in_order": in_order, "emitted": emitted}))
    return 0 if h.ok and in_order else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
