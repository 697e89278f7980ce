"""Which HTTP dialect an engine speaks, decided once from its server info (pure: no I/O).

The proxy talks to two kinds of engine: this project's own (``services/engine``, whose server
info says ``"version": "dressage-engine"``) and SGLang 0.5.9 to 0.5.23 (``"version": "0.5.N"``,
``sglang.__version__``). ``dialect_for(server_info)`` turns that one answer into a ``Dialect``:
the routes to read the load, the loaded weight version and the health from, how a weight load is
made safe, which ``/generate`` fields may be sent, and whether weights may load under running
requests. ``EngineClient`` asks each engine once (``/server_info``, else ``/get_server_info``)
and speaks the answer; ``dressage status`` uses the same client, so the rule lives here only.

What moved, per SGLang release (read in its sources: ``python/sglang/srt/entrypoints/http_server.py``,
``entrypoints/v1_loads.py``, ``managers/io_struct.py``, ``managers/scheduler_update_weights_mixin.py``):

* server info, with ``"version": sglang.__version__``: ``/get_server_info`` throughout;
  ``/server_info`` arrived within 0.5.9 - 0.5.20 (SGLang's docs build of 2026-03 logs
  ``/get_server_info`` as deprecated), and from then on ``/get_server_info`` is an alias;
* load: ``/get_load`` (a list per dp rank: ``num_reqs``, ``num_waiting_reqs``, ``num_tokens``) up
  to 0.5.20; from 0.5.21 only ``/v1/loads`` (``{timestamp, version, loads: [per rank:
  num_running_reqs, num_waiting_reqs, ...], aggregate}``);
* loaded weight version: ``/get_weight_version`` up to 0.5.20; from 0.5.21 ``/model_info``'s
  ``weight_version`` (``/get_weight_version`` answers 404);
* health, every release: ``/health`` is ``/health_generate`` — a one-token generation, checked once
  per second: 200 after >= 1 s, 503 while starting or shutting down, or after
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s). Only a server started with
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` (where a release reads it) answers ``/health`` at
  once, and no cheaper route proves the scheduler alive in every release, so the health check gets
  its own, longer timeout (``proxy.engine_health_timeout_s``);
* a streamed ``/generate`` error, every release: HTTP 200 with ``data: {"error": {"message": ...}}``
  then ``data: [DONE]``; unstreamed, the same object comes with a 400;
* ``/update_weights_from_disk``: up to 0.5.20 no ``flush_cache`` field — the scheduler flushes
  after every load and *asserts* that the flush succeeded, so a request still running (one just
  aborted: sgl-project/sglang#14062) kills it; from 0.5.21 ``flush_cache`` (default true) and
  ``manifest``, the assert running only when ``flush_cache`` is true;
* ``/flush_cache`` (GET or POST), every release: 200, or 400 while requests run or wait;
* ``/generate`` has no ``continue_across_weight_updates`` (``GenerateReqInput``): never sent, nor
  any other field of ``shared.sglang_fields.EXTENSION_FIELDS``;
* a load waits for the running requests (no per-token versions), so ``proxy.weight_updates: live``
  is refused against SGLang.

The 0.5.21 boundary (routes, ``flush_cache`` on disk loads) is the one issue 38's check of the
released sources found (0.5.6 - 0.5.20 assert after every disk load). A copy of
``http_server.py`` from between the two sides answers ``/get_load`` as a shim over ``/v1/loads``
while ``/get_weight_version`` already answers 404: below 0.5.21 each read therefore falls back to
the newer route on a 404 (``Dialect.load_routes`` / ``weight_version_routes``), and an engine whose
version cannot be read gets every route in turn.

Weight loads, so a load can never trip SGLang's flush assert: from 0.5.21 the load is sent with
``flush_cache: false`` and ``/flush_cache`` is retried with backoff until it succeeds
(``flush_after_load``); below, ``/flush_cache`` is retried until it succeeds *before* the load
(``drain_before_load``: the engine is then idle, so its own flush after the load succeeds).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from shared.sglang_fields import EXTENSION_FIELDS, OWN_ENGINE_VERSION

FIRST_SUPPORTED = (0, 5, 9)
LAST_SUPPORTED = (0, 5, 23)
ROUTES_MOVED = (0, 5, 21)  # /get_load, /get_weight_version gone; /update_weights_from_disk takes flush_cache
INFO_ROUTES = ("/server_info", "/get_server_info")  # asked in this order; a 404 moves to the next
FLUSH_ROUTE = "/flush_cache"
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)\.(\d+)")

Version = tuple[int, int, int]
RouteKind = Literal["load", "weight_version"]


@dataclass(frozen=True)
class Dialect:
    """How to talk to one engine (see the module table)."""

    name: str  # for logs and ``dressage status``: "dressage-engine", "sglang 0.5.12", ...
    sglang: bool  # an SGLang server (not this project's engine)
    version: Version | None  # SGLang's release as read; None: this project's engine, or not readable
    load_routes: tuple[str, ...]  # GET, first that does not 404: one body per dp rank (normalised by loads_of)
    weight_version_routes: tuple[str, ...]  # GET, first that does not 404: ``weight_version`` field
    health_route: str  # GET: 200 = ready to serve
    slow_health: bool  # the health route runs a generation (>= 1 s): give it engine_health_timeout_s
    load_fields: Mapping[str, Any]  # extra /update_weights_from_disk fields (flush_cache: false)
    drain_before_load: bool  # /flush_cache must succeed before a load (the engine flushes + asserts after it)
    flush_after_load: bool  # /flush_cache must succeed after a load sent with flush_cache: false
    extension_fields: frozenset[str]  # /generate fields beyond SGLang's that this engine knows
    live_updates: bool  # weights may load under running requests (proxy.weight_updates: live)
    note: str | None = None  # why the choice is a guess (unsupported or unreadable version), for a warning

    def prefer(self, kind: RouteKind, route: str) -> Dialect:
        """The same dialect with ``route`` asked first for ``kind`` (it answered where the first 404'd)."""
        if kind == "load":
            return replace(self, load_routes=(route, *(r for r in self.load_routes if r != route)))
        return replace(self, weight_version_routes=(route, *(r for r in self.weight_version_routes if r != route)))


OWN_ENGINE = Dialect(
    name=OWN_ENGINE_VERSION, sglang=False, version=None, load_routes=("/get_load",),
    weight_version_routes=("/get_weight_version",), health_route="/health", slow_health=False, load_fields={},
    drain_before_load=False, flush_after_load=False,  # it keeps no prefix cache: nothing to flush
    extension_fields=EXTENSION_FIELDS, live_updates=True)
# SGLang up to 0.5.20; each read falls back to the 0.5.21 route on a 404 (see the module docstring).
SGLANG_LEGACY = Dialect(
    name="sglang", sglang=True, version=None, load_routes=("/get_load", "/v1/loads?include=core"),
    weight_version_routes=("/get_weight_version", "/model_info"), health_route="/health", slow_health=True,
    load_fields={}, drain_before_load=True, flush_after_load=False, extension_fields=frozenset(),
    live_updates=False)
# SGLang from 0.5.21.
SGLANG_CURRENT = replace(SGLANG_LEGACY, load_routes=("/v1/loads?include=core",),
                         weight_version_routes=("/model_info",), load_fields={"flush_cache": False},
                         drain_before_load=False, flush_after_load=True)


def parse_version(raw: Any) -> Version | None:
    """``(major, minor, patch)`` of an SGLang version string ("0.5.10rc1", "0.5.3.post1"); None if none."""
    m = _VERSION.match(raw) if isinstance(raw, str) else None
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def _fmt(v: Version) -> str:
    return ".".join(map(str, v))


def sglang_dialect(version: Version | None) -> Dialect:
    """SGLang's dialect for ``version`` (None: not readable — the legacy routes with their fallbacks)."""
    if version is None:
        return replace(SGLANG_LEGACY, name="sglang (version unknown)",
                       note="its server info carries no SGLang version; every route is tried in turn")
    note = None
    if not FIRST_SUPPORTED <= version <= LAST_SUPPORTED:
        note = (f"SGLang {_fmt(version)} is outside the supported {_fmt(FIRST_SUPPORTED)} - "
                f"{_fmt(LAST_SUPPORTED)}; speaking the nearest supported release's routes")
    base = SGLANG_CURRENT if version >= ROUTES_MOVED else SGLANG_LEGACY
    return replace(base, name=f"sglang {_fmt(version)}", version=version, note=note)


def dialect_for(server_info: Any) -> Dialect:
    """The dialect of an engine whose ``/server_info`` (or ``/get_server_info``) body is ``server_info``
    (None: it has neither route)."""
    raw = server_info.get("version") if isinstance(server_info, Mapping) else None
    if raw == OWN_ENGINE_VERSION:
        return OWN_ENGINE
    return sglang_dialect(parse_version(raw))


def live_refusal(dialect: Dialect) -> str | None:
    """Why ``proxy.weight_updates: live`` cannot run on this engine; None when it can."""
    if dialect.live_updates:
        return None
    return (f"proxy.weight_updates: live needs an engine that swaps weights between decode steps and tags "
            f"tokens per version (this project's engine); {dialect.name} waits for running requests "
            f"before it loads, so a load can outlast proxy.request_timeout_s. Use weight_updates: pause")


def sendable(body: Mapping[str, Any], dialect: Dialect) -> dict[str, Any]:
    """``body`` without the extension fields this engine does not know (SGLang: never sent)."""
    return {k: v for k, v in body.items() if k not in EXTENSION_FIELDS or k in dialect.extension_fields}


def loads_of(body: Any) -> Any:
    """The per-rank list of a load answer: ``/get_load``'s list as is, ``/v1/loads``' ``loads``."""
    if isinstance(body, Mapping) and isinstance(body.get("loads"), list):
        return body["loads"]
    return body


def weight_version_of(body: Any) -> str | None:
    """``weight_version`` of a ``/get_weight_version`` or ``/model_info`` answer."""
    if isinstance(body, Mapping) and body.get("weight_version") is not None:
        return str(body["weight_version"])
    return None


def stream_error(event: Any) -> Mapping[str, Any] | None:
    """SGLang's in-stream error event (``{"error": {"message": ...}}``), else None."""
    if isinstance(event, Mapping) and "error" in event and "meta_info" not in event:
        return event
    return None
