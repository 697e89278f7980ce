"""Engine throughput against `transformers` `generate` on the same model, in one run.

For each concurrency C in (1, 8, 32): `generate` decodes ROUNDS batches of C prompts (same prompt
length, same max_new_tokens, sampling at temperature 1, no early stop), then the engine (a real
`dressage engine` process, same torch thread count) serves C closed-loop HTTP clients that each
send ROUNDS requests of the same shape. Tokens/s = generated tokens / wall time; the ratio is
engine / generate. The two alternate REPEATS times and the best run of each is reported, so
load from other processes on a shared machine hits both sides alike. At C = 32 the engine also serves aborts (ABORTS requests cut mid-way) and one
weight swap (`/update_weights_from_disk`) during the run; the tokens of aborted requests count as
generated. Target: ratio >= 0.8 at C = 32.

Columns: ``ratio`` = engine / generate tokens per wall second; ``per-CPU-s ratio`` = the same per
CPU second (the engine process's CPU time against this process's during generate), which a
machine shared with other work distorts less; ``core ratio`` = the scheduler alone, in process,
without HTTP, aborts or swaps (what the HTTP layer and arrival spread cost is the difference).

    python bench/engine.py [--threads 1] [--new-tokens 128] [--prompt-len 32] [--hidden 96 --layers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.engine.requests import GenRequest, GenResult  # noqa: E402
from services.engine.runner import ModelRunner  # noqa: E402
from services.engine.sampling import SamplingSpec  # noqa: E402
from services.engine.scheduler import Scheduler  # noqa: E402
from shared.modeling import ModelSpec, build_model_dir, load_model  # noqa: E402

ROUNDS = 2
ABORTS = 4
REPEATS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


def bench_generate(model: Any, c: int, args: argparse.Namespace, vocab: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process)."""
    tokens, t0, c0 = 0, time.perf_counter(), time.process_time()
    for r in range(ROUNDS):
        ids = torch.tensor(prompts(c, args.prompt_len, vocab, seed=r))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, pad_token_id=0)
        tokens += (out.shape[1] - ids.shape[1]) * c
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def bench_core(model: Any, c: int, args: argparse.Namespace, vocab: int) -> float:
    """The batching core alone (no HTTP, no aborts/swaps): the same closed loop, in process."""
    sched = Scheduler(ModelRunner(model), max_batch_size=32, admit_wait_s=0.0)
    rounds = [prompts(c, args.prompt_len, vocab, seed=r) for r in range(ROUNDS)]
    made = [0]

    def submit(i: int, r: int) -> None:
        sampling = SamplingSpec(temperature=1.0, seed=1000 * r + i)
        req = GenRequest(rid=f"{r}-{i}", input_ids=rounds[r][i], max_new_tokens=args.new_tokens, sampling=sampling)
        sched.submit(req, lambda res: done(res, i, r))

    def done(res: GenResult, i: int, r: int) -> None:
        made[0] += len(res.output_ids)
        if r + 1 < ROUNDS:
            submit(i, r + 1)

    t0 = time.perf_counter()
    for i in range(c):
        submit(i, 0)
    while sched.step():
        pass
    return made[0] / (time.perf_counter() - t0)


class Disturber(threading.Thread):
    """At C = 32: abort ABORTS requests after ~25% of the tokens, swap weights after ~50%."""

    def __init__(self, url: str, rids: list[str], total: int, swap_path: Path) -> None:
        super().__init__(daemon=True)
        self.url, self.rids, self.total, self.swap_path = url, rids, total, swap_path
        self.aborted = 0
        self.swapped = False
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            start = c.get("/get_server_info").json()["generated_tokens"]
            while not self.done.is_set():
                made = c.get("/get_server_info").json()["generated_tokens"] - start
                if not self.aborted and made >= self.total // 4:
                    self.aborted = sum(c.post("/abort_request", json={"rid": r}).json()["aborted"] for r in self.rids)
                if not self.swapped and made >= self.total // 2:
                    r = c.post("/update_weights_from_disk", json={"model_path": str(self.swap_path),
                                                                 "weight_version": f"bench-{time.time_ns()}"})
                    self.swapped = r.status_code == 200
                if self.aborted and self.swapped:
                    return
                time.sleep(0.05)


async def bench_engine(client: httpx.AsyncClient, c: int, args: argparse.Namespace, vocab: int,
                       swap_path: Path | None, server: psutil.Process) -> tuple[float, float, dict[str, Any]]:
    """(tokens per wall second, tokens per CPU second of the engine process, notes)."""
    extra: dict[str, Any] = {"finish": {}, "versions": set()}
    tag = time.time_ns()
    bodies = [[{"rid": f"{tag}-c{c}-r{r}-{i}", "input_ids": ids,
                "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True,
                                    "sampling_seed": 1000 * r + i}}
               for i, ids in enumerate(prompts(c, args.prompt_len, vocab, seed=r))] for r in range(ROUNDS)]
    disturber = None
    if swap_path is not None:
        rids = [str(b["rid"]) for b in bodies[0][:ABORTS]]
        disturber = Disturber(str(client.base_url), rids, c * ROUNDS * args.new_tokens, swap_path)

    async def worker(i: int) -> int:
        made = 0
        for r in range(ROUNDS):
            meta = (await client.post("/generate", json=bodies[r][i])).json()["meta_info"]
            kind = meta["finish_reason"]["type"]
            extra["finish"][kind] = extra["finish"].get(kind, 0) + 1
            extra["versions"].update(meta["output_token_versions"])
            made += meta["completion_tokens"]
        return made

    t0, cpu0 = time.perf_counter(), server.cpu_times()
    if disturber is not None:
        disturber.start()
    made = await asyncio.gather(*(worker(i) for i in range(c)))
    elapsed, cpu1 = time.perf_counter() - t0, server.cpu_times()
    if disturber is not None:
        disturber.done.set()
        disturber.join(5)
        extra["aborted"], extra["swapped"] = disturber.aborted, disturber.swapped
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return sum(made) / elapsed, sum(made) / max(cpu, 1e-9), extra


async def bench_level(url: str, c: int, args: argparse.Namespace, vocab: int, model: Any,
                      swap_path: Path | None, server: psutil.Process) -> str:
    """One table row: generate and engine alternate `repeats` times; best of each."""
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        # Open the C keep-alive connections first, as a proxy holding them would have.
        warm = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
        await asyncio.gather(*(client.post("/generate", json=warm) for _ in range(c)))
        gens, engs, cores = [], [], []
        for _ in range(args.repeats):
            gens.append(bench_generate(model, c, args, vocab))
            *eng, extra = await bench_engine(client, c, args, vocab, swap_path, server)
            engs.append(tuple(eng))
            cores.append(bench_core(model, c, args, vocab))
    (gen, gen_cpu), (eng, eng_cpu), core = max(gens), max(engs), max(cores)
    notes = f"finish={extra['finish']}"
    if "aborted" in extra:
        notes += f" aborted={extra['aborted']} swapped={extra['swapped']} versions_in_run={len(extra['versions'])}"
    return (f"{c:>3} {gen:>15.0f} {eng:>13.0f} {eng / gen:>6.2f} {eng_cpu / gen_cpu:>16.2f} "
            f"{core / gen:>11.2f}  {notes}")


def start_engine(model_dir: Path, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "DRESSAGE_ENGINE_NUM_THREADS": str(threads), "DRESSAGE_ENGINE_MAX_BATCH_SIZE": "32"}
    proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--model-path", str(model_dir),
                             "--port", str(port)], cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("engine did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=REPEATS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, swap_dir = Path(tmp) / "model", Path(tmp) / "swap"
        spec = ModelSpec(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                         max_position_embeddings=max(256, args.prompt_len + args.new_tokens + 8))
        build_model_dir(model_dir, "reverse", spec, seed=0)
        model = load_model(model_dir)
        vocab = int(model.config.vocab_size)
        with torch.no_grad():
            for prm in model.parameters():
                prm.add_(0.01 * torch.randn_like(prm))
        model.save_pretrained(swap_dir, safe_serialization=True)
        model = load_model(model_dir)
        proc, url = start_engine(model_dir, args.threads)
        print(f"model: hidden={args.hidden} layers={args.layers} vocab={vocab}; prompt {args.prompt_len} tokens, "
              f"{args.new_tokens} new tokens, {ROUNDS} rounds, torch threads {args.threads}")
        print(f"{'C':>3} {'generate tok/s':>15} {'engine tok/s':>13} {'ratio':>6} {'per-CPU-s ratio':>16} "
              f"{'core ratio':>11}  notes")
        server = psutil.Process(proc.pid)
        try:
            bench_generate(model, 1, args, vocab)  # warm-up (allocator, kernels)
            for c in args.concurrency:
                if c >= 32:  # the same load once undisturbed, for comparison
                    print(asyncio.run(bench_level(url, c, args, vocab, model, None, server)) + " (no aborts/swap)")
                swap = swap_dir if c >= 32 else None
                print(asyncio.run(bench_level(url, c, args, vocab, model, swap, server)), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
