"""Engine throughput against `transformers` `generate` on the same model, in one run.

For each concurrency C in (1, 8, 32): `generate` decodes ROUNDS batches of C prompts (same prompt
length, same max_new_tokens, sampling at temperature 1, no early stop), then the engine (a real
`dressage engine` process, same torch thread count) serves C closed-loop HTTP clients that each
send ROUNDS requests of the same shape over a kept-alive connection (a lean asyncio client:
httpx would spread 32 "simultaneous" arrivals over ~100 decode steps on a busy 2-core box and
measure itself). Tokens/s = generated tokens / wall time; ratio = engine / generate. The sides
alternate `--repeats` times and the best run of each is reported, so load from other processes
on a shared machine hits both alike. C = 32 runs twice: undisturbed, then while the engine also
serves ABORTS aborts (after ~25% of the tokens) and one `/update_weights_from_disk` (after ~50%);
tokens of aborted requests count as generated. Target: ratio >= 0.8 at C = 32 with disturbances.

Columns: ``ratio`` = engine / generate tokens per wall second; ``per-CPU-s ratio`` = the same per
CPU second (the engine process's CPU time against this process's during generate), which a
machine shared with other work distorts less; ``core ratio`` = the scheduler alone, in process,
without HTTP, aborts or swaps (the difference is what HTTP serving costs).

    python bench/engine.py [--threads 1] [--new-tokens 128] [--prompt-len 32] [--hidden 96 --layers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
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


class RawClient:
    """Minimal HTTP/1.1 keep-alive JSON client on asyncio streams.

    httpx costs milliseconds of CPU per request on a busy 2-core machine, enough to spread 32
    "simultaneous" requests over ~100 decode steps; this load generator keeps that cost out of
    the measurement (the proxy holds keep-alive connections the same way).
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> dict[str, Any]:
        try:
            return await self._request(method, path, body)
        except (asyncio.IncompleteReadError, ConnectionError):
            # The server closed an idle keep-alive connection (uvicorn: after 5 s); reconnect once.
            self.close()
            return await self._request(method, path, body)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        data = json.dumps(body).encode() if body is not None else b""
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        payload = json.loads(await reader.readexactly(length))
        if status != 200:
            raise RuntimeError(f"{method} {path} -> {status}: {payload}")
        return dict(payload)

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


async def disturb(client: RawClient, rids: list[str], total: int, swap_path: Path, notes: dict[str, Any]) -> None:
    """At C = 32: abort the requests `rids` after ~25% of `total` tokens, swap weights after ~50%."""
    async def made() -> int:
        return int((await client.post("/get_server_info", method="GET"))["generated_tokens"])

    start = await made()
    notes["aborted"], notes["swapped"] = 0, False
    while not (notes["aborted"] and notes["swapped"]):
        n = await made() - start
        if not notes["aborted"] and n >= total // 4:
            for rid in rids:
                notes["aborted"] += (await client.post("/abort_request", {"rid": rid}))["aborted"]
        if not notes["swapped"] and n >= total // 2:
            body = {"model_path": str(swap_path), "weight_version": f"bench-{time.time_ns()}"}
            notes["swapped"] = (await client.post("/update_weights_from_disk", body))["success"]
        await asyncio.sleep(0.05)


async def bench_engine(clients: list[RawClient], control: RawClient, c: int, args: argparse.Namespace, vocab: int,
                       swap_path: Path | None, server: psutil.Process) -> tuple[float, float, dict[str, Any]]:
    """(tokens per wall second, tokens per CPU second of the engine process, notes)."""
    extra: dict[str, Any] = {"finish": {}, "versions": set()}
    tag = time.time_ns()
    bodies = [[{"rid": f"{tag}-c{c}-r{r}-{i}", "input_ids": ids,
                "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True,
                                    "sampling_seed": 1000 * r + i}}
               for i, ids in enumerate(prompts(c, args.prompt_len, vocab, seed=r))] for r in range(ROUNDS)]
    disturber: asyncio.Task[None] | None = None

    async def worker(i: int) -> int:
        made = 0
        for r in range(ROUNDS):
            meta = (await clients[i].post("/generate", bodies[r][i]))["meta_info"]
            kind = meta["finish_reason"]["type"]
            extra["finish"][kind] = extra["finish"].get(kind, 0) + 1
            extra["versions"].update(meta["output_token_versions"])
            made += meta["completion_tokens"]
        return made

    t0, cpu0 = time.perf_counter(), server.cpu_times()
    if swap_path is not None:
        rids = [str(b["rid"]) for b in bodies[0][:ABORTS]]
        disturber = asyncio.create_task(disturb(control, rids, c * ROUNDS * args.new_tokens, swap_path, extra))
    made = await asyncio.gather(*(worker(i) for i in range(c)))
    elapsed, cpu1 = time.perf_counter() - t0, server.cpu_times()
    if disturber is not None:
        disturber.cancel()
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return sum(made) / elapsed, sum(made) / max(cpu, 1e-9), extra


async def bench_level(url: str, c: int, args: argparse.Namespace, vocab: int, model: Any,
                      swap_path: Path | None, server: psutil.Process) -> str:
    """One table row: generate and engine alternate `repeats` times; best of each."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    clients = [RawClient(host, int(port)) for _ in range(c)]
    control = RawClient(host, int(port))  # aborts, weight swap, progress polls
    # Open the C keep-alive connections first, as a proxy holding them would have.
    warm = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
    await asyncio.gather(*(cl.post("/generate", warm) for cl in clients))
    gens, engs, cores = [], [], []
    for _ in range(args.repeats):
        gens.append(bench_generate(model, c, args, vocab))
        *eng, extra = await bench_engine(clients, control, c, args, vocab, swap_path, server)
        engs.append(tuple(eng))
        cores.append(bench_core(model, c, args, vocab))
    for cl in [*clients, control]:
        cl.close()
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
