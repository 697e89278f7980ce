"""Generation controller: preemptible generations, pause/resume, resume chunks, version checks.

Invariants (asyncio, one event loop; no await between a check and the state change it guards):
* a chunk is dispatched only while its session is runnable (no global pause holder and the
  session not paused on its own), and its rid is registered *before* the first await, so a
  ``pause`` that starts later always sees it and aborts it on the engine that holds it;
* ``pause`` returns once every generation it preempted has come back from its engine (its
  partial tokens are appended), or when ``timeout_s`` ran out (``quiesced: false``); aborts of
  still-running rids are re-sent until then (an abort can reach the engine before the request);
* every version check happens *before* a chunk is dispatched (against the version the engines
  will run, ``current_version``) and again on the tokens a chunk brought back (what the engines
  really ran): a refused trajectory costs no further compute, and a version that slipped in
  unannounced is still caught. The checks read the session's earlier versions plus this
  generation's own, so "versions" means the whole session, turns included;
* partial mode: an aborted chunk suspends the generation until resume, then continues from
  prompt + partial output with a fresh rid and the remaining budget; to the caller it is one
  response. Non-partial mode: an aborted chunk fails the request (``generation_preempted``).
* engines follow the published weights (``target``, set by the weight updater): a chunk is
  routed only to an engine not marked *behind*. An engine is marked behind when it refuses a
  connection (it may be restarting), when the health check reads another version, or when a
  response carries a version older than ``target``; such a response's tokens are discarded
  before anything reaches the caller and the chunk is sent again once an engine is caught up
  (``on_engine_behind`` asks the updater to load ``target`` into it). With every engine behind a
  chunk waits up to ``engine_sync_wait_s``, then fails ``upstream_unavailable`` (503) -- also
  when every engine refused the connection, so a short engine restart is ridden out;
* ``current_version`` is learned from every response (an engine loaded behind our back is
  noticed on its next answer), not only on load/resume;
* live updates (``proxy.weight_updates: live``): the updater never pauses; a rid sent before an
  update keeps running across the engine's swap (partial mode; its tokens carry per-token
  versions and meet the same span checks) or finishes on its old weights (non-partial: it does
  not opt in, so the engine swaps after it). Such a rid is judged stale against the target it
  was sent under (``_Active.floor``), not the newer one;
* n choices at one prompt (``generate_many``, a GRPO group's first turn): every member passes the
  same admission and version checks as a ``generate`` would, then their first chunks go to one
  engine as one batched ``/generate`` with a rid each (so a pause or a stop aborts each alone);
  each member then goes on alone from its chunk. A member whose chunk came back stale, or all of
  them when the batch failed (an engine down, an error answer: their rids are aborted first), are
  sent again one by one through ``_dispatch`` and its failover;
* many engines (``balancer``): a session's chunks go to its sticky engine, a new session to the
  least loaded one. An engine that refuses a connection, or drops one in the middle of a request
  we did not abort, is marked *down*: nothing is routed to it, and the chunk it was running is
  resumed on another engine from the tokens the proxy holds (the prompt, the earlier chunks, and
  in streaming the tokens already streamed) — in partial and non-partial mode alike, since no
  weight version changed. ``mark_up`` (the runtime's probe saw ``/health`` answer) lets it rejoin
  through the catch-up path: held *behind* until it serves ``target``. The engine client asks a
  down engine again what it speaks before its next use (it may have come back as another release).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.proxy.balancer import Balancer
from services.proxy.engine_client import Chunk, EngineClient
from services.proxy.errors import (
    GenerationPreempted,
    ProxyError,
    SpanExceeded,
    TrajectoryVersionChanged,
    UpstreamError,
    UpstreamUnavailable,
)
from services.proxy.metrics import ProxyMetrics
from shared.staleness import check_version_span, ordered_real_versions
from shared.versions import real_version, version_newer

log = logging.getLogger(__name__)

OPERATOR = "operator"
WEIGHT_UPDATE = "weight_update"


class RolloutPaused(ProxyError):
    """A generation waited longer than ``proxy.request_timeout_s`` for a resume."""

    status = 503
    code = "rollout_paused"


@dataclass
class Generation:
    """The stitched result of one request: what the agent receives as one response."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    chunks: list[dict[str, Any]] = field(default_factory=list)  # per rid: tokens, version, finish, preempted
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per output id ([] if not asked)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (a stop string cut the rest off)."""
        del self.output_ids[n:], self.logprobs[n:], self.versions[n:], self.top_logprobs[n:]

    @property
    def preempts(self) -> int:
        return sum(1 for c in self.chunks if c["preempted"])


@dataclass
class _Active:
    rid: str
    session_id: str
    url: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    abort_requested: bool = False
    stop_requested: bool = False  # the sink matched a stop string: aborted by us, not a preemption
    finished: bool = False  # the engine's answer came back whole
    floor: str | None = None  # live updates: the target when this rid was sent (its tokens of it are current)
    streamed_versions: list[str] = field(default_factory=list)  # distinct versions of streamed tokens so far
    held: list[Chunk] = field(default_factory=list)  # streamed deltas that passed the checks (the sink has them)

    def partial(self) -> Chunk:
        """What this rid produced before it stopped early: its streamed tokens, marked aborted."""
        h = self.held
        return Chunk([t for c in h for t in c.output_ids], [x for c in h for x in c.logprobs],
                     [v for c in h for v in c.versions], "abort", h[-1].weight_version if h else None, True, {},
                     [t for c in h for t in c.top_logprobs])


def _bind(feed: Callable[[Chunk, _Active], None], active: _Active) -> Callable[[Chunk], None]:
    return lambda chunk: feed(chunk, active)


class TokenSink(Protocol):
    """Who receives a generation's tokens as they are produced (``textout.TurnOutput``)."""

    stream: bool  # ask the engines to stream, so tokens arrive as they are produced
    keep: int | None  # after a stop: how many tokens the response keeps

    def feed(self, ids: list[int], logprobs: list[float],
             tops: list[list[tuple[int, float]]] | None) -> bool: ...  # True: stop generating


class GenerationController:
    def __init__(self, client: EngineClient, metrics: ProxyMetrics, max_preempts: int | None,
                 request_timeout_s: float = 600.0, pause_timeout_s: float = 30.0,
                 engine_sync_wait_s: float = 30.0, live_updates: bool = False) -> None:
        self.client, self.metrics = client, metrics
        self.max_preempts = max_preempts
        self.live = live_updates  # weights load under running generations (no pause; see set_current)
        self.request_timeout_s, self.pause_timeout_s = request_timeout_s, pause_timeout_s
        self.engine_sync_wait_s = engine_sync_wait_s
        self.current_version: str | None = None  # what the engines run now (load/resume, every response)
        self.target: str | None = None  # the published version every engine must serve (None: not following)
        self.behind: set[str] = set()  # engines not known to serve ``target``: no chunk is routed to them
        self.on_engine_behind: Callable[[str], None] = lambda url: None  # the updater's catch-up hook
        self.balancer = Balancer(client.engines)
        self.down: set[str] = set()  # engines that refused or dropped a connection: nothing is routed there
        self.failovers = 0  # chunks resumed on another engine after theirs went down
        self.epoch = 0  # +1 on every resume that ends a pause (reported only)
        self._holders: set[str] = set()  # global pause holders: "operator", "weight_update"
        self._paused_sessions: set[str] = set()  # operator pauses of single sessions
        self._cond = asyncio.Condition()
        self._active: dict[str, _Active] = {}
        self._suspended = 0
        self._background: set[asyncio.Task[Any]] = set()  # fire-and-forget aborts (kept referenced)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- pause state ---------------------------------------------------------------------

    def runnable(self, session_id: str) -> bool:
        return not self._holders and session_id not in self._paused_sessions

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _wait_runnable(self, session_id: str) -> None:
        if self.runnable(session_id):
            return
        try:
            async with asyncio.timeout(self.request_timeout_s):
                async with self._cond:
                    await self._cond.wait_for(lambda: self.runnable(session_id))
        except TimeoutError:
            raise RolloutPaused(f"rollout paused for more than {self.request_timeout_s:.0f}s",
                                session_id=session_id) from None

    async def pause(self, holder: str = OPERATOR, session_id: str | None = None,
                    timeout_s: float | None = None, reason: str = "") -> dict[str, Any]:
        """Stop dispatching (globally, or for one session) and abort the matching in-flight rids."""
        was_paused = bool(self._holders) if session_id is None else session_id in self._paused_sessions
        if session_id is None:
            self._holders.add(holder)
        else:
            self._paused_sessions.add(session_id)
        targets = [a for a in self._active.values() if session_id is None or a.session_id == session_id]
        for a in targets:
            a.abort_requested = True
        timeout = self.pause_timeout_s if timeout_s is None else timeout_s
        log.info("pause holder=%s session_id=%s reason=%s in_flight=%d", holder, session_id, reason, len(targets))
        failed = await self._abort_until_quiesced(targets, timeout)
        quiesced = all(a.done.is_set() for a in targets)
        if not quiesced:
            log.warning("pause not quiesced within %.1fs: rids=%s", timeout,
                        [a.rid for a in targets if not a.done.is_set()])
        return {"status": "already_paused" if was_paused else "paused", "holder": holder, "reason": reason,
                "session_id": session_id, "quiesced": quiesced, "preempted_request_ids": [a.rid for a in targets],
                "abort_failed_request_ids": failed, **self.state()}

    async def _abort_until_quiesced(self, targets: list[_Active], timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        failed: set[str] = set()
        while True:
            pending = [a for a in targets if not a.done.is_set()]
            if not pending:
                return sorted(failed)
            results = await asyncio.gather(*(self.client.abort(a.url, a.rid) for a in pending))
            failed.update(a.rid for a, ok in zip(pending, results, strict=True) if not ok)
            left = deadline - time.monotonic()
            if left <= 0:
                return sorted(failed)
            # Re-send after a short wait: an abort that overtook its request found nothing to abort.
            waits = [asyncio.ensure_future(a.done.wait()) for a in pending]
            _, not_done = await asyncio.wait(waits, timeout=min(0.2, left), return_when=asyncio.ALL_COMPLETED)
            for w in not_done:
                w.cancel()

    async def resume(self, holder: str = OPERATOR, session_id: str | None = None,
                     version: str | None = None) -> dict[str, Any]:
        """Release ``holder``'s pause (or one session's); ``version`` sets what engines now run."""
        was_paused = not self.runnable(session_id) if session_id else bool(self._holders)
        if version is not None and real_version(version) is not None:
            self.set_current(version)
        elif was_paused and session_id is None:
            # Whoever paused may have loaded weights behind our back: ask the engines (§9 #15).
            await self.refresh_version()
        if session_id is None:
            self._holders.discard(holder)
        else:
            self._paused_sessions.discard(session_id)
        if was_paused:
            self.epoch += 1
        log.info("resume holder=%s session_id=%s version=%s epoch=%d still_paused=%s", holder, session_id,
                 self.current_version, self.epoch, sorted(self._holders))
        await self._notify()
        return {"status": "resumed" if was_paused else "already_running", **self.state()}

    def set_current(self, version: str) -> None:
        """The engines now run ``version`` (an update loaded it; with live updates nothing paused)."""
        if (v := real_version(version)) is not None:
            self.current_version = v

    async def refresh_version(self) -> str | None:
        """Set ``current_version`` from the engines when they all report the same real one."""
        found = {await self.client.weight_version(u) for u in self.client.engines}
        if len(found) == 1 and (v := real_version(found.pop())) is not None:
            self.current_version = v
        return self.current_version

    # --- engines at the published version ---------------------------------------------------

    def set_target(self, version: str | None) -> None:
        """The version every engine must serve from now on (the updater loaded it)."""
        if version is not None and real_version(version) is not None:
            self.target = real_version(version)

    def mark_behind(self, url: str, why: str) -> None:
        """Route nothing to ``url`` until it is seen serving ``target`` (and ask for a catch-up)."""
        if self.target is None:
            return  # not following published weights: nothing to catch up to
        if url not in self.behind:
            self.behind.add(url)
            self.metrics.engines_behind.set(len(self.behind))
            log.warning("engine=%s held back from routing: %s (target version=%s)", url, why, self.target)
        self.on_engine_behind(url)

    async def mark_synced(self, url: str, version: str | None) -> None:
        """``url`` was seen serving ``version``; routable again when that is ``target`` (or newer)."""
        v = real_version(version) if version is not None else None
        if v is None or (self.target is not None and version_newer(self.target, v)):
            return
        if url in self.behind:
            self.behind.discard(url)
            self.metrics.engines_behind.set(len(self.behind))
            log.info("engine=%s serves version=%s: routable again", url, v)
            await self._notify()

    def learn(self, url: str, version: str | None, floor: str | None = None) -> bool:
        """A response's version: True when ``url`` serves ``target`` (or newer, or no target is set).

        With live updates a rid sent before an update may end on the weights it started on: it is
        measured against ``floor`` (the target when it was sent) and never moves ``current_version`` back."""
        v = real_version(version) if version is not None else None
        if v is None:
            return True
        least = floor if self.live else self.target
        if least is not None and version_newer(least, v):
            self.mark_behind(url, f"answered with version={v}")
            return False
        if self.target is None or not version_newer(self.target, v):
            self.current_version = v
        return True

    def mark_down(self, url: str, why: str) -> None:
        """Route nothing to ``url`` until ``mark_up``; it will have to catch up to ``target`` too."""
        if url not in self.down:
            self.down.add(url)
            self.client.forget(url)  # it may come back as another release: asked again what it speaks
            log.warning("engine=%s marked down: %s (engines down=%d of %d)", url, why, len(self.down),
                        len(self.client.engines))
        self.mark_behind(url, why)

    async def mark_up(self, url: str) -> None:
        """``url`` answers again: it rejoins through the catch-up path (held behind until it serves ``target``)."""
        if url not in self.down:
            return
        self.down.discard(url)
        log.info("engine=%s is back; rejoining%s", url, f" after a catch-up to version={self.target}"
                 if self.target is not None else "")
        self.mark_behind(url, "back after being down")  # a restarted engine serves its start-up weights
        await self._notify()

    def _routable(self, session_id: str) -> list[str]:
        """Engines to try, in order: the balancer's pick among those up, then (last resort) those marked down."""
        ranked = self.balancer.order(session_id, self.behind)
        return [u for u in ranked if u not in self.down] + [u for u in ranked if u in self.down]

    async def _wait_routable(self, session_id: str) -> list[str]:
        urls = self._routable(session_id)
        if urls:
            return urls
        try:
            async with asyncio.timeout(self.engine_sync_wait_s):
                async with self._cond:
                    await self._cond.wait_for(lambda: bool(self._routable(session_id)))
        except TimeoutError:
            raise UpstreamUnavailable(f"no engine serves the published version={self.target} "
                                      f"after {self.engine_sync_wait_s:.0f}s", engines=len(self.client.engines),
                                      behind=len(self.behind)) from None
        return self._routable(session_id)

    def state(self) -> dict[str, Any]:
        return {"paused": bool(self._holders), "pause_holders": sorted(self._holders),
                "target_version": self.target, "engines_behind": sorted(self.behind),
                "paused_sessions": sorted(self._paused_sessions), "version": self.current_version,
                "engines_down": sorted(self.down), "failovers": self.failovers, "engines": self.balancer.snapshot(),
                "epoch": self.epoch, "max_partial_rollout_preempts": self.max_preempts,
                "active_generations": len(self._active), "suspended_generations": self._suspended,
                "active_request_ids": sorted(self._active)}

    # --- version checks ------------------------------------------------------------------

    def check(self, session_id: str, earlier: list[str], candidate: list[str], partial: bool) -> None:
        """Refuse ``candidate`` versions for a session whose tokens so far carry ``earlier``."""
        # Per-token lists repeat a few labels: dedupe (order kept) before the shared helpers see them.
        earlier, candidate = list(dict.fromkeys(earlier)), list(dict.fromkeys(candidate))
        if partial:
            if self.max_preempts is None:
                return
            chk = check_version_span(earlier, candidate, self.max_preempts)
            if chk.exceeded:
                self.metrics.span_rejections.inc()
                self.metrics.rejections.labels(SpanExceeded.code).inc()
                log.warning("error=%s session_id=%s versions=%s max_preempts=%d", SpanExceeded.code,
                            session_id, chk.versions, self.max_preempts)
                raise SpanExceeded(chk.detail(session_id))
            return
        prev, new = ordered_real_versions(earlier), ordered_real_versions(candidate)
        if (prev and not set(new) <= set(prev)) or len(set(prev) | set(new)) > 1:
            self.metrics.rejections.labels(TrajectoryVersionChanged.code).inc()
            log.info("error=trajectory_version_changed session_id=%s previous=%s new=%s", session_id, prev, new)
            raise TrajectoryVersionChanged(
                "weight version changed during a non-partial trajectory; rejecting it instead of continuing",
                previous_versions=prev, new_versions=new, session_id=session_id)

    # --- generation ----------------------------------------------------------------------

    async def generate(self, session_id: str, earlier: list[str], input_ids: list[int], max_new_tokens: int,
                       sampling: dict[str, Any], partial: bool, sink: TokenSink | None = None,
                       request_fields: dict[str, Any] | None = None,
                       admitted: Callable[[], None] | None = None, first: Chunk | None = None) -> Generation:
        """Run one request to completion across preemptions; raises a ProxyError when refused.

        ``sink`` sees every token as the engines produce it (streamed when ``sink.stream``),
        across preemptions, only after the version checks passed; once it asks to stop, the
        engine request is aborted and the generation ends ``stop`` with ``sink.keep`` tokens.
        ``request_fields`` are extra top-level ``/generate`` fields (``top_logprobs_num``).
        ``admitted`` (idempotent) is called before the first wait for a resume or once the first
        dispatch passed its version check: a streamed response opens then, and later refusals
        reach the client in-band. ``first``: the first chunk, already dispatched and learned
        (``generate_many``'s batched request); the generation goes on from it."""
        gen = Generation()
        streamed = sink is not None and sink.stream

        def feed(delta: Chunk, active: _Active) -> None:  # one streamed event, before it reaches anyone
            target = active.floor if self.live else self.target
            if target is not None and (v := real_version(delta.weight_version or "")) and version_newer(target, v):
                return  # stale engine: its tokens are discarded with the chunk (see _dispatch)
            self.check(session_id, [*earlier, *gen.versions, *active.streamed_versions], delta.versions, partial)
            active.streamed_versions += dict.fromkeys(delta.versions)
            active.held.append(delta)
            if sink is not None and not active.stop_requested and sink.feed(delta.output_ids, delta.logprobs,
                                                                           delta.top_logprobs or None):
                active.stop_requested = True  # a stop string matched: the rest is not wanted
                self._spawn(self.client.abort(active.url, active.rid))

        while True:
            if first is not None:  # dispatched with its siblings (generate_many)
                chunk, stopped, first = first, False, None
            else:
                sent, stopped = await self._next_chunk(session_id, earlier, gen, input_ids, max_new_tokens, sampling,
                                                       partial, streamed, feed, request_fields, admitted)
                if sent is None:
                    continue  # answered on weights older than the published ones: discarded, sent again
                chunk = sent
            self.check(session_id, [*earlier, *gen.versions], chunk.versions, partial)
            if sink is not None and not streamed:
                stopped = sink.feed(chunk.output_ids, chunk.logprobs, chunk.top_logprobs or None)
            gen.output_ids += chunk.output_ids
            gen.logprobs += chunk.logprobs
            gen.versions += chunk.versions
            gen.top_logprobs += chunk.top_logprobs or [[] for _ in chunk.output_ids]
            lost = bool(chunk.meta.get("engine_lost"))
            gen.chunks.append({"num_output_tokens": len(chunk.output_ids), "version": chunk.weight_version,
                               "finish_reason": chunk.finish_type, "preempted": chunk.aborted and not stopped and not lost,
                               "engine_lost": lost})
            if stopped and sink is not None and sink.keep is not None:  # a stop string: end at its cut
                gen.truncate(sink.keep)
                gen.finish_reason = "stop"
                return gen
            if not chunk.aborted:
                gen.finish_reason = chunk.finish_type
                return gen
            if lost:  # not a preemption: same weights, another engine
                if len(gen.output_ids) >= max_new_tokens:
                    gen.finish_reason = "length"
                    return gen
                continue
            self.metrics.preemptions.inc()
            if not partial:
                raise GenerationPreempted("generation interrupted by a pause or weight update (non-partial mode)",
                                          session_id=session_id, partial_tokens=len(gen.output_ids))
            if len(gen.output_ids) >= max_new_tokens:
                gen.finish_reason = "length"
                return gen
            log.info("preempted session_id=%s tokens_so_far=%d; will resume", session_id, len(gen.output_ids))

    async def _admit(self, session_id: str, earlier: list[str], gen: Generation, partial: bool,
                     admitted: Callable[[], None] | None) -> None:
        """Wait until ``session_id`` may run, then check the version the engines run now (before any compute)."""
        while not self.runnable(session_id):  # re-checked: another pause may start while we wake up
            self._suspended += bool(gen.chunks)
            self.metrics.suspended.set(self._suspended)
            if admitted is not None:
                admitted()  # a wait for a resume can be long: the client hears from us first
            try:
                await self._wait_runnable(session_id)
            finally:
                self._suspended -= bool(gen.chunks)
                self.metrics.suspended.set(self._suspended)
        if self.current_version is not None:
            self.check(session_id, [*earlier, *gen.versions], [self.current_version], partial)
        if admitted is not None:
            admitted()

    def _body(self, input_ids: list[int], gen: Generation, max_new_tokens: int, sampling: dict[str, Any],
              partial: bool, request_fields: dict[str, Any] | None) -> dict[str, Any]:
        """The ``/generate`` body of the next chunk: the prompt plus what was generated so far."""
        remaining = max_new_tokens - len(gen.output_ids)
        body = {"input_ids": [*input_ids, *gen.output_ids], "return_logprob": True, "logprob_start_len": -1,
                "sampling_params": {**sampling, "max_new_tokens": remaining}, **(request_fields or {})}
        # Engine opt-in: runs across a swap, versions per token. Live updates never abort, so a
        # non-partial chunk instead finishes on the weights it started on (the swap waits for it).
        body["continue_across_weight_updates"] = partial or not self.live
        return body

    async def _next_chunk(self, session_id: str, earlier: list[str], gen: Generation, input_ids: list[int],
                          max_new_tokens: int, sampling: dict[str, Any], partial: bool, streamed: bool,
                          feed: Callable[[Chunk, _Active], None], request_fields: dict[str, Any] | None,
                          admitted: Callable[[], None] | None) -> tuple[Chunk | None, bool]:
        await self._admit(session_id, earlier, gen, partial, admitted)
        if gen.chunks:
            self.metrics.resumes.inc()
        body = self._body(input_ids, gen, max_new_tokens, sampling, partial, request_fields)
        if streamed:
            body["stream"] = True
        return await self._dispatch(session_id, body, feed if streamed else None)

    async def generate_many(self, session_ids: list[str], earliers: list[list[str]], input_ids: list[int],
                            max_new_tokens: int, samplings: list[dict[str, Any]], partial: bool,
                            sinks: list[TokenSink | None], request_fields: dict[str, Any] | None = None,
                            ) -> list[Generation | BaseException]:
        """n generations of one prompt (a GRPO group's shared first turn): their first chunks go to one
        engine as one batched ``/generate``, each then goes on alone as ``generate`` would (a resume
        after a preemption, a stale answer sent again). Same checks as n ``generate`` calls; results
        (or each one's refusal) in order. Streaming sinks are not batched: n ``generate`` calls."""
        if any(s is not None and s.stream for s in sinks) or len(session_ids) < 2:
            firsts: list[Chunk | None] = [None] * len(session_ids)
        else:
            for sid, earlier in zip(session_ids, earliers, strict=True):
                await self._admit(sid, earlier, Generation(), partial, None)
            bodies = [self._body(input_ids, Generation(), max_new_tokens, sp, partial, request_fields)
                      for sp in samplings]
            firsts = await self._dispatch_batch(session_ids, bodies)
        return await asyncio.gather(*(
            self.generate(sid, earlier, input_ids, max_new_tokens, sp, partial, sink, request_fields, first=first)
            for sid, earlier, sp, sink, first in zip(session_ids, earliers, samplings, sinks, firsts, strict=True)),
            return_exceptions=True)

    def _track(self, session_id: str, url: str) -> _Active:
        """A fresh rid for a chunk sent to ``url``, registered (a pause sees it) before any await."""
        rid = f"dressage-{session_id[:64]}-{uuid.uuid4().hex}"
        active = self._active[rid] = _Active(rid, session_id, url, floor=self.target)
        self.metrics.active.set(len(self._active))
        self.balancer.started(url)
        return active

    def _untrack(self, active: _Active) -> None:
        """The chunk is back (or failed): no longer in flight, and a pause waiting on it may go on."""
        self.balancer.finished(active.url)
        del self._active[active.rid]
        active.done.set()
        self.metrics.active.set(len(self._active))

    async def _dispatch_batch(self, session_ids: list[str], bodies: list[dict[str, Any]]) -> list[Chunk | None]:
        """Send n chunks as one batched request to one engine, each under its own rid (so a pause or
        an abort reaches each alone). A chunk that comes back None is sent again alone: it answered on
        stale weights, or the batch failed (an engine down or refusing it), and ``_dispatch`` knows
        how to fail over."""
        urls = [u for u in await self._wait_routable(session_ids[0]) if u not in self.down]
        if not urls:
            return [None] * len(session_ids)
        url = urls[0]
        actives = [self._track(sid, url) for sid in session_ids]
        batch = {**bodies[0], "input_ids": [b["input_ids"] for b in bodies], "rid": [a.rid for a in actives],
                 "sampling_params": [b["sampling_params"] for b in bodies]}
        try:
            chunks = await self.client.generate_batch(url, batch, len(bodies))
        except (UpstreamUnavailable, UpstreamError) as exc:
            if not isinstance(exc, UpstreamUnavailable) or exc.extra.get("connected"):
                for a in actives:  # it may be running them: free the engine before sending them again
                    self._spawn(self.client.abort(url, a.rid))
            log.warning("batched first chunks of %d sessions (%s...) failed on engine=%s: %s; sending each alone",
                        len(session_ids), session_ids[0], url, exc.message)
            return [None] * len(session_ids)
        finally:
            for a in actives:
                self._untrack(a)
        out: list[Chunk | None] = []
        for a, chunk in zip(actives, chunks, strict=True):
            a.finished = True
            self.balancer.assign(a.session_id, url)
            if self.learn(url, chunk.weight_version, a.floor):
                out.append(chunk)
            else:
                self.metrics.stale_chunks.inc()
                out.append(None)
        return out

    async def _dispatch(self, session_id: str, body: dict[str, Any],
                        feed: Callable[[Chunk, _Active], None] | None = None) -> tuple[Chunk | None, bool]:
        """Send one chunk under a fresh rid, failing over engines that refuse the connection.

        Returns the chunk and whether ``feed`` (streamed events) asked to stop. A None chunk: the
        engine answered on weights older than ``target`` (tokens discarded; it is now held back
        and caught up) -- the caller sends the chunk again."""
        last: UpstreamUnavailable | None = None
        for url in await self._wait_routable(session_id):
            active = self._track(session_id, url)
            rid = active.rid
            on_delta = None if feed is None else _bind(feed, active)
            try:
                chunk = await self.client.generate(url, {**body, "rid": rid}, on_delta)
                active.finished = True
                self.balancer.assign(session_id, url)
                if url in self.down:
                    await self.mark_up(url)
                if not self.learn(url, chunk.weight_version, active.floor):
                    self.metrics.stale_chunks.inc()
                    log.warning("session_id=%s rid=%s engine=%s answered on version=%s < published %s: "
                                "%d tokens discarded, chunk sent again", session_id, rid, url,
                                chunk.weight_version, self.target, len(chunk.output_ids))
                    return None, False
                return chunk, active.stop_requested
            except UpstreamUnavailable as exc:
                if active.abort_requested and exc.extra.get("connected"):
                    # We aborted it and the connection broke: resume from what we have.
                    return active.partial(), False
                if exc.extra.get("connected"):
                    # The engine dropped a request we did not abort (died, or timed out): resume elsewhere
                    # from the tokens we hold, and abort the rid in case that engine still runs it.
                    self.mark_down(url, f"dropped rid={rid} mid-request ({exc.message})")
                    if feed is None:
                        self._spawn(self.client.abort(url, rid))
                    self.failovers += 1
                    lost = active.partial()
                    lost.meta["engine_lost"] = True
                    log.warning("session_id=%s rid=%s engine=%s lost mid-request with %d streamed tokens; "
                                "resuming on another engine", session_id, rid, url, len(lost.output_ids))
                    return lost, False
                last = exc
                self.mark_down(url, "refused the connection (down or restarting)")
                log.warning("engine unreachable session_id=%s engine=%s; trying next", session_id, url)
            finally:
                if not active.finished and feed is not None:  # refused mid-stream or cancelled: free the engine
                    self._spawn(self.client.abort(url, rid))
                self._untrack(active)
        assert last is not None
        if self.target is not None and not self._routable(session_id):
            # Every engine refused and is held back now: the caller sends the chunk again, which waits
            # (at most engine_sync_wait_s) for one to come back -- a short engine restart is ridden out.
            return None, False
        raise UpstreamUnavailable("no engine reachable", engines=len(self.client.engines)) from None
