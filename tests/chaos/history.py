"""History checker: what happened to every prompt group, reconstructed from Redis, Jepsen-style.

It reads ``{p}:prompts`` (every attempt ever enqueued), ``{p}:batches``, the trainer's record of
trained batches ``{p}:trainer:trained`` (one entry per acknowledgement, written in the same MULTI as
the XACK, with the ``batch_ids`` and ``group_ids`` it covers) and ``{p}:dead``, and checks the
conservation law of docs/architecture.md#fate-of-a-group: every produced group is trained exactly once or dead-lettered
(never both), sits in at most one batch, and was attempted at most ``1 + max_retries`` times.

A ``History`` is fed entry by entry and idempotently (``feed``), so a recorder that tails the streams
while a run goes on (``poll``) keeps a copy that outlives Redis; ``collect`` then adds what Redis
holds now, marks the groups that are still *live* (an entry pending or undelivered in its consumer
group: in flight, not lost) and counts recorded entries Redis no longer has (``missing``: data loss,
e.g. a restart without AOF) — with ``allow_trimmed``, except a trimmed prefix (entries below the
first one left that their group had delivered: what ``shared.streams.trim_acked`` removes). Verdict: ``lost``, ``duplicated``, ``in_two_batches``,
``trained_and_dead``, ``dead_twice``, ``over_budget`` and ``missing`` must all be 0 (``ok``).
Without a recorder, streams must not be trimmed below the history being checked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from shared.codec import decode_entry
from shared.errors import MalformedEntry
from shared.keys import GROUP_COLLECTOR, GROUP_ROLLOUT, GROUP_TRAINER, Keys
from shared.schemas import Batch, DeadLetter

STREAMS = ("prompts", "rollouts", "batches", "trained", "dead")  # what a History is fed from
_GROUPS = {"prompts": GROUP_ROLLOUT, "rollouts": GROUP_COLLECTOR, "batches": GROUP_TRAINER}


def _s(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def _id(entry_id: Any) -> tuple[int, int]:
    ms, _, seq = _s(entry_id).partition("-")
    return int(ms), int(seq or 0)


def stream_names(keys: Keys) -> dict[str, str]:
    return {"prompts": keys.prompts, "rollouts": keys.rollouts, "batches": keys.batches,
            "trained": keys.trainer_trained, "dead": keys.dead}


@dataclass
class History:
    max_retries: int | None = None  # when set, attempts beyond it are reported as over_budget
    produced: set[str] = field(default_factory=set)  # group ids enqueued with attempt 0
    attempts: dict[str, set[int]] = field(default_factory=dict)  # group id -> attempts enqueued
    trained: Counter[str] = field(default_factory=Counter)  # group id -> trained records naming it
    batched: Counter[str] = field(default_factory=Counter)  # group id -> batch entries holding it
    dead: dict[str, list[str]] = field(default_factory=dict)  # group id -> dead-letter reasons
    poison: int = 0  # dead letters of malformed entries (no group)
    live: set[str] = field(default_factory=set)  # groups with an entry still pending/undelivered
    missing: dict[str, int] = field(default_factory=dict)  # stream -> recorded entries Redis lost
    missing_examples: dict[str, list[str]] = field(default_factory=dict)  # stream -> a few of their ids
    seen: dict[str, set[str]] = field(default_factory=dict)  # stream -> entry ids fed
    batch_groups: dict[str, list[str]] = field(default_factory=dict)  # batch id -> its group ids
    response_tokens: dict[str, list[int]] = field(default_factory=dict)  # group id -> loss tokens per trajectory
    dead_errors: dict[str, list[str]] = field(default_factory=dict)  # group id -> dead-letter error texts
    _unresolved: list[str] = field(default_factory=list)  # trained batch ids not seen in a batch yet

    # --- feeding ------------------------------------------------------------------------------

    def feed(self, stream: str, entry_id: Any, fields: Mapping[Any, Any]) -> None:
        """Account one entry of ``stream`` (one of STREAMS); feeding the same entry twice is a no-op."""
        ids = self.seen.setdefault(stream, set())
        eid = _s(entry_id)
        if eid in ids:
            return
        ids.add(eid)
        f = {_s(k): v for k, v in fields.items()}
        if stream == "prompts":
            try:
                gid, attempt = _s(f["group_id"]), int(_s(f["attempt"]))
            except (KeyError, ValueError):
                return  # a poison entry: counted when it is dead-lettered
            self.attempts.setdefault(gid, set()).add(attempt)
            if attempt == 0:
                self.produced.add(gid)
        elif stream == "batches":
            try:
                batch = decode_entry(f, Batch)
            except MalformedEntry:
                return
            gids = [g.group_id for g in batch.groups]
            for g in batch.groups:  # the length of every trained trajectory (length-bias checks)
                per_traj: Counter[str] = Counter()
                for smp in g.samples:
                    per_traj[smp.traj_id] += sum(smp.loss_mask)
                self.response_tokens.setdefault(g.group_id, list(per_traj.values()))
            self.batch_groups[batch.batch_id] = gids
            self.batched.update(gids)
            if batch.batch_id in self._unresolved:
                self._unresolved.remove(batch.batch_id)
                self.trained.update(gids)
        elif stream == "trained":
            self._feed_trained(f)
        elif stream == "dead":
            self._feed_dead(f)

    def _feed_trained(self, f: dict[str, Any]) -> None:
        if "group_ids" in f:
            self.trained.update(str(g) for g in json.loads(_s(f["group_ids"])))
            return
        for bid in filter(None, _s(f.get("batch_ids", b"")).split(",")):
            if bid in self.batch_groups:
                self.trained.update(self.batch_groups[bid])
            else:
                self._unresolved.append(bid)

    def _feed_dead(self, f: dict[str, Any]) -> None:
        reason = _s(f.get("reason", b"?"))
        groups: list[str] = []
        if reason != "malformed":
            if _s(f.get("source_stream", b"")).endswith(":batches"):
                try:  # a whole batch given up: each of its groups is dead-lettered
                    letter = decode_entry(f, DeadLetter)
                    groups = [g.group_id for g in decode_entry(letter.fields, Batch).groups]
                except MalformedEntry:
                    groups = []
            elif "group_id" in f:
                groups = [_s(f["group_id"])]
        if not groups:
            self.poison += 1
        for g in groups:
            self.dead.setdefault(g, []).append(reason)
            self.dead_errors.setdefault(g, []).append(_s(f.get("error", b""))[:300])

    # --- verdict ------------------------------------------------------------------------------

    @property
    def reenqueued(self) -> int:
        return sum(len(a - {0}) for a in self.attempts.values())

    @property
    def duplicated(self) -> list[str]:
        return sorted(g for g, n in self.trained.items() if n > 1)

    @property
    def in_two_batches(self) -> list[str]:
        return sorted(g for g, n in self.batched.items() if n > 1)

    @property
    def trained_and_dead(self) -> list[str]:
        return sorted(g for g in self.trained if g in self.dead)

    @property
    def dead_twice(self) -> list[str]:
        return sorted(g for g, reasons in self.dead.items() if len(reasons) > 1)

    @property
    def over_budget(self) -> list[str]:
        if self.max_retries is None:
            return []
        return sorted(g for g, a in self.attempts.items() if max(a) > self.max_retries)

    @property
    def in_flight(self) -> list[str]:
        """Produced groups with no outcome yet but an entry still live in a stream."""
        return sorted(g for g in self.produced if g not in self.trained and g not in self.dead and g in self.live)

    @property
    def lost(self) -> list[str]:
        """Produced groups with no outcome and no live entry anywhere: nothing can finish them."""
        return sorted(g for g in self.produced if g not in self.trained and g not in self.dead and g not in self.live)

    def max_attempt(self) -> int:
        return max((max(a) for a in self.attempts.values() if a), default=0)

    def summary(self) -> dict[str, Any]:
        reasons = Counter(r for rs in self.dead.values() for r in rs)
        return {"produced": len(self.produced), "trained": sum(1 for g in self.trained if g in self.produced),
                "reenqueued": self.reenqueued, "dead_lettered": len(self.dead),
                "dead_by_reason": dict(sorted(reasons.items())), "poison": self.poison,
                "in_flight": len(self.in_flight), "lost": len(self.lost), "duplicated": len(self.duplicated),
                "in_two_batches": len(self.in_two_batches), "trained_and_dead": len(self.trained_and_dead),
                "dead_twice": len(self.dead_twice), "over_budget": len(self.over_budget),
                "max_attempt": self.max_attempt(), "missing": sum(self.missing.values())}

    @property
    def ok(self) -> bool:
        s = self.summary()
        return not any(s[k] for k in ("lost", "duplicated", "in_two_batches", "trained_and_dead", "dead_twice",
                                      "over_budget", "missing"))

    def render(self) -> str:
        s = self.summary()
        lines = [f"{k:>16}: {v}" for k, v in s.items()]
        for name in ("lost", "duplicated", "in_two_batches", "trained_and_dead", "dead_twice", "over_budget"):
            if s[name]:
                lines.append(f"  {name} groups: {', '.join(getattr(self, name)[:20])}")
        if s["missing"]:
            lines.append(f"  missing entries by stream: {self.missing}, e.g. {self.missing_examples}")
        return "\n".join(lines)


# --- reading Redis ----------------------------------------------------------------------------

def poll(r: redis.Redis, keys: Keys, h: History, cursors: dict[str, str], count: int = 1000) -> int:
    """Feed ``h`` with the entries added since ``cursors`` (updated in place); returns how many."""
    fed = 0
    for name, stream in stream_names(keys).items():
        start = cursors.get(name)
        lo = "-" if start is None else f"({start}"
        for entry_id, fields in r.xrange(stream, min=lo, max="+", count=count):
            h.feed(name, entry_id, fields)
            cursors[name] = _s(entry_id)
            fed += 1
    return fed


def _consumed(r: redis.Redis, stream: str, group: str, ids: list[str]) -> tuple[set[str], tuple[int, int] | None]:
    """(entries of ``stream`` that ``group`` has not finished: pending or undelivered, its last-delivered id).

    Only entries of ``ids`` (the snapshot read before): on a live stack an entry added and delivered after
    the snapshot is already pending here, and it belongs to the next snapshot (trimming never removes a
    pending entry, so a pending id outside ``ids`` is newer than every one of them)."""
    try:
        infos = {_s(g["name"]): g for g in r.xinfo_groups(stream)}
    except redis.ResponseError:
        return set(ids), None  # no stream or no group yet: nothing was consumed
    if group not in infos:
        return set(ids), None
    last = _id(infos[group]["last-delivered-id"])
    live = {i for i in ids if _id(i) > last}
    known = set(ids)
    pending = (_s(p["message_id"]) for p in r.xpending_range(stream, group, min="-", max="+", count=1_000_000))
    live.update(i for i in pending if i in known)
    return live, last


def collect(r: redis.Redis, keys: Keys, into: History | None = None, max_retries: int | None = None,
            allow_trimmed: bool = False) -> History:
    """Feed everything Redis holds now into ``into`` (or a new History) and mark live and missing entries.

    ``allow_trimmed``: a recorded entry gone from the front of a stream its group had delivered counts
    as trimmed, not missing (runs with trimming on; never across a restart that could lose data).
    """
    h = into if into is not None else History(max_retries=max_retries)
    if max_retries is not None:
        h.max_retries = max_retries
    present: dict[str, dict[str, Any]] = {}
    for name, stream in stream_names(keys).items():
        present[name] = {_s(i): f for i, f in r.xrange(stream)}
    for name in STREAMS:  # batches before trained, so trained batch ids resolve at once
        for eid, fields in present[name].items():
            h.feed(name, eid, fields)
    h.live, delivered = set(), {}
    for name, group in _GROUPS.items():
        stream = stream_names(keys)[name]
        live, delivered[name] = _consumed(r, stream, group, list(present[name]))
        for eid in live:
            fields = {_s(k): v for k, v in present[name][eid].items()}
            if name == "batches":
                try:
                    h.live.update(g.group_id for g in decode_entry(fields, Batch).groups)
                except MalformedEntry:
                    pass
            elif "group_id" in fields:
                h.live.add(_s(fields["group_id"]))
    h.missing, h.missing_examples = {}, {}
    for name in STREAMS:
        gone = h.seen.get(name, set()) - present[name].keys()
        if allow_trimmed and name in delivered:  # trimming removes a delivered, acknowledged prefix
            first = min((_id(i) for i in present[name]), default=None)
            last = delivered[name]
            gone = {i for i in gone if last is None or _id(i) > last or (first is not None and _id(i) > first)}
        if gone:
            h.missing[name] = len(gone)
            h.missing_examples[name] = sorted(gone, key=_id)[:3]
    return h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/chaos/history.py", description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--prefix", default="dressage")
    ap.add_argument("--max-retries", type=int, default=None, help="flag groups attempted more often")
    args = ap.parse_args(argv)
    h = collect(redis.Redis.from_url(args.redis_url), Keys(args.prefix), max_retries=args.max_retries)
    sys.stdout.write(h.render() + "\n")
    return 0 if h.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
