"""Continuous batching core: requests join and leave one running batch between forward passes.

Invariants:

* Only the scheduler thread touches the model, the KV cache and request state. Other threads
  call `submit`, `abort`, `pause`, `resume` and `swap_weights`, which only enqueue a command;
  commands run between two forward passes.
* A weight swap happens only between two forward passes (never inside one token). Every output
  token carries the version of the weights that produced it (`GenResult.output_versions`);
  `GenResult.weight_version` is the version of the last token.
* SGLang's update semantics: a requested swap waits until no running request is *pinned*
  (``continue_across_weight_updates`` false, the default) and admits nobody meanwhile, so a
  pinned request's tokens all have one version. Requests that opted in keep their KV cache
  (computed with the old weights, as SGLang does) and go on with the new ones. While paused a
  swap applies at once (as SGLang's update during ``pause_generation``).
* Every submitted request finishes exactly once (stop, length or abort) and its callback runs
  exactly once, on the scheduler thread. An aborted request returns the tokens produced so far.
* A rid is live from `submit` until its callback runs; submitting a live rid raises
  `DuplicateRequest` at once.
* While paused no forward pass runs and new requests wait; pausing in mode "abort" first aborts
  every request then in the engine (running or waiting). Modes "in_place" and "retract" keep
  them: their KV stays in memory and they continue after `resume`.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from services.engine.batch import Finished, RunningBatch, Seq
from services.engine.requests import (
    DoneCallback,
    DuplicateRequest,
    EngineBusy,
    GenRequest,
    GenResult,
    InvalidRequest,
    ProgressCallback,
    abort_reason,
)
from services.engine.runner import ModelRunner

log = logging.getLogger(__name__)
T = TypeVar("T")
PauseMode = Literal["abort", "in_place", "retract"]
THROUGHPUT_WINDOW_S = 5.0  # gen_throughput: tokens per second over this trailing window


@dataclass
class _Swap:
    state: dict[str, torch.Tensor]
    version: str
    model_path: str
    done: Future[int]
    aborted: int = 0


class Scheduler:
    """See the module docstring. Drive it with `start()` (own thread) or `step()` (tests)."""

    def __init__(self, runner: ModelRunner, *, weight_version: str = "0", model_path: str = "",
                 max_batch_size: int = 32, max_queue: int = 1024, max_prefill_tokens: int = 8192,
                 seed: int = 0, admit_wait_s: float = 0.005) -> None:
        self.runner = runner
        self.weight_version = weight_version
        self.model_path = model_path
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.admit_wait_s = admit_wait_s  # arrivals gather this long to share one prefill pass
        self.paused = False
        # "requests": generation requests accepted (queued) since start, for exactly-once checks under load.
        self.stats: dict[str, float] = {"prefills": 0, "decode_steps": 0, "generated_tokens": 0, "aborted": 0,
                                        "swaps": 0, "busy_s": 0.0, "requests": 0, "prompt_tokens": 0,
                                        "finished": 0}
        self._swaps: deque[_Swap] = deque()  # requested, waiting for pinned requests to finish
        self._rate: deque[tuple[float, float]] = deque()  # (monotonic time, generated tokens)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._waiting: deque[Seq] = deque()
        self._joining: list[Seq] = []  # admitted, being prefilled: in neither _waiting nor the batch yet
        self.batch = RunningBatch(runner, random.Random(seed))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- thread-safe API -------------------------------------------------------------------
    def submit(self, req: GenRequest, on_done: DoneCallback, on_progress: ProgressCallback | None = None) -> None:
        """Queue `req`; raises InvalidRequest, DuplicateRequest or EngineBusy without queueing.

        `on_progress` (streaming) runs on the scheduler thread after each token of `req`.
        """
        self._validate(req)
        budget = min(req.max_new_tokens, self.runner.context_len - len(req.input_ids))
        with self._lock:
            if self._stop.is_set():
                raise EngineBusy("the engine is shutting down")
            if req.rid in self._live:
                raise DuplicateRequest(f"rid {req.rid!r} is already in flight")
            if len(self._live) >= self.max_batch_size + self.max_queue:
                raise EngineBusy(f"{len(self._live)} requests in the engine (max_queue={self.max_queue})")
            self._live.add(req.rid)
            self.stats["requests"] += 1
            self.stats["prompt_tokens"] += len(req.input_ids)
        seq = Seq(req, on_done, budget, on_progress=on_progress)
        self._commands.put(lambda: self._waiting.append(seq))

    def abort(self, rid: str, message: str = "aborted by request") -> Future[bool]:
        """Abort `rid` (True if it was in the engine)."""
        return self._call(lambda: self._abort(lambda s: s.req.rid == rid, message) > 0)

    def abort_all(self, message: str = "aborted by request") -> Future[int]:
        return self._call(lambda: self._abort(lambda s: True, message))

    def pause(self, mode: PauseMode = "abort") -> Future[int]:
        """Stop forward passes; in mode "abort" abort every request first. Returns how many."""
        def run() -> int:
            n = self._abort(lambda s: True, "aborted by pause_generation") if mode == "abort" else 0
            self.paused = True
            log.info("paused mode=%s aborted=%d version=%s", mode, n, self.weight_version)
            return n
        return self._call(run)

    def resume(self) -> Future[None]:
        def run() -> None:
            self.paused = False
            log.info("continued version=%s", self.weight_version)
        return self._call(run)

    def swap_weights(self, state: dict[str, torch.Tensor], version: str, model_path: str,
                     abort_all: bool = False) -> Future[int]:
        """Load checked `state` once no pinned request runs (at once while paused).

        Returns the number of requests aborted (`abort_all`); the future resolves after the swap.
        """
        done: Future[int] = Future()

        def run() -> None:
            n = self._abort(lambda s: True, "aborted by weight update") if abort_all else 0
            self._swaps.append(_Swap(state, version, model_path, done, n))
            self._apply_swaps()
        self._commands.put(run)
        return done

    def _apply_swaps(self) -> None:
        """Apply requested swaps, in order, when no pinned request is running (or when paused)."""
        while self._swaps and (self.paused or not any(not s.req.continue_across_weight_updates
                                                      for s in self.batch.rows)):
            sw = self._swaps.popleft()
            try:
                self.runner.load_state(sw.state)
            except Exception as exc:  # handed to the caller; the old weights keep serving
                sw.done.set_exception(exc)
                continue
            old, self.weight_version, self.model_path = self.weight_version, sw.version, sw.model_path
            self.stats["swaps"] += 1
            log.info("weights swapped version=%s previous=%s path=%s running=%d", sw.version, old,
                     sw.model_path, len(self.batch))
            sw.done.set_result(sw.aborted)

    @property
    def swap_pending(self) -> bool:
        return bool(self._swaps)

    def gen_throughput(self) -> float:
        """Generated tokens per second over the last `THROUGHPUT_WINDOW_S` (0 when idle)."""
        now, total = time.monotonic(), float(self.batch.generated)
        rate = self._rate
        if not rate or now - rate[-1][0] > 0.2:
            rate.append((now, total))
        while len(rate) > 1 and now - rate[0][0] > THROUGHPUT_WINDOW_S:
            rate.popleft()
        t0, g0 = rate[0]
        return (total - g0) / (now - t0) if now - t0 > 0.05 else 0.0

    def waiting_tokens(self) -> int:
        """Prompt tokens of the requests waiting for a prefill."""
        return sum(len(s.req.input_ids) for s in list(self._waiting))

    def kv_tokens(self) -> int:
        """Tokens held in the running batch's KV cache (prompt + output of every running row)."""
        return sum(len(s.req.input_ids) + len(s.out) for s in list(self.batch.rows))

    def counts(self) -> dict[str, Any]:
        """Requests running and waiting (a prefill still counts as waiting, as in SGLang's queue).

        Read from other threads without a lock while the scheduler moves a request from the queue to the
        joiners to the batch, listing it in both places for an instant at each move. So the three are read
        in that order and each request counted once: one present throughout is counted exactly once (a
        double count made /get_load report an engine busier than it was, and a balancer skip it)."""
        waiting, joining, rows = list(self._waiting), list(self._joining), list(self.batch.rows)
        running = {id(s) for s in rows}
        queued = {id(s) for s in waiting} | {id(s) for s in joining}
        return {"running": len(running), "waiting": len(queued - running), "paused": self.paused,
                "swaps_pending": len(self._swaps), "weight_version": self.weight_version, **self.stats}

    # ----- thread ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while the scheduler thread runs (also True when driven by `step()` in tests)."""
        return self._thread is None or self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)  # wake an idle loop
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            try:
                if not self.step():
                    cmd = self._get_command(timeout=0.5)  # idle: sleep until a command arrives
                    if cmd is not None:
                        cmd()
                        self._gather_burst()
            except Exception:  # a failing forward must not hang its callers: fail them, go on
                log.exception("engine step failed; aborting %d running requests", len(self.batch))
                for seq in self.batch.remove(range(len(self.batch))):
                    self._finish(seq, abort_reason("engine error"))
        self._drain()
        self._abort(lambda s: True, "engine shutting down")
        while self._swaps:  # nobody waits forever on a swap that will not happen
            self._swaps.popleft().done.set_exception(EngineBusy("the engine is shutting down"))

    def _gather_burst(self) -> None:
        """After idling, take the commands that arrive within `admit_wait_s` before computing.

        Requests come in bursts (a group's samples, a proxy resuming after a weight update);
        prefilling the burst together costs one forward pass instead of one per request.
        """
        deadline = time.monotonic() + self.admit_wait_s
        while (left := deadline - time.monotonic()) > 0 and (cmd := self._get_command(left)) is not None:
            cmd()

    def _get_command(self, timeout: float) -> Callable[[], None] | None:
        try:
            return self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return None

    # ----- one iteration ----------------------------------------------------------------------
    def step(self) -> bool:
        """Run pending commands, admit and prefill joiners, decode one token.

        Returns False when there is nothing to do (idle or paused), so ``while s.step(): pass``
        is the burst mode: it returns once every submitted request has finished.
        """
        self._drain()
        self._apply_swaps()
        if self.paused:
            return False
        t0 = time.perf_counter()
        joiners = [] if self._swaps else self._admit()  # a pending swap admits nobody (SGLang's lock)
        if joiners:
            self.stats["prefills"] += 1
            try:
                self._finish_all(self.batch.join(joiners, self.weight_version))
            except Exception:  # the running rows are untouched: fail only the joiners
                log.exception("prefill of %d joiners failed rids=%s", len(joiners), [s.req.rid for s in joiners])
                kept = {id(s) for s in self.batch.rows}
                for s in joiners:
                    if id(s) not in kept:
                        self._finish(s, abort_reason("engine error"))
        self._joining = []
        if self.batch:
            self.stats["decode_steps"] += 1
            self._finish_all(self.batch.decode(self.weight_version))
        self._progress()
        self._apply_swaps()
        self.stats["generated_tokens"] = self.batch.generated
        self.stats["busy_s"] += time.perf_counter() - t0  # wall time spent computing
        return bool(joiners or self.batch or self._waiting)

    def _progress(self) -> None:
        """Tell streaming requests still running about their tokens so far."""
        for seq in self.batch.rows:
            if seq.on_progress is not None:
                try:
                    seq.on_progress(self._result(seq, {}))
                except Exception:  # a broken stream must not take the batch down
                    log.exception("on_progress callback failed rid=%s", seq.req.rid)

    def _drain(self) -> None:
        while (cmd := self._get_command(timeout=0)) is not None:
            cmd()

    def _call(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except Exception as exc:  # handed to the caller through the future
                fut.set_exception(exc)
        self._commands.put(run)
        return fut

    def _validate(self, req: GenRequest) -> None:
        if not req.input_ids:
            raise InvalidRequest("input_ids", "must not be empty")
        vocab = self.runner.vocab_size
        bad = next((i for i, t in enumerate(req.input_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"input_ids[{bad}]", f"{req.input_ids[bad]} is outside the vocabulary 0..{vocab - 1}")
        if len(req.input_ids) >= self.runner.context_len:
            raise InvalidRequest("input_ids", f"{len(req.input_ids)} tokens leave no room in the "
                                              f"context of {self.runner.context_len}")

    def _admit(self) -> list[Seq]:
        free = self.max_batch_size - len(self.batch)
        if (self.batch and self._waiting and len(self._waiting) < free
                and time.monotonic() - self._waiting[0].arrived < self.admit_wait_s):
            # A running batch lets a trickle of arrivals gather for up to admit_wait_s, so
            # they cost one prefill pass instead of one each (the batch keeps decoding meanwhile).
            return []
        joiners: list[Seq] = []
        self._joining = joiners  # the same list: what is appended below is visible to counts() at once
        widest = 0
        while self._waiting and len(self.batch) + len(joiners) < self.max_batch_size:
            n = len(self._waiting[0].req.input_ids)
            if joiners and max(widest, n) * (len(joiners) + 1) > self.max_prefill_tokens:
                break
            widest = max(widest, n)
            joiners.append(self._waiting[0])  # listed before it leaves the queue: never counted in neither
            self._waiting.popleft()
        return joiners

    def _abort(self, match: Callable[[Seq], bool], message: str) -> int:
        reason = abort_reason(message)
        waiting = [s for s in self._waiting if match(s)]
        for s in waiting:
            self._waiting.remove(s)
            self._finish(s, reason)
        running = self.batch.remove(i for i, s in enumerate(self.batch.rows) if match(s))
        for s in running:
            self._finish(s, reason)
        self.stats["aborted"] += len(waiting) + len(running)
        return len(waiting) + len(running)

    def _finish_all(self, finished: Finished) -> None:
        for seq, reason in finished:
            self._finish(seq, reason)

    def _result(self, s: Seq, reason: dict[str, Any]) -> GenResult:
        """`s` as a result; lists are copies, so a streamed snapshot never changes under its reader."""
        return GenResult(
            rid=s.req.rid, prompt_tokens=len(s.req.input_ids), output_ids=list(s.out),
            output_logprobs=list(s.logprobs), output_versions=list(s.versions), finish_reason=reason,
            weight_version=s.versions[-1] if s.versions else self.weight_version,
            input_logprobs=s.input_logprobs,
            output_top_logprobs=None if s.top is None else list(s.top),
            output_token_ids_logprobs=None if s.ids_lp is None else list(s.ids_lp),
            input_top_logprobs=s.input_top, input_token_ids_logprobs=s.input_ids_lp,
        )

    def _finish(self, s: Seq, reason: dict[str, Any]) -> None:
        result = self._result(s, reason)
        self.stats["finished"] += 1
        with self._lock:
            self._live.discard(s.req.rid)
        log.debug("finished rid=%s reason=%s tokens=%d version=%s", s.req.rid, reason["type"],
                  len(s.out), result.weight_version)
        try:
            s.on_done(result)
        except Exception:  # a broken callback must not take the batch down
            log.exception("on_done callback failed rid=%s", s.req.rid)
