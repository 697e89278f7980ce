"""GPU smoke test: the CUDA path users run, in one command (no network, no SGLang; <= 8 min on one H100).

    python bench/gpu_smoke.py [--device cuda|cpu] [--steps 50] [--work DIR]

Builds the CPU demo's warm-started ``reverse`` model (``dressage up --demo``'s own preparation), then
runs five checks, each printed as one line (``ok`` or ``FAIL``, then its figures), and a last line
``gpu smoke: N/M ok``; the exit code is 1 when a check failed, 2 when ``--device cuda`` finds no GPU.

1. ``trainer``: learner steps on the device under ``train.precision: bf16-mixed``, then the checkpoint
   the engines load, written by the trainer's own writer (bf16);
2. ``precision``: the share of weights 10 steps at lr 1e-6 change, bf16 weights without a master copy
   (``bf16-pure``) against fp32 master weights (``bf16-mixed``);
3. ``logprobs``: the trainer's token logprobs on the device (fp32 and bf16-mixed) against the
   project's engine's (``ModelRunner.prefill`` on CPU in fp32) for that checkpoint, read from the
   trainer's own ``train/train_rollout_logprob_abs_diff``;
4. ``serving``: starts the run of check 5; once its proxy answers, one chat completion with logprobs
   over HTTP through ``dressage proxy`` to ``dressage engine`` on the device;
5. ``e2e``: that ``dressage up`` of ``configs/cpu-demo.yaml`` on the device, ``--steps`` trainer steps;
   it must end on its own, every step trained, and the policy must have learned: the loss of the held-out
   reference answers (the demonstrations of ``eval.dataset``, teacher-forced, paired prompt by prompt) is
   lower under the last checkpoint than under version 0. The sampled reward of the first and last quarter
   of the steps is printed beside it; it is not the criterion, being too noisy over a few dozen steps (one
   30-step run on CPU: reward 0.507 -> 0.504 while the held-out loss fell 0.624 -> 0.482).

``--device cpu`` runs the same checks on the CPU (the test suite does, with fewer ``--steps``), so the
script cannot rot on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import httpx  # noqa: E402
import torch  # noqa: E402
from trainer_factory import batch, changed_fraction  # noqa: E402
from waits import wait_for  # noqa: E402

from services.engine.runner import ModelRunner  # noqa: E402
from services.trainer.learner import Learner  # noqa: E402
from services.trainer.modeldir import ModelDirWriter  # noqa: E402
from shared.config import TrainConfig, load_config  # noqa: E402
from shared.modeling import load_model, load_tokenizer, pad_token_id  # noqa: E402
from shared.modeling.warmstart import demonstration_examples, sequence_loss  # noqa: E402
from shared.precision import Precision  # noqa: E402
from shared.schemas import Batch  # noqa: E402
from shared.tasks import get_task, scan_dataset  # noqa: E402
from tools.deploy.plan import http_ok  # noqa: E402
from tools.deploy.supervisor import tail_lines  # noqa: E402
from tools.deploy.up import prepare_demo  # noqa: E402
from tools.reports.metricslog import load_rows  # noqa: E402

CONFIG = REPO / "configs" / "cpu-demo.yaml"
HELDOUT_ROWS = 256  # held-out prompts whose reference answers the e2e check scores before and after
GPU_LR = 1e-6  # configs/gpu.yaml's learning rate
PARITY: dict[Precision, float] = {"fp32": 1e-3, "bf16-mixed": 0.05}  # largest mean |trainer - engine| logprob
Check = Callable[[], tuple[bool, str]]


def settings(device: str, work: Path) -> dict[str, str]:
    """The demo config pointed at this device and work folder (env overrides every process reads)."""
    cuda = device.startswith("cuda")
    return {"DRESSAGE_MODEL_PATH": str(work / "model"), "DRESSAGE_TRAIN_DEVICE": device,
            "DRESSAGE_TRAIN_PRECISION": "bf16-mixed", "DRESSAGE_ENGINE_DEVICE": device,
            "DRESSAGE_ENGINE_DTYPE": "bfloat16" if cuda else "float32", "DRESSAGE_EVAL_DEVICE": device,
            # on the CPU evaluation would only take cores from the run it measures
            "DRESSAGE_EVAL_EVERY_VERSIONS": "10" if cuda else "0", "DRESSAGE_OPS_RUN_DIR": str(work / "runs")}


def check_trainer(device: str, work: Path, steps: int = 5) -> tuple[bool, str]:
    model_dir, out = work / "model", work / "checkpoint"
    learner = Learner(load_model(model_dir, device=device), TrainConfig(precision="bf16-mixed", lr=2e-4), pad_id=0)
    t0 = time.perf_counter()
    metrics = [learner.train_step([batch(f"t{i}", n_groups=8)]) for i in range(steps)]
    ms = (time.perf_counter() - t0) / steps * 1000
    weights, _ = learner.export()
    out.mkdir()
    ModelDirWriter(learner.model, load_tokenizer(model_dir)).write(out, weights)
    saved = {t.dtype for t in load_model(out, dtype="bfloat16").state_dict().values()}
    finite = all(math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"]) for m in metrics)
    published = {t.dtype for t in weights.values()} if weights is not None else set()
    ok = finite and not any(m["train/skipped_nonfinite"] for m in metrics) and published == {torch.bfloat16}
    return ok, (f"{steps} bf16-mixed steps on {device}, {ms:.0f} ms/step, grad norm "
                f"{metrics[-1]['train/grad_norm']:.3f}; checkpoint {sorted(map(str, saved))}")


def check_precision(device: str) -> tuple[bool, str]:
    pure = TrainConfig(precision="bf16-pure").model_copy(update={"lr": GPU_LR})  # refused at start: shown, not run
    lost = changed_fraction(pure, steps=10, device=device)
    kept = changed_fraction(TrainConfig(precision="bf16-mixed", lr=GPU_LR), steps=10, device=device)
    return kept > 0.99 and lost < 0.1, (f"weights changed by 10 steps at lr {GPU_LR:g}: bf16-pure {lost:.2%}, "
                                        f"bf16-mixed (fp32 master) {kept:.2%}")


def engine_logprobs(model_dir: Path, b: Batch) -> Batch:
    """``b`` with every sample's behaviour logprobs computed by the engine's runner (CPU, fp32)."""
    runner = ModelRunner(load_model(model_dir, dtype="float32"))
    samples = [s for g in b.groups for s in g.samples]
    out = runner.prefill([s.token_ids for s in samples], logprob_rows=range(len(samples)))
    assert out.logprobs is not None
    for s, lps in zip(samples, out.logprobs, strict=True):
        s.logprobs = [lp * m for lp, m in zip([0.0, *lps], s.loss_mask, strict=True)]
    return b


def check_logprobs(device: str, work: Path) -> tuple[bool, str]:
    ckpt = work / "checkpoint"
    b = engine_logprobs(ckpt, batch("parity", n_groups=8))
    diffs = {}
    for precision in PARITY:
        learner = Learner(load_model(ckpt, device=device), TrainConfig(precision=precision), pad_id=0)
        diffs[precision] = learner.train_step([b])["train/train_rollout_logprob_abs_diff"]
    ok = all(diffs[p] < bound for p, bound in PARITY.items())
    return ok, f"mean |trainer on {device} - engine on cpu| " + ", ".join(f"{p} {d:.2e}" for p, d in diffs.items())


class Run:
    """The end-to-end ``dressage up`` run, started by ``serving`` and awaited by ``e2e``."""

    def __init__(self, work: Path, steps: int) -> None:
        self.dir, self.steps, self.log = work / "up", steps, work / "up.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "services", "up", "--config", str(CONFIG),
                                          "--max-steps", str(steps), "--run-dir", str(self.dir), "--quiet",
                                          "--no-report"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return tail_lines(self.log)

    def proxy_url(self, timeout: float) -> str:
        """The run's proxy, once it answers /health (run.json names its port before it starts)."""
        info = wait_for(lambda: (self.dir / "run.json").is_file() and json.loads((self.dir / "run.json").read_text()),
                        timeout, "run.json of dressage up", self.tail, process=self.proc, period=0.2,
                        ignore=(json.JSONDecodeError,))
        url = f"http://{load_config(CONFIG).proxy.host}:{info['proxy_port']}"
        wait_for(http_ok(f"{url}/health"), timeout, "the run's proxy /health", self.tail, process=self.proc,
                 period=0.5)
        return url


def check_serving(device: str, run: Run) -> tuple[bool, str]:
    url = run.proxy_url(timeout=load_config(CONFIG).ops.ready_timeout_s * 2)  # the engine, then the proxy
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "reverse 479256"}], "max_tokens": 16, "logprobs": True})
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return False, f"HTTP {r.status_code}: {r.text[:200]}"
    choice = r.json()["choices"][0]
    lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    ok = bool(lps) and all(math.isfinite(x) and x <= 0 for x in lps)
    return ok, (f"engine on {device} behind the proxy of the e2e run: HTTP 200 in {seconds:.2f}s, {len(lps)} "
                f"tokens {choice['message']['content']!r}, mean logprob {sum(lps) / max(len(lps), 1):.2f}")


def heldout_losses(checkpoints: Sequence[Path], n_rows: int = HELDOUT_ROWS) -> list[float]:
    """Mean next-token loss of the demo's held-out reference answers under each checkpoint (CPU, no gradient).
    The checkpoints of one run share their tokenizer: the answers are tokenized once, from the first."""
    cfg = load_config(CONFIG)
    rows = scan_dataset(REPO / cfg.eval.dataset, task=cfg.model.task).rows[:n_rows]
    tokenizer = load_tokenizer(checkpoints[0])
    examples = demonstration_examples(get_task(cfg.model.task), rows, tokenizer)
    with torch.no_grad():
        return [float(sequence_loss(load_model(c, device="cpu"), examples, pad_id=pad_token_id(tokenizer)))
                for c in checkpoints]


def check_e2e(device: str, run: Run) -> tuple[bool, str]:
    t0 = time.perf_counter()
    try:
        code = run.proc.wait(timeout=120 + 8 * run.steps)
    except subprocess.TimeoutExpired:
        run.proc.terminate()  # dressage up stops its services on SIGTERM
        run.proc.wait(60)
        return False, f"dressage up still running after {time.perf_counter() - t0:.0f}s:\n{run.tail()}"
    if code != 0:
        return False, f"dressage up exited {code}:\n{run.tail()}"
    rows = load_rows(run.dir / "metrics.jsonl")
    rewards = [float(r["train/reward_mean"]) for r in rows if r.get("service") == "trainer" and "train/step" in r]
    k = max(1, len(rewards) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    versions = sorted(p for p in (run.dir / "checkpoints").glob("v*") if p.name[1:].isdigit())
    if len(versions) < 2:
        return False, f"{len(versions)} checkpoint(s) in {run.dir / 'checkpoints'}: version 0 and the last are needed"
    before, after = heldout_losses([versions[0], versions[-1]])
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    evals = f", eval accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}" if accuracy else ""
    return len(rewards) == run.steps and after < before, (
        f"{len(rewards)} steps on {device}, held-out answer loss {versions[0].name} {before:.3f} -> "
        f"{versions[-1].name} {after:.3f}; reward first {k} steps {first:.3f} -> last {k} {last:.3f}{evals}")


def run_checks(checks: dict[str, Check]) -> int:
    """Run every check, one line each; the number that passed."""
    passed = 0
    for name, check in checks.items():
        t0 = time.perf_counter()
        try:
            ok, figures = check()
        except Exception as exc:  # a broken check is reported as FAIL and the others still run
            ok, figures = False, f"{type(exc).__name__}: {exc}"
        passed += ok
        head, *detail = figures.splitlines() or [""]  # a failure's log tail follows its line, indented
        sys.stdout.write(f"{'ok' if ok else 'FAIL'} {name} ({time.perf_counter() - t0:.0f}s): {head}\n"
                         + "".join(f"    {line}\n" for line in detail))
        sys.stdout.flush()
    return passed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--steps", type=int, default=50, help="trainer steps of the end-to-end run (>= 4)")
    ap.add_argument("--work", help="work folder, kept (default: a temporary one, removed)")
    args = ap.parse_args()
    if args.steps < 4:
        ap.error("--steps must be at least 4 (a quarter of the steps is compared with the last quarter)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.stderr.write("gpu smoke: no CUDA device here (run with --device cpu)\n")
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        work = Path(args.work or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        os.environ.update(settings(args.device, work))
        os.chdir(REPO)  # the demo config's data paths are relative to the repository
        if args.device == "cpu":
            torch.set_num_threads(1)  # tiny models: more threads only contend with the services' processes
        device, runs = args.device, []

        def serving() -> tuple[bool, str]:
            runs.append(Run(work, args.steps))  # after the in-process checks: they are timed alone
            return check_serving(device, runs[0])

        checks: dict[str, Check] = {
            "trainer": lambda: check_trainer(device, work),
            "precision": lambda: check_precision(device),
            "logprobs": lambda: check_logprobs(device, work),
            "serving": serving,
            "e2e": lambda: check_e2e(device, runs[0]) if runs else (False, "the run did not start"),
        }
        try:
            prepare_demo(load_config(CONFIG), work / "logs")
        except RuntimeError as exc:  # init-model or make-data failed: no check can run
            sys.stdout.write(f"FAIL prepare: {exc}\ngpu smoke: 0/{len(checks)} ok\n")
            return 1
        try:
            passed = run_checks(checks)
        finally:
            for run in runs:  # a failed check leaves no process behind
                if run.proc.poll() is None:
                    run.proc.terminate()
                    run.proc.wait(60)
    sys.stdout.write(f"gpu smoke: {passed}/{len(checks)} ok\n")
    return 0 if passed == len(checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
