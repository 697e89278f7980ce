"""Bounded soak with a chaos driver (issue 7, item 10).

The whole pipeline (proxy, prompt-buffer, three workers, collector, trainer; the engine is shared)
runs for ``SOAK_S`` seconds while a seeded driver SIGKILLs a random service every 2–4 s and restarts
it half a second later. Staleness control (``keep_versions`` 2), partial rollout and stream trimming
are on. Then the chaos stops, every service is brought back, admissions stop (the prompt-buffer gets
SIGTERM) and the pipeline drains. The conservation law must hold for every produced group (trained
exactly once, or dead-lettered, never both, attempts within the retry budget), and stream lengths
and Redis memory must have stayed bounded all along (bounds justified below).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from harness import ChaosDriver, Cluster, wait_until

from services.prompt_buffer.schedule import Cursor, Schedule, group_id
from shared.config import load_config
from shared.tasks.dataset import load_dataset

SOAK_S = float(os.environ.get("CHAOS_SOAK_S", "60"))
IN_FLIGHT = 6  # pacing.max_in_flight_groups
TRIM_S = 2.0  # collector.trim_interval_s
WINDOW_S = 20.0  # trim period + reclaim idle time + a service restart on a loaded 2-core machine, rounded up
VICTIMS = ["w1", "w2", "w3", "collector", "trainer", "prompt-buffer", "proxy"]


def max_in_window(entry_ids: set[str], seconds: float) -> int:
    """The most entries written within any ``seconds``-long window (stream ids start with their ms time)."""
    ms = sorted(int(i.split("-")[0]) for i in entry_ids)
    best, lo = 0, 0
    for hi, t in enumerate(ms):
        while t - ms[lo] > seconds * 1000:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def produced_ids(c: Cluster, n: int) -> set[str]:
    """Group ids of the first ``n`` groups the prompt-buffer emits for this cluster's dataset."""
    rows = load_dataset(c.dataset)
    pb = load_config(c.config_path, env={}).prompt_buffer
    items, _ = Schedule(len(rows), pb.shuffle_seed, pb.epochs).take(Cursor(), n)
    return {group_id(e, i, rows[i]["prompt_id"]) for e, i in items}


def sample(c: Cluster) -> dict[str, Any]:
    k = c.keys
    return {"prompts": c.r.xlen(k.prompts), "rollouts": c.r.xlen(k.rollouts), "batches": c.r.xlen(k.batches),
            "memory": int(c.r.info("memory")["used_memory"])}


def test_soak_with_random_kills_conserves_every_group_and_keeps_streams_and_memory_bounded(
        make_cluster: Callable[..., Cluster]) -> None:
    with make_cluster(rows=1000, overrides={
            "staleness": {"keep_versions": 2}, "collector": {"trim_interval_s": TRIM_S},
            "pacing": {"max_in_flight_groups": IN_FLIGHT}, "rollout": {"max_new_tokens": 24}}) as c:
        c.start_pipeline(workers=3)
        baseline = sample(c)
        samples = [baseline]
        driver = ChaosDriver(c, VICTIMS, period=(2.0, 4.0), down_s=0.5, seed=int(os.environ.get("CHAOS_SEED", "1")))
        t0 = time.monotonic()
        driver.start()
        try:
            while time.monotonic() - t0 < SOAK_S:
                samples.append(sample(c))  # a sampling period, not a wait for a condition
                time.sleep(0.5)
        finally:
            driver.stop()  # never leave it restarting services behind a failed test
        c.restart_dead()
        c.wait_up(*c.procs)
        assert c.terminate("prompt-buffer") == 0  # no new admissions: drain what is in flight
        produced = c.stats()["groups_produced"]
        c.wait_settled(expected=produced, timeout=180)
        samples.append(sample(c))
        drained_s = time.monotonic() - t0 - SOAK_S
        h = c.verdict(allow_trimmed=True)
        seen_produced = len(h.produced)
        # The recorder can miss a prompt entry that lived < 0.1 s (read, failed at once, acked and trimmed
        # in between), so the produced set comes from the buffer's committed cursor: the ids are a pure
        # function of the dataset order (services/prompt_buffer/schedule.py).
        h.produced |= produced_ids(c, produced)
        s = h.summary()
        assert h.ok, f"{h.render()}\n{c.explain()}"
        assert s["produced"] == produced and s["trained"] + s["dead_lettered"] == produced, h.render()
        assert s["max_attempt"] <= c.max_retries and len(driver.kills) >= SOAK_S / 5, driver.kills
        # Bounded streams: trimming keeps only live entries. Un-acknowledged entries are bounded by pacing
        # (IN_FLIGHT groups); acknowledged ones are trimmed at the collector's next pass (every TRIM_S)
        # once no older entry is still pending — an entry of a killed worker until its reclaim (2.5 s
        # idle), a group held through a proxy restart. So a stream holds at most the writes of the last
        # WINDOW_S seconds (plus what is in flight), never the whole run: (1) at every sample, and (2) once
        # drained and trimmed it holds nothing, however long the run was.
        names = ("prompts", "rollouts", "batches")
        written = {n: len(h.seen.get(n, ())) for n in names}
        window = {n: max_in_window(h.seen.get(n, set()), WINDOW_S) for n in names}
        peak = {n: max(x[n] for x in samples) for n in (*names, "memory")}
        for n in names:
            assert peak[n] <= window[n] + IN_FLIGHT, (n, peak, window, written)
        wait_until(lambda: all(c.r.xlen(getattr(c.keys, n)) <= 2 for n in names), 5 * TRIM_S,
                   "the drained streams to be trimmed", lambda: str(sample(c)))
        # Memory: the live data (bounded streams above, capped dead/metrics/trained/log streams holding a
        # few hundred short entries in a run this long) fits in a few MB over the empty baseline.
        assert peak["memory"] - baseline["memory"] < 16 * 2**20, (baseline, peak)
        c.record_figures("soak", **{k: s[k] for k in ("produced", "trained", "dead_lettered", "reenqueued", "lost",
                                                      "duplicated")},
                         kills=len(driver.kills), soak_s=SOAK_S, drain_s=round(drained_s, 1),
                         written=written, window=window, peak=peak, baseline_memory=baseline["memory"],
                         dead_by_reason=s["dead_by_reason"], max_attempt=s["max_attempt"],
                         recorder_saw_produced=seen_produced)
