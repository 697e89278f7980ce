"""HTTP transports between our services: a lean keep-alive HTTP/1.1 client (production: the proxy
to its engines, a rollout worker to the proxy) and an httpx adapter (tests route it to in-process
ASGI fakes or mock transports). Both honour one small interface.

Why not httpx in production: measured on the proxy's hot path, httpx's connection pool does
work quadratic in the number of concurrent requests, and it writes a request's headers and body
in two syscalls; this client writes each request in one, keeps idle connections in a LIFO per
origin, and parses only what our servers answer (Content-Length or chunked bodies). In a rollout
worker httpx took 70 % of the process's CPU (py-spy, the async-vs-sync bench), most of it in the
pool's per-request scan of its connections.

Failure contract, which decides whether a request may be sent again elsewhere:
* ``ConnectFailed`` — no connection could be made: the request was certainly not sent;
* ``RequestFailed`` — the connection broke or timed out after the request was (maybe) sent: the
  server may be running it, so it is never resent automatically.
A pooled connection is reused only if it is still open and idle for less than ``max_idle_s``
(below the servers' keep-alive timeout: ``shared.serving.KEEP_ALIVE_S`` for ours, uvicorn's
default 5 s for others), so a server-side idle close cannot race a reuse in practice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

MAX_HEADER_BYTES = 64 * 1024


class TransportError(Exception):
    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class ConnectFailed(TransportError):
    """No connection: the request was not sent."""


class RequestFailed(TransportError):
    """The connection broke or timed out after the request was (maybe) sent."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]  # lower-cased names
    body: bytes


class Transport(Protocol):
    async def request(self, method: str, url: str, body: Any | None, timeout: float) -> tuple[int, bytes]:
        """``(status, body bytes)`` of one request with a JSON body (None: no body)."""
        ...

    async def exchange(self, method: str, url: str, body: Any | None, timeout: float,
                       headers: Mapping[str, str] | None = None) -> Reply:
        """One request with extra ``headers``; the reply with its headers."""
        ...

    def stream(self, method: str, url: str, body: Any | None, timeout: float) -> AsyncIterator[tuple[int, bytes]]:
        """``(status, piece)`` for each piece of the body as it arrives (SSE responses);
        ``timeout`` bounds each wait for the next piece."""
        ...

    async def close(self) -> None: ...


class _Pool:
    """Idle keep-alive connections to one ``scheme://host:port``."""

    def __init__(self, url: str, connect_timeout: float, max_idle_s: float, max_idle: int) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = f"{self.host}:{self.port}".encode()
        self.connect_timeout, self.max_idle_s, self.max_idle = connect_timeout, max_idle_s, max_idle
        self.idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = deque()

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        now = time.monotonic()
        while self.idle:
            reader, writer, since = self.idle.pop()  # LIFO: the warmest connection first
            if not writer.is_closing() and not reader.at_eof() and now - since < self.max_idle_s:
                return reader, writer
            writer.close()
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, ssl=ssl.create_default_context() if self.tls else None,
                    limit=MAX_HEADER_BYTES)
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"connect failed ({type(exc).__name__})", isinstance(exc, TimeoutError)) from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    def release(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.idle) < self.max_idle:
            self.idle.append((reader, writer, time.monotonic()))
        else:
            writer.close()

    def close(self) -> None:
        while self.idle:
            self.idle.pop()[1].close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bool]:
    """``(status, lower-cased headers, keep_alive)`` of a response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, status_text = lines[0].split(" ", 2)[:2]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    return int(status_text), headers, keep


async def _read_chunk(reader: asyncio.StreamReader) -> bytes | None:
    """One piece of a chunked body; None after the last one (trailers consumed)."""
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
    if size == 0:
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
        return None
    return (await reader.readexactly(size + 2))[:-2]


async def _read_plain(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes, bool]:
    """``(status, headers, body, keep_alive)``; raises ValueError on a malformed response."""
    status, headers, keep = await _read_head(reader)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while (piece := await _read_chunk(reader)) is not None:
            parts.append(piece)
        return status, headers, b"".join(parts), keep
    return status, headers, await _read_plain(reader, headers), keep and "content-length" in headers


def _header_bytes(headers: Mapping[str, str] | None) -> bytes:
    """Extra request headers; a CR or LF in a name or value is refused (no header injection)."""
    if not headers:
        return b""
    out = b""
    for name, value in headers.items():
        if any(c in name + value for c in "\r\n"):
            raise ValueError(f"header {name!r}: CR/LF not allowed")
        out += f"{name}: {value}\r\n".encode("latin-1")
    return out


def _request_bytes(pool: _Pool, method: str, url: str, body: Any | None, auth: bytes = b"",
                   headers: Mapping[str, str] | None = None) -> tuple[bytes, bytes]:
    """Request line + headers, and the JSON body, of one request."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
    head = (f"{method} {target} HTTP/1.1\r\nHost: ".encode() + pool.host_header
            + b"\r\nContent-Type: application/json\r\n" + auth + _header_bytes(headers)
            + b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n")
    return head, payload


class RawHttp:
    """Keep-alive HTTP/1.1 over asyncio streams; one pool per engine origin."""

    def __init__(self, connect_timeout: float = 2.0, max_idle_s: float = 2.0, max_idle: int = 512,
                 bearer: str | None = None) -> None:
        self._connect_timeout, self._max_idle_s, self._max_idle = connect_timeout, max_idle_s, max_idle
        self._auth = f"Authorization: Bearer {bearer}\r\n".encode() if bearer else b""  # the engines' api_key
        self._pools: dict[str, _Pool] = {}

    def _pool(self, url: str) -> _Pool:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _Pool(origin, self._connect_timeout, self._max_idle_s, self._max_idle)
        return pool

    async def request(self, method: str, url: str, body: Any | None, timeout: float) -> tuple[int, bytes]:
        reply = await self.exchange(method, url, body, timeout)
        return reply.status, reply.body

    async def exchange(self, method: str, url: str, body: Any | None, timeout: float,
                       headers: Mapping[str, str] | None = None) -> Reply:
        pool = self._pool(url)
        head, payload = _request_bytes(pool, method, url, body, self._auth, headers)
        reader, writer = await pool.connect()
        try:
            writer.write(head + payload)  # one write: headers and body together
            async with asyncio.timeout(timeout):
                status, reply_headers, data, keep = await _read_reply(reader)
        except TimeoutError:
            writer.close()
            raise RequestFailed("no response in time", timed_out=True) from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            raise RequestFailed(f"connection failed ({type(exc).__name__})") from None
        except BaseException:  # cancelled: the connection is in an unknown state
            writer.close()
            raise
        if keep:
            pool.release(reader, writer)
        else:
            writer.close()
        return Reply(status, reply_headers, data)

    async def stream(self, method: str, url: str, body: Any | None,
                     timeout: float) -> AsyncIterator[tuple[int, bytes]]:
        pool = self._pool(url)
        head, payload = _request_bytes(pool, method, url, body, self._auth)
        reader, writer = await pool.connect()
        done = False
        try:
            writer.write(head + payload)
            try:
                async with asyncio.timeout(timeout):
                    status, headers, keep = await _read_head(reader)
                if headers.get("transfer-encoding", "").lower() != "chunked":
                    async with asyncio.timeout(timeout):
                        data = await _read_plain(reader, headers)
                    keep = keep and "content-length" in headers
                    yield status, data
                else:
                    while True:
                        async with asyncio.timeout(timeout):
                            piece = await _read_chunk(reader)
                        if piece is None:
                            break
                        yield status, piece
            except TimeoutError:
                raise RequestFailed("no response in time", timed_out=True) from None
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                raise RequestFailed(f"connection failed ({type(exc).__name__})") from None
            done = True
        finally:  # closed early (cancelled, caller stopped reading) or broken: drop the connection
            if done and keep:
                pool.release(reader, writer)
            else:
                writer.close()

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@contextlib.contextmanager
def _httpx_failures() -> Iterator[None]:
    """httpx's failures as this module's: ``ConnectFailed`` (no connection made) or ``RequestFailed``."""
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ConnectFailed(type(exc).__name__, isinstance(exc, httpx.ConnectTimeout)) from None
    except httpx.TimeoutException:
        raise RequestFailed("no response in time", timed_out=True) from None
    except httpx.TransportError as exc:
        raise RequestFailed(type(exc).__name__) from None


class HttpxTransport:
    """The same interface over an ``httpx.AsyncClient`` (tests mount in-process ASGI fakes)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def request(self, method: str, url: str, body: Any | None, timeout: float) -> tuple[int, bytes]:
        reply = await self.exchange(method, url, body, timeout)
        return reply.status, reply.body

    async def exchange(self, method: str, url: str, body: Any | None, timeout: float,
                       headers: Mapping[str, str] | None = None) -> Reply:
        with _httpx_failures():
            resp = await self._client.request(method, url, json=body, timeout=timeout, headers=headers)
        return Reply(resp.status_code, {k.lower(): v for k, v in resp.headers.items()}, resp.content)

    async def stream(self, method: str, url: str, body: Any | None,
                     timeout: float) -> AsyncIterator[tuple[int, bytes]]:
        with _httpx_failures():
            async with self._client.stream(method, url, json=body, timeout=timeout) as resp:
                async for piece in resp.aiter_bytes():
                    yield resp.status_code, piece

    async def close(self) -> None:
        await self._client.aclose()
