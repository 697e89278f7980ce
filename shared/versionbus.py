"""Weight-version bus (docs/architecture.md#weight-versions): the key is the truth, pub/sub only wakes subscribers up.

Publishing sets ``{p}:weights:latest``, appends to ``{p}:weights:log`` and publishes on
``{p}:weights`` in one MULTI/EXEC, guarded by WATCH so a version that is not newer than the
latest is refused (``VersionRegression``). A watcher subscribes first, then reads the key (no
publication can fall between the two unseen), re-reads the key on every message and on a timer,
and reports a version only if it is newer than the last one it reported: what a subscriber sees
never goes backwards, and one that was disconnected catches up on its next read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from shared.errors import MalformedEntry, VersionRegression
from shared.keys import Keys
from shared.redisconn import is_cluster_client
from shared.retry import Backoff
from shared.schemas import WeightVersion
from shared.streams import next_id
from shared.versions import version_newer

log = logging.getLogger(__name__)
WAKE_S = 0.1  # the longest VersionWatcher.stop waits for its thread (between two reads of the bus)


def parse_version(raw: Any) -> WeightVersion | None:
    """The value of ``{p}:weights:latest`` as read (None when unset); `MalformedEntry` when it is not one."""
    if raw is None:
        return None
    try:
        return WeightVersion.model_validate_json(raw)
    except ValueError as exc:
        raise MalformedEntry(f"weights:latest is not a WeightVersion: {exc}") from exc


def read_log(r: redis.Redis, keys: Keys, cursor: str = "0-0") -> tuple[str, list[str]]:
    """Versions published after ``cursor`` in ``{p}:weights:log`` (oldest first) and the new cursor:
    the one way to follow the publication log incrementally (the collector orders its window by it)."""
    new = r.xrange(keys.weights_log, min=next_id(cursor), max="+")
    if not new:
        return cursor, []
    last = new[-1][0]
    versions = [v.decode() if isinstance(v, bytes) else str(v) for _, f in new if (v := f.get(b"version")) is not None]
    return (last.decode() if isinstance(last, bytes) else str(last)), versions


def read_latest(r: redis.Redis, keys: Keys) -> WeightVersion | None:
    return parse_version(r.get(keys.weights_latest))


def publish_version(r: redis.Redis, keys: Keys, wv: WeightVersion, log_maxlen: int = 10_000,
                    replace: Callable[[WeightVersion], bool] | None = None) -> None:
    """Announce ``wv``; refuses a version that is not newer than the one already published, unless
    ``replace(current)`` says the current one is not genuine (the trainer's forged-latest guard):
    then ``wv`` overwrites it, in the same guarded transaction."""
    body = wv.model_dump_json()
    clustered = is_cluster_client(r)
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.weights_latest)
                current = parse_version(pipe.get(keys.weights_latest))
                forged = current is not None and replace is not None and replace(current)
                if current is not None and not forged and not version_newer(wv.version, current.version):
                    raise VersionRegression(f"version {wv.version!r} is not newer than the latest {current.version!r}")
                pipe.multi()
                pipe.set(keys.weights_latest, body)
                pipe.xadd(keys.weights_log, {"version": wv.version, "path": wv.path, "step": str(wv.step),
                                             "published_at": repr(wv.published_at)},
                          maxlen=log_maxlen, approximate=True)
                if not clustered:
                    pipe.publish(keys.weights_channel, body)
                pipe.execute()
                break
            except redis.WatchError:
                continue  # someone published meanwhile: re-check against the new latest
    if clustered:  # a cluster MULTI refuses PUBLISH (no key); the key is the truth, watchers re-read it each tick
        r.publish(keys.weights_channel, body)
    log.info("published version=%s step=%d path=%s", wv.version, wv.step, wv.path)


def published_versions(r: redis.Redis, keys: Keys, count: int | None = None) -> list[str]:
    """Published version labels, oldest first (the order the window uses when it knows them)."""
    entries = r.xrange(keys.weights_log, count=count) if count else r.xrange(keys.weights_log)
    out: list[str] = []
    for _, fields in entries:
        v = fields.get(b"version") or fields.get("version")
        if v is not None:
            out.append(v.decode() if isinstance(v, bytes) else str(v))
    return out


class VersionWatcher:
    """Background follower of the version bus; calls ``on_version`` for each newer version, in order.

    ``redis_factory`` builds a fresh client (a new connection after failures). Failures are logged
    and retried with bounded exponential backoff; the key is re-read after every reconnect, so a
    version published while the watcher was away is delivered on return.
    """

    def __init__(self, redis_factory: Callable[[], redis.Redis], keys: Keys,
                 on_version: Callable[[WeightVersion], None] | None = None, poll_s: float = 1.0,
                 backoff_max_s: float = 5.0) -> None:
        self._factory, self._keys, self._on_version = redis_factory, keys, on_version
        self._poll_s, self._backoff_max = poll_s, backoff_max_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.latest: WeightVersion | None = None
        self.changed = threading.Condition()

    def offer(self, wv: WeightVersion | None) -> bool:
        """Accept ``wv`` if newer than what was seen; returns True when it was delivered."""
        if wv is None:
            return False
        with self._lock:
            if self.latest is not None and not version_newer(wv.version, self.latest.version):
                return False
            self.latest = wv
        log.info("observed version=%s step=%d", wv.version, wv.step)
        if self._on_version is not None:
            self._on_version(wv)
        with self.changed:
            self.changed.notify_all()
        return True

    def refresh(self, r: redis.Redis) -> bool:
        return self.offer(read_latest(r, self._keys))

    def wait_for(self, predicate: Callable[[WeightVersion | None], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate(self.latest):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return True

    def start(self) -> VersionWatcher:
        self._thread = threading.Thread(target=self._run, name="version-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        backoff = Backoff(max_s=self._backoff_max)
        while not self._stop.is_set():
            try:
                r = self._factory()
                pubsub = r.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._keys.weights_channel)
                try:
                    self.refresh(r)  # after subscribing: nothing published from now on can be missed
                    backoff.reset()
                    due = time.monotonic() + self._poll_s
                    while not self._stop.is_set():
                        # Short waits, so that ``stop`` returns within WAKE_S; the key is still read once per poll.
                        msg = pubsub.get_message(timeout=min(self._poll_s, WAKE_S))
                        if msg is None and time.monotonic() < due:
                            continue
                        # On a message *and* on every timer tick the key is the truth.
                        self.refresh(r)
                        due = time.monotonic() + self._poll_s
                finally:
                    try:
                        pubsub.close()
                    except redis.RedisError:
                        pass
            except (redis.RedisError, OSError, MalformedEntry) as exc:
                delay = backoff.next()
                log.warning("version watcher error (%s: %s); retrying in %.1fs", type(exc).__name__, exc, delay)
                self._stop.wait(delay)

