"""Messages/s through one stream hand-off vs the raw redis-py pipelined XADD rate, in one run.

The hop is what every service does per message: XREADGROUP → ``decode_entry`` → ``encode_entry``
→ XADD + XACK in one MULTI/EXEC (``shared.streams.handoff``). The baseline XADDs the same encoded
bytes with a redis-py pipeline (no decode, no transaction): the ceiling of the transport. The
message is a realistic rollout group: 8 samples × 1,024 tokens. Both run against a private
``redis-server`` (AOF off, so the disk is not what is measured), interleaved over several rounds;
the median ratio is printed. Target: hop / raw >= 0.5.

    python bench/streams_hop.py [--messages 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from shared.codec import decode_entry, encode_entry  # noqa: E402
from shared.redisproc import RedisProcess  # noqa: E402
from shared.schemas import PromptGroup, RolloutGroup, Sample  # noqa: E402
from shared.staleness import sample_version_fields  # noqa: E402
from shared.streams import GroupReader, ensure_group, handoff, handoff_many  # noqa: E402


def realistic_group(group_id: str = "g0", n_samples: int = 8, n_tokens: int = 1024, prompt_len: int = 128,
                    versions: tuple[str, ...] = ("4", "5"), seed: int = 0) -> RolloutGroup:
    """A GRPO group as a worker hands it over: ``n_samples`` trajectories of ``n_tokens`` tokens each."""
    rng = random.Random(seed)
    samples = []
    for i in range(n_samples):
        cut = prompt_len + (n_tokens - prompt_len) // 2  # a partial rollout: two versions in the response
        tv = ["-1"] * prompt_len + [versions[0]] * (cut - prompt_len) + [versions[-1]] * (n_tokens - cut)
        mask = [0] * prompt_len + [1] * (n_tokens - prompt_len)
        samples.append(Sample(traj_id=f"{group_id}-t{i}", token_ids=[rng.randrange(32_000) for _ in range(n_tokens)],
                              loss_mask=mask, logprobs=[-rng.random() * m for m in mask], token_versions=tv,
                              reward=rng.random(),
                              **sample_version_fields(mask, tv)))
    prompt = PromptGroup(group_id=group_id, prompt_id="p0", task="reverse", prompt="reverse 123", reference="321",
                         n_samples=n_samples, enqueued_at=time.time())
    return RolloutGroup(group_id=group_id, prompt_id="p0", attempt=0, status="completed", samples=samples,
                        prompt_group=prompt, meta={"rollout_started_at": time.time(),
                              "rollout_finished_at": time.time()})


def raw_rate(r: redis.Redis, fields: dict[str, bytes], n: int, stream: str, pipeline_size: int = 32) -> float:
    """Messages/s of pipelined XADDs of ``fields`` (the transport's ceiling)."""
    r.delete(stream)
    start = time.perf_counter()
    for lo in range(0, n, pipeline_size):
        pipe = r.pipeline(transaction=False)
        for _ in range(min(pipeline_size, n - lo)):
            pipe.xadd(stream, fields)  # type: ignore[arg-type]
        pipe.execute()
    rate = n / (time.perf_counter() - start)
    r.delete(stream)
    return rate


def fill(r: redis.Redis, stream: str, fields: dict[str, bytes], n: int) -> None:
    r.delete(stream)
    pipe = r.pipeline(transaction=False)
    for _ in range(n):
        pipe.xadd(stream, fields)  # type: ignore[arg-type]
    pipe.execute()


def codec_ms(fields: dict[str, bytes], n: int = 30) -> tuple[float, float]:
    """Milliseconds per message spent in ``decode_entry`` and ``encode_entry`` (in process)."""
    start = time.perf_counter()
    for _ in range(n):
        group = decode_entry(fields, RolloutGroup)
    mid = time.perf_counter()
    for _ in range(n):
        encode_entry(group)
    end = time.perf_counter()
    return (mid - start) / n * 1000, (end - mid) / n * 1000


def hop_rate(r: redis.Redis, fields: dict[str, bytes], n: int, per_multi: int = 1, codec: bool = True) -> float:
    """Messages/s through read → decode → encode → XADD + XACK in one MULTI/EXEC.

    ``per_multi`` messages share one transaction (``handoff_many``; 1 = ``handoff`` per message);
    ``codec=False`` forwards the bytes as read (the hop's transport share, for the breakdown).
    """
    src, dst = "bench:in", "bench:out"
    fill(r, src, fields, n)
    r.delete(dst)
    ensure_group(r, src, "hop")
    reader = GroupReader(r, src, "hop", "bench")
    moved = 0
    start = time.perf_counter()
    while moved < n:
        entries = reader.read(max(16, per_multi), block_ms=None)
        for lo in range(0, len(entries), per_multi):
            chunk = entries[lo:lo + per_multi]
            outs = [encode_entry(decode_entry(e.fields, RolloutGroup)) if codec else e.fields for e in chunk]
            if per_multi == 1:
                handoff(r, src, "hop", chunk[0].id, dst, outs[0])
            else:
                handoff_many(r, src, "hop", [e.id for e in chunk], [(dst, o) for o in outs])
            moved += len(chunk)
    rate = n / (time.perf_counter() - start)
    r.delete(src, dst)
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    fields = encode_entry(realistic_group())
    size = sum(len(v) for v in fields.values())
    server = RedisProcess(appendonly=False).start()
    try:
        r = redis.Redis(port=server.port)
        runs: dict[str, list[float]] = {"raw": [], "hop": [], "hop16": [], "bare": [], "bare16": []}
        for _ in range(args.rounds):
            runs["raw"].append(raw_rate(r, fields, args.messages, "bench:raw"))
            runs["hop"].append(hop_rate(r, fields, args.messages))
            runs["hop16"].append(hop_rate(r, fields, args.messages, per_multi=16))
            runs["bare"].append(hop_rate(r, fields, args.messages, codec=False))
            runs["bare16"].append(hop_rate(r, fields, args.messages, per_multi=16, codec=False))
    finally:
        server.cleanup()
    dec, enc = codec_ms(fields)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [h / w for h, w in zip(runs["hop"], runs["raw"], strict=True)]
    print(f"message: rollout group, 8 samples x 1024 tokens, {size / 1024:.1f} KiB encoded")
    print(f"raw pipelined XADD       : {med['raw']:8.0f} msg/s  ({med['raw'] * size / 2**20:.0f} MiB/s)")
    print(f"hop, 1 msg per MULTI     : {med['hop']:8.0f} msg/s  ratio {med['hop'] / med['raw']:.2f} "
          f"(target >= 0.5; rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"hop, 16 msgs per MULTI   : {med['hop16']:8.0f} msg/s  ratio {med['hop16'] / med['raw']:.2f}")
    print(f"breakdown: decode {dec:.2f} ms + encode {enc:.2f} ms per message; without the codec the hop moves "
          f"{med['bare']:.0f} msg/s (ratio {med['bare'] / med['raw']:.2f}), "
          f"{med['bare16']:.0f} msg/s batched (ratio {med['bare16'] / med['raw']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
