"""Groups/s through the group-collector vs the raw stream hop, measured in the same run.

Fills ``{p}:rollouts`` with realistic groups (8 samples × 1,024 tokens, distinct group ids, all
inside the window), then times one burst run of the real collector (decode, window, dedup lookup,
batch of ``--per-batch`` groups written with its acks/done keys/counters in one MULTI). Beside it,
on the same bytes and server: the bare hand-off hop (read → decode → encode → XADD+XACK, see
``streams_hop.py``) and the raw pipelined XADD rate. Private ``redis-server``, AOF off.

    python bench/collector.py [--groups 200] [--per-batch 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402
from streams_hop import hop_rate, raw_rate, realistic_group  # noqa: E402

from services.group_collector.collector import GroupCollector  # noqa: E402
from services.group_collector.core import CollectorCore  # noqa: E402
from shared.codec import encode_entry  # noqa: E402
from shared.config import CollectorConfig, StalenessSection
from shared.keys import Keys  # noqa: E402
from shared.redisproc import RedisProcess  # noqa: E402
from shared.schemas import WeightVersion  # noqa: E402
from shared.staleness import StalenessConfig, StalenessGroupFilter, StalenessTracker  # noqa: E402
from shared.versionbus import publish_version  # noqa: E402


def redis_cpu(r: redis.Redis) -> float:
    """CPU seconds the redis-server process has used (user + system)."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def collector_rate(r: redis.Redis, entries: list[dict[str, bytes]], per_batch: int, round_no: int,
                   cpu: dict[str, float] | None = None) -> float:
    """Groups/s of one burst run; ``cpu`` (if given) gets the CPU seconds of this process and of Redis."""
    keys = Keys(f"bench{round_no}")
    for v in ("4", "5"):
        publish_version(r, keys, WeightVersion(version=v, path="/x", step=int(v), published_at=time.time()))
    pipe = r.pipeline(transaction=False)
    for fields in entries:
        pipe.xadd(keys.rollouts, fields)  # type: ignore[arg-type]
    pipe.execute()
    core = CollectorCore(StalenessGroupFilter(StalenessTracker(StalenessConfig(2))), per_batch, 2)
    collector = GroupCollector(r, keys, core, CollectorConfig(max_ready_batches=1000, read_count=64, trim_interval_s=0),
                               StalenessSection(keep_versions=2), consumer="bench", burst=True)
    start, cpu0, rcpu0 = time.perf_counter(), time.process_time(), redis_cpu(r)
    collector.run()
    rate = len(entries) / (time.perf_counter() - start)
    if cpu is not None:
        cpu["process"] = time.process_time() - cpu0
        cpu["redis"] = redis_cpu(r) - rcpu0
    batched = int(r.hget(keys.stats, "groups_batched") or 0)
    assert batched == len(entries) - len(entries) % per_batch, f"collector batched {batched}/{len(entries)}"
    for key in r.scan_iter(f"{keys.prefix}:*"):
        r.delete(key)
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--per-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    template = realistic_group()
    entries = [encode_entry(template.model_copy(update={"group_id": f"g{i}"})) for i in range(args.groups)]
    server = RedisProcess(appendonly=False).start()
    try:
        r = redis.Redis(port=server.port)
        runs: dict[str, list[float]] = {"collector": [], "hop": [], "raw": []}
        for i in range(args.rounds):
            runs["collector"].append(collector_rate(r, entries, args.per_batch, i))
            runs["hop"].append(hop_rate(r, entries[0], args.groups))
            runs["raw"].append(raw_rate(r, entries[0], args.groups, "bench:raw"))
    finally:
        server.cleanup()
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [c / h for c, h in zip(runs["collector"], runs["hop"], strict=True)]
    print(f"groups: {args.groups} x (8 samples x 1024 tokens), {args.per_batch} groups per batch")
    print(f"collector          : {med['collector']:8.0f} groups/s")
    print(f"raw stream hop     : {med['hop']:8.0f} msg/s   (read, decode, encode, XADD+XACK)")
    print(f"raw pipelined XADD : {med['raw']:8.0f} msg/s")
    print(f"ratio collector/hop: {statistics.median(ratios):8.2f}  (rounds: {', '.join(f'{x:.2f}' for x in ratios)});"
          f" collector/raw XADD {med['collector'] / med['raw']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
