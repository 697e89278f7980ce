"""History checker: reconstructs what happened to every prompt group from Redis, Jepsen-style.

It reads the streams after (or during) a run — ``{p}:prompts`` (every attempt ever enqueued),
``{p}:batches`` + the trainer's record of trained batches (``{p}:trainer:trained``, one entry per
batch, written in the same transaction as the batch's acknowledgement), and ``{p}:dead`` — and
checks the conservation law of ARCHITECTURE §3: every produced group is trained exactly once or
dead-lettered, with its attempts within the retry budget. ``lost`` and ``duplicated`` must be 0.
Streams must not be trimmed below the history being checked (chaos runs disable trimming).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from shared.codec import decode_entry
from shared.errors import MalformedEntry
from shared.keys import Keys
from shared.schemas import Batch


def _s(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


@dataclass
class History:
    produced: set[str] = field(default_factory=set)  # group ids enqueued with attempt 0
    attempts: dict[str, set[int]] = field(default_factory=dict)  # group id -> attempts enqueued
    trained: Counter[str] = field(default_factory=Counter)  # group id -> times in a trained batch
    batched: Counter[str] = field(default_factory=Counter)  # group id -> times in any batch entry
    dead: dict[str, str] = field(default_factory=dict)  # group id -> reason
    poison: int = 0  # dead letters without a group (malformed entries)
    in_flight: set[str] = field(default_factory=set)  # produced, neither trained nor dead (yet)

    @property
    def reenqueued(self) -> int:
        return sum(len(a - {0}) for a in self.attempts.values())

    @property
    def duplicated(self) -> list[str]:
        return sorted(g for g, n in self.trained.items() if n > 1)

    def lost(self, quiescent: bool = True) -> list[str]:
        """Groups neither trained nor dead-lettered; at quiescence every such group is lost."""
        return sorted(self.in_flight) if quiescent else []

    def max_attempt(self) -> int:
        return max((max(a) for a in self.attempts.values() if a), default=0)

    def summary(self, quiescent: bool = True) -> dict[str, Any]:
        reasons = Counter(self.dead.values())
        return {"produced": len(self.produced), "trained": sum(1 for g in self.trained if g in self.produced),
                "reenqueued": self.reenqueued, "dead_lettered": len(self.dead),
                "dead_by_reason": dict(sorted(reasons.items())), "poison": self.poison,
                "lost": len(self.lost(quiescent)), "duplicated": len(self.duplicated),
                "max_attempt": self.max_attempt()}

    def render(self, quiescent: bool = True) -> str:
        s = self.summary(quiescent)
        lines = [f"{k:>14}: {v}" for k, v in s.items()]
        if s["lost"]:
            lines.append(f"  lost groups: {', '.join(self.lost(quiescent)[:20])}")
        if s["duplicated"]:
            lines.append(f"  duplicated groups: {', '.join(self.duplicated[:20])}")
        return "\n".join(lines)


def collect(r: redis.Redis, keys: Keys) -> History:
    h = History()
    for _, f in r.xrange(keys.prompts):
        gid, attempt = f.get(b"group_id"), f.get(b"attempt")
        if gid is None or attempt is None:
            continue
        g = _s(gid)
        try:
            a = int(_s(attempt))
        except ValueError:
            continue
        h.attempts.setdefault(g, set()).add(a)
        if a == 0:
            h.produced.add(g)
    batch_groups: dict[str, list[str]] = {}
    for _, f in r.xrange(keys.batches):
        try:
            batch = decode_entry(f, Batch)
        except MalformedEntry:
            continue
        gids = [g.group_id for g in batch.groups]
        batch_groups[batch.batch_id] = gids
        h.batched.update(gids)
    for _, f in r.xrange(keys.custom("trainer", "trained")):
        for bid in _s(f.get(b"batch_ids", b"")).split(","):
            h.trained.update(batch_groups.get(bid, []))
    for _, f in r.xrange(keys.dead):
        gid = f.get(b"group_id")
        if gid is None:
            h.poison += 1
        else:
            h.dead[_s(gid)] = _s(f.get(b"reason", b"?"))
    h.in_flight = {g for g in h.produced if g not in h.trained and g not in h.dead}
    return h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shared.history", description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--prefix", default="dressage")
    ap.add_argument("--running", action="store_true", help="the pipeline is not quiescent: in-flight is not lost")
    args = ap.parse_args(argv)
    h = collect(redis.Redis.from_url(args.redis_url), Keys(args.prefix))
    sys.stdout.write(h.render(quiescent=not args.running) + "\n")
    return 1 if h.summary(not args.running)["lost"] or h.duplicated else 0


if __name__ == "__main__":
    raise SystemExit(main())
