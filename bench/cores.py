"""How much two processes computing at once get done on this machine, against one alone: the
ceiling of any speed-up from overlapping rollout with training (bench/async_speedup.py).

Asynchronous RL wins by running the engine's forward passes and the trainer's steps at the same
time on different cores. That pays only if two processes computing at once finish about twice
the work of one. On a VM whose "cores" are hyperthreads of one physical core, or share its vector
units, they do not. Measured here, each workload for ``--seconds`` in 1 process, then in 2 at once
(each pinned to nothing, one torch thread each, as the services run), in alternating rounds:

* ``demo-model train step``: forward + backward + AdamW of the CPU demo's model (Qwen3
  architecture, 96 wide, 2 layers) on a batch like the demo's (32 sequences x 32 tokens) — what the
  trainer does;
* ``demo-model forward``: a no-grad forward of the same model on 32 sequences — what the engine does;
* ``python loop``: plain interpreter work (no torch) — what the proxy, workers and Redis clients do.

The printed ratio is (work done by 2 processes together) / (work done by 1 alone), median over
rounds: 2.0 means the second core is a whole core, 1.0 means it adds nothing. Its last line::

    2 processes / 1: train step R1x, forward R2x, python loop R3x

    python bench/cores.py [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKLOADS = ("train", "forward", "python")
LABELS = {"train": "demo-model train step", "forward": "demo-model forward", "python": "python loop"}


def _work(kind: str, seconds: float, start: Any, out: Any) -> None:
    """Repeat one unit of ``kind`` for ``seconds`` after ``start`` is set; put the count in ``out``."""
    import torch

    from shared.modeling import ModelSpec, build_model

    torch.set_num_threads(1)
    model = build_model(ModelSpec(), 100, 0, 1)
    ids = torch.randint(2, 100, (32, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if kind == "train":
        model.train()

    def unit() -> None:
        if kind == "train":
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        elif kind == "forward":
            with torch.no_grad():
                model(input_ids=ids)
        else:
            n = 0
            for i in range(20_000):
                n += i * i % 7

    unit()  # warm up before the clock starts
    start.wait()
    t0, count = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        unit()
        count += 1
    out.put(count / (time.perf_counter() - t0))


def throughput(kind: str, procs: int, seconds: float) -> float:
    """Units per second of ``procs`` processes of ``kind`` running at once, summed."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=_work, args=(kind, seconds, start, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    time.sleep(3.0)  # imports and model builds, before the common start
    start.set()
    total = sum(out.get(timeout=120 + seconds) for _ in ps)
    for p in ps:
        p.join(30)
    return float(total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    ratios: dict[str, list[float]] = {k: [] for k in WORKLOADS}
    print(f"{'workload':24s} {'round':>5s} {'1 alone (/s)':>13s} {'2 at once (/s)':>15s} {'ratio':>6s}")
    for r in range(args.rounds):
        for kind in WORKLOADS:
            one = throughput(kind, 1, args.seconds)
            two = throughput(kind, 2, args.seconds)
            ratios[kind].append(two / one)
            print(f"{LABELS[kind]:24s} {r:5d} {one:13.1f} {two:15.1f} {two / one:6.2f}")
    med = {k: statistics.median(v) for k, v in ratios.items()}
    print(f"2 processes / 1: train step {med['train']:.2f}x, forward {med['forward']:.2f}x, "
          f"python loop {med['python']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
