"""The proxy's keep-alive HTTP/1.1 client against tiny in-test asyncio servers on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from shared.http_transport import ConnectFailed, RawHttp, RequestFailed, _read_reply
from shared.redisproc import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def parse(raw: bytes) -> tuple[int, bytes, bool]:
    async def go() -> tuple[int, bytes, bool]:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        status, _, body, keep = await _read_reply(reader)
        return status, body, keep
    return asyncio.run(go())


def test_content_length_chunked_and_close_delimited_bodies() -> None:
    assert parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi") == (200, b"hi", True)
    chunked = b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    assert parse(chunked) == (201, b"abcde", True)
    assert parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx") == (200, b"x", False)
    assert parse(b"HTTP/1.0 200 OK\r\n\r\nrest") == (200, b"rest", False)
    with pytest.raises(ValueError):
        parse(b"HTTP/1.1 abc OK\r\n\r\n")


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}"


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), 10))


def test_keep_alive_reuses_one_connection_and_sends_json() -> None:
    connections: list[int] = []
    seen: list[Any] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            n = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            seen.append(json.loads(await reader.readexactly(n)) if n else None)
            body = b'{"ok":true}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    async def flow() -> None:
        server, url = await _serve(echo)
        http = RawHttp()
        for i in range(3):
            assert await http.request("POST", f"{url}/generate", {"i": i}, 5) == (200, b'{"ok":true}')
        assert await http.request("GET", f"{url}/x?y=1", None, 5) == (200, b'{"ok":true}')
        await http.close()
        server.close()

    run(flow)
    assert len(connections) == 1 and seen == [{"i": 0}, {"i": 1}, {"i": 2}, None]


def test_refused_connection_is_connect_failed() -> None:
    async def flow() -> None:
        with pytest.raises(ConnectFailed):
            await RawHttp(connect_timeout=1).request("POST", f"http://127.0.0.1:{free_port()}/generate", {}, 5)
    run(flow)


def test_broken_or_silent_server_after_sending_is_request_failed() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")  # then dies mid-body
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async def flow() -> None:
        server, url = await _serve(hang_up)
        with pytest.raises(RequestFailed) as broken:
            await RawHttp().request("POST", f"{url}/generate", {}, 5)
        assert not broken.value.timed_out
        server.close()
        server, url = await _serve(silent)
        with pytest.raises(RequestFailed) as slow:
            await RawHttp().request("POST", f"{url}/generate", {}, 0.2)
        assert slow.value.timed_out
        server.close()

    run(flow)


def test_exchange_sends_extra_headers_returns_the_reply_headers_and_refuses_header_injection() -> None:
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async def go() -> Any:
        server, url = await _serve(answer)
        http = RawHttp(bearer="k")
        try:
            reply = await http.exchange("POST", f"{url}/x", {"a": 1}, 5, {"X-Session-Id": "s-1"})
            with pytest.raises(ValueError, match="CR/LF"):
                await http.exchange("POST", f"{url}/x", None, 5, {"X-Session-Id": "s\r\nEvil: 1"})
            return reply
        finally:
            await http.close()
            server.close()

    reply = run(go)
    assert reply.status == 503 and reply.headers["retry-after"] == "2" and reply.body == b"{}"
    assert b"\r\nX-Session-Id: s-1\r\n" in heads[0] and b"\r\nAuthorization: Bearer k\r\n" in heads[0]
    assert len(heads) == 1  # the refused request never reached the server
