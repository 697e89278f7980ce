"""Graceful SIGTERM for every service (issue 7, item 9).

Every service of a running pipeline — engine, proxy, prompt-buffer, two rollout workers, collector,
trainer — gets SIGTERM while work is in flight. Each exits 0 within its grace period; at that
moment every produced group is trained, dead-lettered, or still pending/undelivered in a stream
(``lost == 0``): work in hand either finished or was left for reclaim. A second generation of
consumers with *new* names then reclaims what was left (XAUTOCLAIM) and finishes the run.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from harness import Cluster, wait_until

GRACE_S = 5.0  # rollout.grace_period_s in this test
EXIT_BOUND_S = GRACE_S + 15  # grace + one blocking read + a checkpoint on a loaded CI machine


def test_sigterm_stops_every_service_with_exit_0_and_in_flight_work_finished_or_left_pending(
        make_cluster: Callable[..., Cluster]) -> None:
    with make_cluster(rows=10, own_engine=True, overrides={"rollout": {"max_new_tokens": 64,
                                                                       "grace_period_s": GRACE_S}}) as c:
        c.start_pipeline(workers=2)
        wait_until(lambda: c.stats().get("groups_trained", 0) >= 2 and c.pending("prompts") > 0, 90,
                   "work in flight", c.explain, period=0.02)
        names = list(c.procs)
        t0 = time.monotonic()
        for n in names:
            c.signal(n, signal.SIGTERM)
        codes = {n: c.procs[n].wait(EXIT_BOUND_S) for n in names}
        took = time.monotonic() - t0
        assert codes == dict.fromkeys(names, 0), f"{codes}\n{c.logs()}"
        h = c.verdict()
        assert h.ok, f"SIGTERM lost or doubled work:\n{c.explain()}"  # finished, or pending for reclaim
        left = len(h.in_flight)
        # Generation 2, new consumer names: what generation 1 left pending is reclaimed, not re-read.
        for service, name in (("engine", "engine2"), ("proxy", "proxy2"), ("prompt-buffer", "prompt-buffer2"),
                              ("group-collector", "collector2"), ("trainer", "trainer2")):
            c.start(service, name)
        c.wait_up("engine2", "proxy2")
        for name in ("w3", "w4"):
            c.start("rollout-worker", name)
        c.wait_settled(timeout=120)
        h = c.verdict()
        assert h.ok and h.summary()["trained"] + h.summary()["dead_lettered"] == 10, c.explain()
        c.record_figures("sigterm", exit_seconds=round(took, 1), left_pending=left)
