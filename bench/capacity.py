"""Capacity of each pipeline component on this machine, and the GPU fleet each would carry (docs/scaling.md).

Every figure is measured here, in this run, against a private ``redis-server`` (AOF off, so the
disk is not what is measured; the compose file's ``appendfsync everysec`` costs little more):

* prompt-buffer    groups/s emitted (burst, pacing unbounded; one MULTI per chunk of groups);
* rollout-worker   trajectories/s against an instant in-process proxy (``FakeProxyClient``: no
                   engine time at all, so this is the worker's own cost: decode, agent loop, assembly,
                   hand-off) with ``rollout.concurrency`` groups at once;
* group-collector  groups/s by group size (samples × tokens), ``bench/collector.py``'s harness;
* trainer          seconds per step outside forward/backward (checkpoint write, XACK + trained
                   record, version publish), tiny model so the step itself is small;
* Redis            bytes per group on the wire (the encoded entry, once per hop) and memory per
                   in-flight group (``used_memory`` delta per group held in a stream).

Each figure is given twice: per wall-clock second as measured (this machine is shared, so that
depends on its load, printed at start and end) and per CPU-second of the component's own process
(``time.process_time``) — what one dedicated core sustains, independent of the neighbours. Redis is
accounted separately: its CPU-seconds per group (``INFO cpu``), summed over the hops, is what one
Redis primary (single-threaded) must spend per group.

Then, for ``--gpu-tokens-per-s`` tokens generated per GPU and groups of ``--samples`` × ``--tokens``,
the number of GPUs whose output each component absorbs before it saturates on one dedicated core
(workers and engines scale out; the collector and the trainer's shell are one per run).

    python bench/capacity.py [--quick] [--gpu-tokens-per-s 2500] [--samples 8] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402
from collector import collector_rate, redis_cpu  # noqa: E402
from streams_hop import realistic_group  # noqa: E402

from shared.codec import encode_entry  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.redisproc import RedisProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def load_note() -> str:
    la = os.getloadavg()
    return f"load average {la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f} on {os.cpu_count()} CPUs"


@dataclass
class Rate:
    """``count`` items in ``wall`` seconds, ``cpu`` CPU-seconds of this process, ``redis`` of redis-server."""

    count: float
    wall: float
    cpu: float
    redis: float

    @property
    def per_s(self) -> float:
        return self.count / self.wall

    @property
    def per_cpu_s(self) -> float:
        return self.count / max(self.cpu, 1e-9)

    @property
    def redis_ms(self) -> float:
        return 1000 * self.redis / self.count


class Clock:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.t, self.c, self.rc = time.perf_counter(), time.process_time(), redis_cpu(r)

    def rate(self, count: float) -> Rate:
        return Rate(count, time.perf_counter() - self.t, time.process_time() - self.c, redis_cpu(self.r) - self.rc)


def median_rate(rates: list[Rate]) -> Rate:
    return sorted(rates, key=lambda x: x.per_cpu_s)[len(rates) // 2]


def publish_initial(r: redis.Redis, keys: Keys) -> None:
    """Version "0", as the trainer announces it at start: the prompt-buffer emits nothing before."""
    from shared.schemas import WeightVersion
    from shared.versionbus import publish_version

    publish_version(r, keys, WeightVersion(version="0", path="/x", step=0, published_at=time.time()))


def prompt_buffer_rate(r: redis.Redis, n_groups: int, n_samples: int) -> Rate:
    from services.prompt_buffer.buffer import PromptBuffer
    from services.prompt_buffer.pacing import PacingPolicy
    from services.prompt_buffer.schedule import Schedule
    from shared.config import PromptBufferConfig
    from shared.tasks.dataset import load_dataset

    rows = load_dataset(str(REPO / "data" / "reverse" / "train.jsonl"))[:n_groups]
    keys = Keys(f"pb{time.monotonic_ns()}")
    publish_initial(r, keys)
    buf = PromptBuffer(r, keys, rows, Schedule(len(rows), 0, 1), PacingPolicy(None, 1, 10_000_000),
                       PromptBufferConfig(n_samples=n_samples, epochs=1), consumer="bench", burst=True)
    clock = Clock(r)
    buf.run()
    rate = clock.rate(r.xlen(keys.prompts))
    assert rate.count == len(rows), f"prompt-buffer produced {rate.count}/{len(rows)}"
    return rate


def worker_rate(r: redis.Redis, n_groups: int, n_samples: int, concurrency: int) -> Rate:
    """Groups/s of one worker process (``n_samples`` trajectories each)."""
    from services.prompt_buffer.buffer import PromptBuffer
    from services.prompt_buffer.pacing import PacingPolicy
    from services.prompt_buffer.schedule import Schedule
    from services.rollout_worker.fake_proxy import FakeProxy, FakeProxyClient
    from services.rollout_worker.runner import GroupRunner
    from services.rollout_worker.worker import RolloutWorker
    from shared.config import PromptBufferConfig, RolloutConfig
    from shared.tasks.dataset import load_dataset

    rows = load_dataset(str(REPO / "data" / "reverse" / "train.jsonl"))[:n_groups]
    keys = Keys(f"rw{time.monotonic_ns()}")
    publish_initial(r, keys)
    PromptBuffer(r, keys, rows, Schedule(len(rows), 0, 1), PacingPolicy(None, 1, 10_000_000),
                 PromptBufferConfig(n_samples=n_samples, epochs=1), consumer="bench", burst=True).run()
    conf = RolloutConfig(concurrency=concurrency, block_ms=10, trajectory_timeout_s=30)
    worker = RolloutWorker(r, keys, conf, GroupRunner(FakeProxyClient(FakeProxy(reply=lambda s, m: "42")), conf,
                                                      "bench"), "bench")
    clock = Clock(r)
    worker.run(burst=True)
    rate = clock.rate(r.xlen(keys.rollouts))
    assert rate.count == len(rows), f"worker handed off {rate.count}/{len(rows)}"
    return rate


def collector_rates(r: redis.Redis, entries: list[dict[str, bytes]], rounds: int) -> Rate:
    out = []
    for k in range(rounds):
        cpu: dict[str, float] = {}
        per_s = collector_rate(r, entries, 4, k, cpu)
        out.append(Rate(len(entries), len(entries) / per_s, cpu["process"], cpu["redis"]))
    return median_rate(out)


def trainer_overhead(r: redis.Redis, url: str, steps: int) -> dict[str, float]:
    """Seconds per step spent outside ``Learner.train_step``, split by phase."""
    sys.path.insert(0, str(REPO / "tests"))
    from trainer_factory import batch_fields, tiny_model, trainer_config

    from services.trainer import loop as loop_mod
    from services.trainer.startup import open_trainer

    tmp = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    keys = Keys(f"tr{time.monotonic_ns()}")
    cfg = trainer_config(tmp, tiny_model(tmp / "model"), url, keys.prefix)
    for i in range(steps):
        r.xadd(keys.batches, batch_fields(f"b{i}"))  # type: ignore[arg-type]
    trainer = open_trainer(cfg, r, with_sinks=False)
    assert isinstance(trainer, loop_mod.TrainerLoop)
    spent: dict[str, float] = {"train": 0.0, "checkpoint": 0.0, "ack": 0.0, "publish": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    trainer.start()  # writes and publishes v0: not part of a step
    trainer.learner.train_step = timed("train", trainer.learner.train_step)  # type: ignore[method-assign]
    trainer._write_checkpoint = timed("checkpoint", trainer._write_checkpoint)  # type: ignore[method-assign]
    trainer._ack = timed("ack", trainer._ack)  # type: ignore[method-assign]
    trainer._publish = timed("publish", trainer._publish)  # type: ignore[method-assign]
    clock = Clock(r)
    trainer.run(burst=True)
    rate = clock.rate(steps)
    assert trainer.learner.step == steps, f"trained {trainer.learner.step}/{steps}"
    out = {k: v / steps for k, v in spent.items()}
    out["outside"] = (rate.wall - spent["train"]) / steps
    out["wall"] = rate.wall / steps
    out["redis_ms"] = rate.redis_ms
    return out


def redis_bytes(r: redis.Redis, n_samples: int, n_tokens: int, n_groups: int) -> tuple[int, float]:
    """(encoded bytes per group, used_memory bytes per group held in a stream)."""
    fields = encode_entry(realistic_group(n_samples=n_samples, n_tokens=n_tokens, prompt_len=min(128, n_tokens // 4)))
    size = sum(len(k) + len(v) for k, v in fields.items())
    stream = f"mem{time.monotonic_ns()}"
    before = int(r.info("memory")["used_memory"])
    for _ in range(n_groups):
        r.xadd(stream, fields)  # type: ignore[arg-type]
    after = int(r.info("memory")["used_memory"])
    r.delete(stream)
    return size, (after - before) / n_groups


def wait_cost(n: int) -> tuple[float, float]:
    """Median ms of one hand-off MULTI (XADD + HINCRBY) on a primary with one replica: without WAIT, with WAIT 1."""
    sys.path.insert(0, str(REPO / "tests"))
    from redistopo import LocalSentinels

    from shared.redisconn import connect

    fields = encode_entry(realistic_group())
    s = LocalSentinels("bench").start()
    try:
        clients = [connect(s.url, wait_replicas=k, wait_timeout_ms=1000) for k in (0, 1)]
        times: list[list[float]] = [[], []]
        for i in range(2 * n):  # interleaved, so both see the same neighbours
            k = i % 2
            t0 = time.perf_counter()
            pipe = clients[k].pipeline(transaction=True)
            pipe.xadd("bench:wait", fields, maxlen=100, approximate=True)  # type: ignore[arg-type]
            pipe.hincrby("bench:stats", "n", 1)
            pipe.execute()
            times[k].append(time.perf_counter() - t0)
        med = [1000 * statistics.median(t) for t in times]
        return med[0], med[1]
    finally:
        s.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer groups and one round (a smoke run)")
    ap.add_argument("--gpu-tokens-per-s", type=float, default=2500.0,
                    help="tokens one GPU generates per second (decode, batched) for the fleet translation")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    n = 40 if args.quick else 200
    print(f"machine: {load_note()} (start)")
    server = RedisProcess(appendonly=False).start()
    try:
        r = redis.Redis(port=server.port)
        pb = median_rate([prompt_buffer_rate(r, n * 5, args.samples) for _ in range(rounds)])
        rw = median_rate([worker_rate(r, n // 2, args.samples, 16) for _ in range(rounds)])
        coll: dict[str, Rate] = {}
        for s, t in ((4, 1024), (8, 1024), (16, 1024), (8, 4096)):
            entries = [encode_entry(realistic_group(group_id=f"g{i}", n_samples=s, n_tokens=t)) for i in range(n // 2)]
            coll[f"{s}x{t}"] = collector_rates(r, entries, rounds)
        big = [encode_entry(realistic_group(group_id=f"g{i}", n_samples=8, n_tokens=32_768, prompt_len=4096))
               for i in range(4 if args.quick else 12)]
        coll["8x32768"] = collector_rates(r, big, 1)
        tr = trainer_overhead(r, server.url, 4 if args.quick else 10)
        mem = {f"{s}x{t}": redis_bytes(r, s, t, 20 if t <= 4096 else 4) for s, t in ((8, 1024), (8, 32_768))}
    finally:
        server.cleanup()
    no_wait, with_wait = wait_cost(50 if args.quick else 300)
    print(f"machine: {load_note()} (end)")
    tokens_per_group = args.samples * args.tokens
    groups_per_gpu = args.gpu_tokens_per_s / tokens_per_group
    c = coll.get(f"{args.samples}x{args.tokens}", coll["8x1024"])
    print(f"\ngroups of {args.samples} x {args.tokens} tokens = {tokens_per_group} tokens; one GPU at "
          f"{args.gpu_tokens_per_s:.0f} tok/s makes {groups_per_gpu:.3f} groups/s")
    print(f"  {'component':28s} {'groups/s wall':>14s} {'groups/CPU-s':>13s} {'Redis CPU-ms/group':>19s} "
          f"{'GPUs per core':>14s}")
    for name, rate in (("prompt-buffer", pb), ("rollout-worker (instant LLM)", rw), ("group-collector", c)):
        print(f"  {name:28s} {rate.per_s:14.1f} {rate.per_cpu_s:13.1f} {rate.redis_ms:19.3f} "
              f"{rate.per_cpu_s / groups_per_gpu:14.0f}")
    print(f"  rollout-worker: {rw.per_s * args.samples:.0f} trajectories/s wall, "
          f"{rw.per_cpu_s * args.samples:.0f} per CPU-second")
    redis_total = pb.redis_ms + rw.redis_ms + c.redis_ms + tr["redis_ms"] / 4  # trainer: 4 groups per step
    print(f"  Redis, every hop of a group: {redis_total:.3f} CPU-ms/group -> one primary saturates at "
          f"{1000 / redis_total:.0f} groups/s = {1000 / redis_total / groups_per_gpu:.0f} GPUs")
    print("\ncollector by group size (samples x tokens): " + ", ".join(
        f"{k}: {v.per_s:.0f}/s wall, {v.per_cpu_s:.0f}/CPU-s, Redis {v.redis_ms:.2f} CPU-ms" for k, v in coll.items()))
    print(f"trainer per step: wall {tr['wall'] * 1000:.1f} ms, train_step {tr['train'] * 1000:.1f} ms, outside "
          f"{tr['outside'] * 1000:.1f} ms (checkpoint {tr['checkpoint'] * 1000:.1f}, ack {tr['ack'] * 1000:.1f}, "
          f"publish {tr['publish'] * 1000:.1f})")
    print(f"hand-off MULTI of one 8x1024 group via Sentinel: {no_wait:.2f} ms median, with WAIT 1 replica "
          f"{with_wait:.2f} ms (+{with_wait - no_wait:.2f} ms)")
    for k, (size, used) in mem.items():
        print(f"redis per group {k}: {size / 1e6:.3f} MB encoded (per hop), {used / 1e6:.3f} MB used_memory in a stream")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
