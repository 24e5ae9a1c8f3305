"""The raw HTTP/1.1 transport against a loopback server that closes kept-alive connections
the way a proxy's graceful reload does (nginx answers with ``keep-alive``, then closes):
a request the server never read is sent once more on a new connection; one it may have
read never is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest

from modelship.loadgen import LoadSpec, RequestFailed, Target
from modelship.loadgen.transports.http1 import RawHttpTransport

PAYLOAD = {"input": np.arange(8, dtype=np.float32).reshape(4, 2)}
ANSWER = b'{"model_name":"m","model_version":"3","outputs":[]}'


@dataclass
class Seen:
    requests: int = 0
    connections: int = 0
    plan: list[str] = field(default_factory=list)


@asynccontextmanager
async def server(plan: list[str]) -> AsyncIterator[tuple[str, Seen]]:
    """Each connection takes the next step of ``plan`` for its requests:

    - ``keep``: answer every request, keep the connection;
    - ``once``: answer one request with keep-alive, then close without reading more;
    - ``half``: read the request, send half an answer, close;
    - ``drop``: read the request, close without a byte.
    """
    seen = Seen(plan=list(plan))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        mode = seen.plan.pop(0) if seen.plan else "keep"
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                seen.requests += 1
                answer = (b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: "
                          + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)
                if mode == "half":
                    writer.write(answer[:20])
                    break
                if mode == "drop":
                    break
                writer.write(answer)
                await writer.drain()
                if mode == "once":
                    await asyncio.sleep(0.05)  # the client has the answer and reuses the conn
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", seen
    finally:
        srv.close()


def _transport(url: str) -> RawHttpTransport:
    return RawHttpTransport([Target(url, "m", "3")], PAYLOAD,
                            LoadSpec(protocol="http", concurrency=1, timeout_s=5.0))


async def _run(plan: list[str], calls: int) -> tuple[list[str], int, Seen]:
    """Each call's answer version or error text, the transport's resends, the server's view."""
    async with server(plan) as (url, seen):
        transport = _transport(url)
        results = []
        try:
            for i in range(calls):
                try:
                    # the next request follows at once, as under load: it races the close
                    results.append((await transport.send(0, i))[0])
                except RequestFailed as exc:
                    results.append(str(exc))
        finally:
            await transport.close()
    return results, transport.resent, seen


def test_a_request_on_a_kept_alive_connection_closed_unread_is_sent_again() -> None:
    results, resent, seen = asyncio.run(_run(["once", "keep"], 3))
    assert results == ["3", "3", "3"]
    assert resent == 1
    # the resent request was read once: the closed connection never read it
    assert seen.requests == 3 and seen.connections == 2


@pytest.mark.parametrize("mode", ["half", "drop"])
def test_a_request_the_server_may_have_read_is_never_sent_again(mode: str) -> None:
    # a first request on a new connection ("drop"), or an answer cut half-way ("half"):
    # the server read it, so it fails as it is
    results, resent, seen = asyncio.run(_run([mode], 1))
    assert results[0].startswith("ConnectionError: the server closed the connection")
    assert resent == 0 and seen.requests == 1


def test_a_request_is_sent_again_once_at_most() -> None:
    # the resend goes on a new connection, which the server closes after reading it: that
    # one may have run, so the request fails (no second resend)
    results, resent, seen = asyncio.run(_run(["once", "drop"], 2))
    assert results[0] == "3"
    assert results[1].startswith("ConnectionError: the server closed the connection")
    assert resent == 1 and seen.requests == 2


def test_connection_close_takes_the_connection_out_of_the_pool_at_once() -> None:
    async def scenario() -> tuple[list[str], int, int]:
        async with server([]) as (url, seen):
            transport = _transport(url)
            conn = await transport._connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            waiter = conn.request(b"GET / HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            conn.data_received(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2"
                               b"\r\n\r\nok")
            await waiter
            closed = conn.closed
            await transport.close()
            return [str(closed)], seen.requests, 0

    assert asyncio.run(scenario())[0] == ["True"]
