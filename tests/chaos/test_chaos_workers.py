"""Rollout workers killed or paused in the middle of a group, in a full pipeline (issue 7, items 1–2).

Real redis-server, real engine, proxy, prompt-buffer, workers, collector and trainer processes.
A worker "in the middle of a group" holds its prompt entry pending (read, not yet committed):
the hand-off to ``{p}:rollouts`` and the XACK are one transaction, so pending means not handed off.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from harness import Cluster, wait_until

from shared.codec import decode_entry
from shared.schemas import RolloutGroup

LONG_GROUPS = {"rollout": {"max_new_tokens": 48}}  # a group takes long enough to be caught in the middle


def held_groups(c: Cluster, consumer: str) -> list[tuple[str, str]]:
    """(entry id, group id) of the prompt entries ``consumer`` holds pending."""
    out = []
    for p in c.r.xpending_range(c.keys.prompts, "rollout", min="-", max="+", count=100, consumername=consumer):
        eid = p["message_id"]
        for _, fields in c.r.xrange(c.keys.prompts, min=eid, max=eid):
            out.append((eid.decode(), fields[b"group_id"].decode()))
    return out


def rollouts_of(c: Cluster, group_id: str) -> list[RolloutGroup]:
    return [g for g in (decode_entry(f, RolloutGroup) for _, f in c.r.xrange(c.keys.rollouts))
            if g.group_id == group_id]


def reclaimed(c: Cluster, worker: str, entry_id: str) -> bool:
    """``worker`` logged an XAUTOCLAIM that took ``entry_id``."""
    return any("reclaimed" in line and f"'{entry_id}'" in line for line in c.procs[worker].tail(10**6).splitlines())


def stop_first_worker_holding_a_group(c: Cluster, sig: int) -> tuple[str, str]:
    """The pipeline with one worker; once w1 holds a group, send it ``sig`` (SIGKILL/SIGSTOP) and return
    (entry id, group id) of a group it holds *after* the signal — read, never handed off."""
    c.start_pipeline(workers=1)
    wait_until(lambda: held_groups(c, "w1"), 60, "w1 to hold a group", c.explain, period=0.02)
    c.signal("w1", sig)
    held = held_groups(c, "w1")  # definitive now: w1 can no longer commit
    assert held, "w1 handed its group off just before the signal; nothing to reclaim"
    return held[0]


def test_sigkilled_worker_group_is_reclaimed_by_another_and_trained_exactly_once(
        make_cluster: Callable[..., Cluster]) -> None:
    with make_cluster(rows=6, overrides=LONG_GROUPS) as c:
        entry_id, group_id = stop_first_worker_holding_a_group(c, signal.SIGKILL)
        assert not rollouts_of(c, group_id), "the group was handed off before the kill"
        c.start("rollout-worker", "w2")
        c.wait_settled(timeout=90)
        h = c.verdict()
        assert h.ok, c.explain()
        assert h.trained[group_id] == 1 and group_id not in h.dead
        assert [g.meta["worker"] for g in rollouts_of(c, group_id)] == ["w2"]
        assert reclaimed(c, "w2", entry_id), "w2 did not reclaim the entry"
        c.record_figures("workers::sigkill")


def test_sigstopped_worker_resumed_after_reclaim_leaves_its_group_in_exactly_one_batch(
        make_cluster: Callable[..., Cluster]) -> None:
    with make_cluster(rows=6, overrides=LONG_GROUPS) as c:
        entry_id, group_id = stop_first_worker_holding_a_group(c, signal.SIGSTOP)
        c.start("rollout-worker", "w2")
        # w2 reclaims the entry once it has been idle for claim_idle_ms, rolls it out and hands it off.
        wait_until(lambda: rollouts_of(c, group_id), 60, f"w2 to finish {group_id}", c.explain)
        assert reclaimed(c, "w2", entry_id)
        c.signal("w1", signal.SIGCONT)
        c.wait_settled(timeout=90)
        # The late copy: dropped by w1 itself (its entry is no longer pending) or by the collector's dedup.
        def late_copy_discarded() -> bool:
            lines = [ln for ln in c.procs["w1"].tail(10**6).splitlines() if f"group_id={group_id} " in ln]
            return any("already acknowledged" in ln for ln in lines) or (
                c.stats().get("groups_duplicate_discarded", 0) > 0)

        wait_until(late_copy_discarded, 30, "w1's late copy to be discarded", c.explain)
        h = c.verdict()
        assert h.ok, c.explain()
        assert h.batched[group_id] == 1 and h.trained[group_id] == 1
        assert [g.meta["worker"] for g in rollouts_of(c, group_id) if g.status == "completed"] in (["w2"], ["w2", "w1"])
        c.assert_alive("w1", "w2")  # the resumed worker is healthy and keeps serving
        c.record_figures("workers::sigstop")
