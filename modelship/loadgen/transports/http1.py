"""KServe v2 HTTP/REST over raw keep-alive HTTP/1.1 connections: the transport for
``http://`` endpoints.

Each distinct request is one prebuilt byte string written in one call, and the answer is
cut at ``Content-Length`` in place, because the client's CPU is taken from the server
under test on a small machine (see :class:`HttpConnection`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from modelship.loadgen.spec import LoadSpec, Target
from modelship.loadgen.transports.base import RequestFailed, Requests, no_delay
from modelship.loadgen.transports.kserve_http import (
    answer_outputs,
    build_body,
    failed_answer,
    http_address,
    infer_path,
    model_version,
)


class HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: one request at a time, answer parsed in place.

    Why not aiohttp for the hot path: per request it builds a request object, a header
    multidict, a response and a stream reader, ~5× the CPU of writing a prebuilt request
    and cutting the answer at ``Content-Length``; on a 2-core machine that CPU is taken
    from the server under test. Triton answers every inference with ``Content-Length``
    (chunked answers are decoded too, should a proxy re-encode them).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes, bytes]] | None = None
        self._need = -1
        self._head = b""
        self.answered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = no_delay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            # A kept-alive connection closed before any byte of this answer: the server
            # closed it between requests (a proxy's graceful reload does, after an answer
            # that said keep-alive) and never read this one.
            unread = self.answered > 0 and not self._buffer and self._need < 0
            self._waiter.set_exception(RequestFailed(
                f"ConnectionError: the server closed the connection ({exc or 'EOF'})",
                unread=unread))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes, bytes]]:
        """Send ``data``; the future gives ``(status, header block, body)``."""
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._need = -1
        self.transport.write(data)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        if self._need < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head = bytes(buf[:end])
            del buf[: end + 4]
            length = header_value(self._head, b"content-length")
            if length is None:
                self._need = -2  # chunked (or close-delimited): decode when complete
            else:
                self._need = int(length)
        if self._need >= 0:
            if len(buf) < self._need:
                return
            body = bytes(buf[: self._need])
            del buf[: self._need]
        else:
            decoded = _dechunk(buf)
            if decoded is None:
                return
            body, used = decoded
            del buf[:used]
        waiter, self._waiter = self._waiter, None
        self.answered += 1
        if header_value(self._head, b"connection") == b"close" and self.transport is not None:
            self.closed = True  # now: connection_lost comes a loop turn later
            self.transport.close()
        if waiter is not None and not waiter.done():
            status = int(self._head[9:12])
            waiter.set_result((status, self._head, body))


def header_value(head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lowercase) in an HTTP header block, or None."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def _dechunk(buf: bytearray) -> tuple[bytes, int] | None:
    """A complete chunked body and the bytes it used, or None while incomplete."""
    out = bytearray()
    pos = 0
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        start = eol + 2
        if len(buf) < start + size + 2:
            return None
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)
            return (bytes(out), end + 4) if end >= 0 else None
        out += buf[start: start + size]
        pos = start + size + 2


class RawHttpTransport:
    """KServe v2 HTTP/REST with binary tensors over plain keep-alive connections.

    Each distinct request is one prebuilt byte string (request line, headers, JSON header
    and tensor bytes) written in one call; the answer's ``model_version`` is read from its
    JSON header. ``keep_outputs`` decodes the tensors with tritonclient, off the hot path
    otherwise.
    """

    def __init__(self, targets: Sequence[Target], payload: Mapping[str, np.ndarray],
                 spec: LoadSpec) -> None:
        self._timeout_s = spec.timeout_s
        self._keep_outputs = spec.keep_outputs
        self._addresses = [http_address(t.url) for t in targets]
        self._idle: dict[tuple[str, int], list[HttpConnection]] = {}
        self._all: list[HttpConnection] = []
        self._paths = [infer_path(t) for t in targets]
        self._requests = Requests(targets, payload, spec.batch_size, self._build)
        #: requests sent again because the server had closed their kept-alive connection
        #: before reading them
        self.resent = 0

    def _build(self, target: Target, arrays: dict[str, np.ndarray]) -> bytes:
        """The whole request (request line, headers and body) as one byte string."""
        body, headers = build_body(target, arrays)
        host, port = http_address(target.url)
        head = [f"POST {infer_path(target)} HTTP/1.1", f"Host: {host}:{port}",
                f"Content-Length: {len(body)}", "Connection: keep-alive",
                *[f"{k}: {v}" for k, v in headers.items()]]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body

    async def _connection(self, address: tuple[str, int], *, fresh: bool = False
                          ) -> HttpConnection:
        """An idle connection to ``address`` (unless ``fresh``), or a new one (within the
        request timeout)."""
        idle = self._idle.setdefault(address, [])
        while idle and not fresh:
            conn = idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(HttpConnection, *address), self._timeout_s)
        except (OSError, TimeoutError) as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None
        self._all.append(conn)
        return conn

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        """One request on an idle connection; a failed one closes its connection. One the
        server closed its kept-alive connection on before reading it is sent once more,
        on a new connection (the other idle ones may be closing too)."""
        address = self._addresses[target]
        try:
            status, head, content = await self._exchange(address, target, request)
        except RequestFailed as exc:
            if not exc.unread:
                raise
            self.resent += 1
            status, head, content = await self._exchange(address, target, request, fresh=True)
        length = header_value(head, b"inference-header-content-length")
        if status != 200:
            raise failed_answer(status, content)
        header = content[: int(length)] if length else content
        outputs = None
        if self._keep_outputs:
            outputs = answer_outputs(content, int(length) if length else None)
        return model_version(header), outputs

    async def _exchange(self, address: tuple[str, int], target: int, request: int, *,
                        fresh: bool = False) -> tuple[int, bytes, bytes]:
        conn = await self._connection(address, fresh=fresh)
        waiter = conn.request(self._requests.get(target, request))
        timer = asyncio.get_running_loop().call_later(
            self._timeout_s, _expire, waiter, self._timeout_s)
        try:
            answer = await waiter
        except RequestFailed:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()
            raise
        finally:
            timer.cancel()
        if not conn.closed:
            self._idle[address].append(conn)
        return answer

    async def close(self) -> None:
        """Close every connection this transport opened."""
        for conn in self._all:
            if conn.transport is not None:
                conn.transport.close()


def _expire(waiter: asyncio.Future[Any], timeout_s: float) -> None:
    """Fail a request still waiting at its timeout."""
    if not waiter.done():
        waiter.set_exception(RequestFailed(f"TimeoutError: no answer within {timeout_s:g} s"))

