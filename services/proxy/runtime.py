"""The proxy's in-process state and its background work, behind one object the routes use.

``ProxyRuntime`` owns the tokenizer, the engine client, the generation controller, the weight
updater, the session store and the metrics. ``start()`` (in the event loop) binds the updater to
the loop, probes the engines' loaded version, starts the version-bus watcher thread (when a
Redis factory is given and ``proxy.follow_versions``), the session-expiry task and the heartbeat;
While following versions, the engine check reads every engine's loaded version each
``proxy.engine_check_s``: one behind the published version (restarted on its initial weights,
loaded by someone else, down) is held back from routing and caught up (``WeightUpdater.catch_up``).
The load poll (every ``proxy.load_poll_s``) reads every engine's load for routing and asks each
down engine's health route (``proxy.engine_health_timeout_s``: SGLang's answers after >= 1 s):
one that answers 200 rejoins through the catch-up path. ``refuse_live_on_sglang`` is the start-up
check that ``proxy.weight_updates: live`` is not pointed at an SGLang engine (exit 2).
``stop()`` undoes all of it. ``turn()`` is the one path every generation takes: concurrency slot,
session, per-session lock, controller, then recording — so a refused turn is never recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.proxy.auth import PRINCIPAL
from services.proxy.balancer import parse_load
from services.proxy.controller import Generation, GenerationController, TokenSink
from services.proxy.engine_client import EngineClient
from services.proxy.errors import InvalidRequest, SessionConflict
from services.proxy.guards import ConcurrencyLimit
from services.proxy.metrics import ProxyMetrics
from services.proxy.promptcache import PromptCache
from services.proxy.schemas import Limits
from services.proxy.sessions import Session, SessionStore
from services.proxy.updater import WeightUpdater
from shared.config import ProxyConfig
from shared.errors import ConfigError
from shared.keys import Keys
from shared.modeling.loading import chat_input_ids, stop_token_ids
from shared.sglang_compat import Dialect, live_refusal
from shared.streams import consumer_name
from shared.telemetry import Heartbeat
from shared.versionbus import VersionWatcher

log = logging.getLogger(__name__)
T = TypeVar("T")


class ProxyRuntime:
    def __init__(self, cfg: ProxyConfig, tokenizer: Any, client: EngineClient | None = None,
                 redis_factory: Callable[[], Any] | None = None, keys: Keys | None = None,
                 heartbeat_ttl_s: float = 15.0, model_name: str = "dressage",
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.cfg, self.tokenizer, self.model_name = cfg, tokenizer, model_name
        self.template_kwargs = dict(template_kwargs or {})  # model.chat_template_kwargs: every prompt's defaults
        self.metrics = ProxyMetrics()
        engine_key = cfg.engine_api_key.get_secret_value() if cfg.engine_api_key else None
        self.client = client or EngineClient(cfg.engines, cfg.connect_timeout_s, cfg.request_timeout_s,
                                             engine_api_key=engine_key, health_timeout_s=cfg.engine_health_timeout_s,
                                             live_updates=cfg.weight_updates == "live")
        self.controller = GenerationController(self.client, self.metrics, cfg.max_partial_rollout_preempts,
                                               cfg.request_timeout_s, cfg.pause_timeout_s, cfg.engine_sync_wait_s,
                                               live_updates=cfg.weight_updates == "live")
        self.updater = WeightUpdater(self.controller, self.client, self.metrics)
        self.controller.on_engine_behind = self.updater.catch_up
        self.sessions = SessionStore(cfg.session_ttl_s, cfg.max_sessions, cfg.max_turns_per_session)
        self.limit = ConcurrencyLimit(cfg.max_concurrency)
        self.limits = Limits(cfg.max_tokens_limit, cfg.max_messages, cfg.max_prompt_tokens)
        self.stop_ids = stop_token_ids(tokenizer)
        self._redis_factory, self._keys, self._hb_ttl = redis_factory, keys, heartbeat_ttl_s
        self._watcher: VersionWatcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proxy-tokenize")
        self.prompt_cache = PromptCache()  # rendered prompt ids by exact (messages, tools)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.updater.bind(asyncio.get_running_loop())
        await self.client.identify_all()  # each engine's dialect, logged (an unreachable one is asked on first use)
        await self.controller.refresh_version()
        log.info("proxy started engines=%d version=%s partial_rollout=%s max_preempts=%s", len(self.client.engines),
                 self.controller.current_version, self.cfg.partial_rollout, self.cfg.max_partial_rollout_preempts)
        if self._redis_factory is not None and self._keys is not None and self.cfg.follow_versions:
            self._watcher = VersionWatcher(self._redis_factory, self._keys, self.updater.on_version_threadsafe,
                                           poll_s=1.0).start()
            self._tasks.append(asyncio.create_task(self._every(self.cfg.engine_check_s, self.check_engines,
                                                               "engine version check")))
        self._tasks.append(asyncio.create_task(self._expire_loop()))
        if self.cfg.load_poll_s > 0:
            self._tasks.append(asyncio.create_task(self._every(self.cfg.load_poll_s, self.poll_engines,
                                                               "engine load poll")))
        if self._redis_factory is not None and self._keys is not None:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop()))

    async def stop(self) -> None:
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.stop)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.client.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def _expire_loop(self) -> None:
        period = max(0.05, min(self.cfg.session_ttl_s / 4, 30.0))
        while True:
            await asyncio.sleep(period)
            gone = self.sessions.expire()
            if gone:
                log.info("expired %d idle sessions (ttl %.0fs), e.g. session_id=%s", len(gone),
                         self.cfg.session_ttl_s, gone[0])
                self.metrics.sessions.set(len(self.sessions))

    async def check_engines(self) -> None:
        """One pass of the engine health check: hold back (and catch up) every engine not serving the target."""
        target = self.controller.target
        if target is None:
            return  # nothing applied yet: the first update loads every engine
        timeout = min(self.cfg.engine_check_s, self.updater.check_timeout_s)
        found = await asyncio.gather(*(self.client.weight_version(u, timeout=timeout) for u in self.client.engines))
        for url, version in zip(self.client.engines, found, strict=True):
            if version is None:
                self.controller.mark_behind(url, "no version answer (down, stopped or restarting)")
            elif self.controller.learn(url, version):
                await self.controller.mark_synced(url, version)

    async def poll_engines(self) -> None:
        """One pass: every engine's load for routing; a down engine whose health route answers 200 rejoins."""
        timeout = min(self.cfg.connect_timeout_s * 2, max(self.cfg.load_poll_s, 0.5))
        ctl = self.controller
        down = [u for u in self.client.engines if u in ctl.down]
        loads, health = await asyncio.gather(
            asyncio.gather(*(self.client.load(u, timeout) for u in self.client.engines)),
            asyncio.gather(*(self.client.healthy(u, timeout) for u in down)))  # SGLang's: health timeout, >= 1 s
        for url, body in zip(self.client.engines, loads, strict=True):
            if body is not None:
                ctl.balancer.set_remote(url, parse_load(body))
        for url, ok in zip(down, health, strict=True):
            if ok:
                await ctl.mark_up(url)

    @staticmethod
    async def _every(period_s: float, work: Callable[[], Awaitable[None]], what: str) -> None:
        """Run ``work`` every ``period_s`` until cancelled (the engine load poll, the version check)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await work()
            except Exception:  # the loop must outlive any one bad answer
                log.exception("%s failed", what)

    async def _heartbeat_loop(self) -> None:
        assert self._redis_factory is not None and self._keys is not None
        hb = Heartbeat(self._redis_factory(), self._keys, "proxy", consumer_name("proxy"), self._hb_ttl)
        while True:
            info = {"version": self.controller.current_version, "sessions": len(self.sessions),
                    "in_flight": self.limit.in_flight, "paused": not self.controller.runnable("")}
            await asyncio.to_thread(hb.beat, info, True)
            await asyncio.sleep(max(0.5, self._hb_ttl / 3))

    # --- requests --------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids of chat ``messages``: their text is bounded in bytes before any tokenizing
        (``proxy.max_prompt_bytes``); special-token text in a message stays text
        (``shared.modeling.loading.chat_input_ids``). Blocking: call it through ``off_loop``."""
        size = sum(len(str(m.get("content") or "").encode("utf-8", "surrogatepass")) for m in messages)
        size += len(str(tools or "").encode("utf-8", "surrogatepass"))
        if size > self.cfg.max_prompt_bytes:
            raise InvalidRequest("messages", f"message text is {size} bytes; proxy.max_prompt_bytes="
                                             f"{self.cfg.max_prompt_bytes}")
        kwargs = {**self.template_kwargs, **(template_kwargs or {})}  # a request's own win over model.chat_template_kwargs
        key = self.prompt_cache.key(messages, tools, kwargs)
        ids = self.prompt_cache.get(key)
        if ids is None:
            ids = chat_input_ids(self.tokenizer, messages, True, tools, kwargs)
            self.prompt_cache.put(key, ids)
        return ids

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the runtime's one tokenizer thread, so tokenizing a large prompt never
        blocks the event loop (health checks and other requests keep being answered)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Token ids to text; straight through the Rust tokenizer when there is one (hot path)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return str(backend.decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def sampling(self, temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None,
                 stop_ids: list[int] | None) -> dict[str, Any]:
        params: dict[str, Any] = {"temperature": self.cfg.temperature if temperature is None else temperature,
                                  "stop_token_ids": self.stop_ids if stop_ids is None else stop_ids}
        if top_p is not None:
            params["top_p"] = top_p
        if top_k is not None and top_k != 0:  # forwarded as sent (-1: off); Messages' 0 also means off
            params["top_k"] = top_k
        if seed is not None:
            params["sampling_seed"] = seed
        return params

    async def turn(self, session_id: str, partial: bool, input_ids: list[int], max_new_tokens: int,
                   sampling: dict[str, Any], sink: TokenSink | None = None,
                   request_fields: dict[str, Any] | None = None,
                   admitted: Callable[[], None] | None = None) -> tuple[Generation, int]:
        """Generate one response for ``session_id`` and record it; returns it and its segment index.

        ``sink`` receives the tokens as they are produced (streaming, stop strings); what is
        recorded is exactly what the response keeps (a stop string's cut included). ``admitted``
        is called once the turn holds its slot and session and is dispatched or waits for a resume
        (``GenerationController.generate``): a stream opens then."""
        with self.limit:
            session = self.sessions.open(session_id, partial, principal=PRINCIPAL.get())  # bound to its creator
            async with session.lock:
                if session.finalized:  # finalized while this turn waited for the lock
                    raise SessionConflict(f"session {session_id!r} is finalized", session_id=session_id)
                gen = await self.controller.generate(session_id, list(session.versions), input_ids,
                                                     max_new_tokens, sampling, partial, sink, request_fields,
                                                     admitted)
                seg = self._record(session, input_ids, gen)
        return gen, seg

    def _record(self, session: Session, input_ids: list[int], gen: Generation) -> int:
        """Record a generation that passed every check in its session; its segment index."""
        seg = session.record(input_ids, gen.output_ids, gen.logprobs, gen.versions, gen.finish_reason, gen.preempts)
        session.touched = time.monotonic()
        self.metrics.version_span.observe(len(session.versions))
        self.metrics.tokens.inc(len(gen.output_ids))
        return seg

    async def turn_many(self, session_ids: list[str], partial: bool, input_ids: list[int], max_new_tokens: int,
                        samplings: list[dict[str, Any]], sinks: list[TokenSink | None],
                        request_fields: dict[str, Any] | None = None) -> list[tuple[Generation, int] | BaseException]:
        """``turn`` for n sessions at the same prompt (``GenerationController.generate_many``: one engine
        request for their first chunks); each session is opened, locked and recorded as ``turn`` does it.
        Results in order; a session refused is its exception (the others are recorded all the same)."""
        with contextlib.ExitStack() as slots:
            for _ in session_ids:
                slots.enter_context(self.limit)
            sessions = [self.sessions.open(sid, partial, principal=PRINCIPAL.get()) for sid in session_ids]
            async with contextlib.AsyncExitStack() as locks:
                for s in sorted(sessions, key=lambda x: x.session_id):  # one order: two such calls never deadlock
                    await locks.enter_async_context(s.lock)
                for s in sessions:
                    if s.finalized:  # finalized while this turn waited for the lock
                        raise SessionConflict(f"session {s.session_id!r} is finalized", session_id=s.session_id)
                gens = await self.controller.generate_many(session_ids, [list(s.versions) for s in sessions],
                                                           input_ids, max_new_tokens, samplings, partial, sinks,
                                                           request_fields)
                out: list[tuple[Generation, int] | BaseException] = []
                for s, gen in zip(sessions, gens, strict=True):
                    if isinstance(gen, BaseException):
                        out.append(gen)
                        continue
                    out.append((gen, self._record(s, input_ids, gen)))
        return out

    def state(self) -> dict[str, Any]:
        return {**self.controller.state(), "partial_rollout": self.cfg.partial_rollout,
                "in_flight_requests": self.limit.in_flight, "sessions": len(self.sessions),
                "applied_version": self.updater.applied, "last_update": self.updater.last,
                "weight_update_seconds_total": round(self.updater.pause_seconds_total, 4),
                "weight_load_seconds_total": round(self.updater.load_seconds_total, 4),
                "weight_updates_mode": self.cfg.weight_updates,
                "weight_updates_total": self.updater.updates_total,
                "following_versions": self._watcher is not None}


def refuse_live_on_sglang(cfg: ProxyConfig) -> None:
    """Start-up check: ``proxy.weight_updates: live`` against an SGLang engine raises ConfigError (exit 2).
    Engines not reachable now are checked when first used (refused then: never routed to)."""
    if cfg.weight_updates != "live":
        return
    key = cfg.engine_api_key.get_secret_value() if cfg.engine_api_key else None
    client = EngineClient(cfg.engines, cfg.connect_timeout_s, engine_api_key=key,
                          health_timeout_s=cfg.engine_health_timeout_s)

    async def identify() -> dict[str, Dialect | None]:
        try:
            return await client.identify_all()
        finally:
            await client.close()

    for i, dialect in enumerate(asyncio.run(identify()).values()):
        if dialect is not None and (why := live_refusal(dialect)):
            raise ConfigError(f"proxy.engines[{i}]: {why}")
