"""Weight updates: follow the version bus and load each new version into every engine.

Contract: for each newer ``WeightVersion`` (``shared.versionbus.VersionWatcher`` runs in its
own thread and hands versions over with ``loop.call_soon_threadsafe``) the proxy pauses
(``weight_update`` holder: in-flight rids are aborted and keep their partial tokens), sends
``POST /update_weights_from_disk {model_path, weight_version}`` to every engine that does not
already report that version (in its dialect: for SGLang with the cache flush made to succeed,
``EngineClient.update_weights``), then resumes with ``version`` set, so the pre-dispatch span check
knows what the engines run before any token of a resumed chunk is generated. Versions that
arrive while an update runs are coalesced: only the newest pending one is loaded next. A failed
engine load is logged, counted and reported in ``state()``; the proxy still resumes (tokens are
tagged by the engine with the version it really used, so records stay truthful).

Live updates (``controller.live``; this project's engine only, SGLang engines are refused): no pause and no abort; the engines load while generations
run (the engine swaps between decode steps, ``continue_across_weight_updates``), and
``current_version`` is set once they have. ``pause_seconds_total`` then stays 0: nothing waited;
``load_seconds_total`` counts every update either way.

Catch-up: every version updated to becomes the controller's ``target`` (even if no engine could
load it at that moment); an engine that fails to load it, or that the controller later finds behind (restarted, loaded elsewhere), is held back from
routing and gets ``catch_up``: one load of the applied version, serialised with updates, retried
by the proxy's engine health check until the engine serves it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from services.proxy.controller import WEIGHT_UPDATE, GenerationController
from services.proxy.engine_client import EngineClient
from services.proxy.errors import ProxyError
from services.proxy.metrics import ProxyMetrics
from shared.schemas import WeightVersion
from shared.versions import version_newer

log = logging.getLogger(__name__)


class WeightUpdater:
    def __init__(self, controller: GenerationController, client: EngineClient, metrics: ProxyMetrics) -> None:
        self.controller, self.client, self.metrics = controller, client, metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: WeightVersion | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.applied: str | None = None  # last version loaded (into at least one engine)
        self.applied_wv: WeightVersion | None = None  # the newest version updated to (the target), for catch-ups
        self._catching_up: dict[str, asyncio.Task[None]] = {}
        self.check_timeout_s = 5.0  # a version probe of a stopped (SIGSTOP) engine must not hang a catch-up
        self.last: dict[str, Any] = {}  # outcome of the last update, for /v1/rollout/state
        self.pause_seconds_total = 0.0  # wall-clock of every paused update (pause + loads + resume), summed
        self.load_seconds_total = 0.0  # wall-clock of every update, paused or live
        self.updates_total = 0  # updates applied (attempted), for the time decomposition

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def on_version_threadsafe(self, wv: WeightVersion) -> None:
        """VersionWatcher callback (its own thread): hop into the event loop."""
        if self._loop is None or self._loop.is_closed():
            log.warning("version=%s observed before the proxy loop started; ignored", wv.version)
            return
        self._loop.call_soon_threadsafe(self.submit, wv)

    def submit(self, wv: WeightVersion) -> None:
        """Queue ``wv`` (in the loop); a newer pending version replaces an older one."""
        if self._pending is None or version_newer(wv.version, self._pending.version):
            self._pending = wv
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._pending is not None:
            wv, self._pending = self._pending, None
            if self.applied is not None and not version_newer(wv.version, self.applied):
                continue
            try:
                await self.apply(wv)
            except Exception:  # never let one bad update kill the follower task
                log.exception("weight update version=%s failed", wv.version)

    async def apply(self, wv: WeightVersion) -> dict[str, Any]:
        """Pause (unless live), load ``wv`` into every engine, resume; returns the outcome per engine."""
        async with self._lock:
            start = time.monotonic()
            live = self.controller.live
            pause: dict[str, Any] = ({"quiesced": True, "preempted_request_ids": []} if live else
                                     await self.controller.pause(WEIGHT_UPDATE, reason=f"weights version={wv.version}"))
            results: dict[str, str] = {}
            try:
                outcomes = await asyncio.gather(*(self._load(url, wv) for url in self.client.engines))
                results = {f"engine{i}": r for i, r in enumerate(outcomes)}
            finally:
                ok = any(r in ("loaded", "already_loaded") for r in results.values())
                # Before resuming: no chunk is routed to an engine that did not load it. The newest
                # published version is the target even when no engine could load it now (down,
                # restarting): those engines are held back and caught up to it, never to an older one.
                if results:
                    self.applied_wv = wv
                    self.controller.set_target(wv.version)
                    for url, r in zip(self.client.engines, results.values(), strict=True):
                        if r in ("loaded", "already_loaded"):
                            await self.controller.mark_synced(url, wv.version)
                        else:
                            self.controller.mark_behind(url, f"weights version={wv.version} not loaded ({r})")
                if not live:
                    await self.controller.resume(WEIGHT_UPDATE, version=wv.version if ok else None)
                elif ok:
                    self.controller.set_current(wv.version)
            if ok:
                self.applied = wv.version
            elapsed = time.monotonic() - start
            self.load_seconds_total += elapsed
            if not live:
                self.pause_seconds_total += elapsed
            self.updates_total += 1
            self.last = {"version": wv.version, "step": wv.step, "engines": results, "live": live,
                         "quiesced": pause["quiesced"],
                         "preempted": len(pause["preempted_request_ids"]), "seconds": round(elapsed, 3)}
            log.info("weights version=%s step=%d loaded: %s (preempted=%d, %.2fs)", wv.version, wv.step, results,
                     self.last["preempted"], self.last["seconds"])
            return self.last

    async def _load(self, url: str, wv: WeightVersion) -> str:
        if await self.client.weight_version(url) == wv.version:
            self.metrics.weight_updates.labels("already_loaded").inc()
            return "already_loaded"
        try:
            await self.client.update_weights(url, wv.path, wv.version)
        except ProxyError as exc:
            self.metrics.weight_updates.labels("failed").inc()
            log.error("weights version=%s not loaded: %s", wv.version, exc.message)
            return f"failed: {exc.code}"
        self.metrics.weight_updates.labels("loaded").inc()
        return "loaded"

    def catch_up(self, url: str) -> None:
        """Load the applied version into ``url`` (at most one catch-up per engine at a time)."""
        task = self._catching_up.get(url)
        if self.applied_wv is None or (task is not None and not task.done()):
            return
        self._catching_up[url] = asyncio.get_running_loop().create_task(self._catch_up(url))

    async def _catch_up(self, url: str) -> None:
        async with self._lock:  # never alongside an update (which may move the target)
            wv = self.applied_wv
            if wv is None or url not in self.controller.behind:
                return
            version = await self.client.weight_version(url, timeout=self.check_timeout_s)
            if version is None:
                return  # unreachable: the health check tries again once it answers
            if version != wv.version:
                result = await self._load(url, wv)
                if not result.startswith("loaded"):
                    return
                log.info("engine=%s caught up from version=%s to the published version=%s", url, version,
                         wv.version)
            await self.controller.mark_synced(url, wv.version)

    async def wait_idle(self) -> None:
        """For tests and shutdown: until no update is pending or running."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
