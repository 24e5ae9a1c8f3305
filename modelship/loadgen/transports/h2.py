"""A hand-written HTTP/2 client connection for unary gRPC calls (RFC 9113 framing; RFC 7541
header compression: literal blocks out, ``hpack`` to decode what comes in).

Why not grpc.aio for the hot path: its per-call machinery (call objects, metadata,
interceptor checks, a completion queue polled from the event loop) costs ~250-450 µs of
client CPU per request here, 2-4x the raw HTTP transport, and that CPU is taken from the
server under test on a small machine. Measured (``bench/loadgen``, interleaved A/B
medians, 2 busy cores, concurrency 16 / 1): ≈ 55-67 / 180-240 µs against grpc.aio's
≈ 190-260 / 460-670 µs per request.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Sequence
from urllib.parse import unquote

from modelship.loadgen.transports.base import RequestFailed, no_delay

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_FRAME = struct.Struct(">HBBBI")  # 24-bit length as (high 16, low 8), type, flags, stream
_H2_DATA, _H2_HEADERS, _H2_RST_STREAM, _H2_SETTINGS = 0x0, 0x1, 0x3, 0x4
_H2_PING, _H2_GOAWAY, _H2_WINDOW_UPDATE, _H2_CONTINUATION = 0x6, 0x7, 0x8, 0x9
#: RST_STREAM REFUSED_STREAM: the stream was closed before any processing (RFC 9113 8.7).
_H2_REFUSED_STREAM = 0x7
_H2_END_STREAM, _H2_ACK, _H2_END_HEADERS, _H2_PADDED, _H2_PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
_H2_MAX_WINDOW = 2**31 - 1
_H2_DEFAULT_WINDOW = 65_535
_H2_DEFAULT_FRAME = 16_384
#: Stream ids are 31-bit and never reused; a connection past this opens a successor.
_H2_LAST_STREAM_ID = 2**30
#: Decoded header blocks kept per connection (a gRPC answer has two distinct ones).
_HPACK_CACHE_BLOCKS = 64
#: Largest gRPC message the raw transport sends (one DATA frame within HTTP/2's default
#: window and frame size); larger requests go through grpc.aio.
RAW_GRPC_MAX_MESSAGE_BYTES = _H2_DEFAULT_FRAME - 5
_GRPC_STATUS = {0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT",
                4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND", 6: "ALREADY_EXISTS",
                7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
                10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL",
                14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED"}



def _h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return _H2_FRAME.pack(size >> 8, size & 0xFF, kind, flags, stream) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 §5.1 integer with an N-bit prefix, OR-ed into ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal_block(headers: Sequence[tuple[str, str]]) -> bytes:
    """A header block of literal fields without indexing (no Huffman, no table), so it
    means the same on every stream of any connection and can be built once."""
    block = bytearray()
    for name, value in headers:
        block += b"\x00"
        for text in (name.encode(), value.encode()):
            block += _hpack_int(len(text), 7) + text
    return bytes(block)


def grpc_timeout(seconds: float) -> str:
    """The ``grpc-timeout`` header: at most 8 digits and a unit (here ms, or s)."""
    millis = max(1, math.ceil(seconds * 1000))
    return f"{millis}m" if millis < 10**8 else f"{min(math.ceil(seconds), 10**8 - 1)}S"


class H2Stream:
    """One open call: its waiter, deadline and the answer's data and headers so far."""

    __slots__ = ("waiter", "data", "headers", "timer", "stream_id", "deadline", "timeout_s")

    def __init__(self, waiter: asyncio.Future[tuple[bytes, dict[str, str]]], deadline: float,
                 timeout_s: float) -> None:
        self.waiter = waiter
        self.deadline = deadline  # on the event loop's clock
        self.timeout_s = timeout_s
        self.stream_id = 0
        self.data = bytearray()
        self.headers: dict[str, str] = {}
        self.timer: asyncio.TimerHandle | None = None


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying unary gRPC calls, many streams at a time.

    It writes one prebuilt HEADERS and DATA frame per call and reads the answer's frames in
    place. It honours the server's SETTINGS (stream limit, initial window, frame size), the
    connection's send window, PING and GOAWAY; it opens its own receive windows to the
    maximum.
    """

    def __init__(self) -> None:
        # Lazy: hpack is optional (it comes with httpx[http2]); raw_grpc_fits checks for it.
        import hpack

        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decoder = hpack.Decoder()
        self._decoded: dict[bytes, list[tuple[str, str]]] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self._buffer = bytearray()
        self._streams: dict[int, H2Stream] = {}
        self._next_id = 1
        self._send_window = _H2_DEFAULT_WINDOW
        self._peer_stream_window = _H2_DEFAULT_WINDOW
        self._peer_max_streams = _H2_MAX_WINDOW
        self._received = 0
        self._queued: list[tuple[H2Stream, bytes, bytes]] = []
        self._partial: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self._out: list[bytes] = []

    # ------------------------------------------------------------------ asyncio side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = no_delay(transport)
        settings = struct.pack(">HIHI", 0x2, 0, 0x4, _H2_MAX_WINDOW)  # no push, max window
        transport.write(
            _H2_PREFACE
            + _h2_frame(_H2_SETTINGS, 0, 0, settings)
            + _h2_frame(_H2_WINDOW_UPDATE, 0, 0,
                        struct.pack(">I", _H2_MAX_WINDOW - _H2_DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        # The open streams may have been processed: only the queued ones were never sent.
        self._fail_all(f"UNAVAILABLE: the server closed the connection ({exc or 'EOF'})")
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _fail_all(self, text: str, above: int = 0, *, unread: bool = False) -> None:
        """Close to new calls; fail the queued calls (never sent: unread) and the open ones
        above ``above`` (``unread`` when the server said it did not process them)."""
        self.closed = True
        if not self.ready.done():
            self.ready.set_exception(RequestFailed(text))
        queued, self._queued = self._queued, []
        for stream, _, _ in queued:
            if stream.timer is not None:
                stream.timer.cancel()
            if not stream.waiter.done():
                stream.waiter.set_exception(RequestFailed(text, unread=True))
        for stream_id in [s for s in self._streams if s > above]:
            self._finish(stream_id, RequestFailed(text, unread=unread))

    def _write(self, frame: bytes) -> None:
        """Queue a frame; everything queued in one turn of the event loop goes out in one
        write. Answers arrive in bursts (Triton batches), and one syscall per burst instead
        of one per call is a large share of the client's CPU at high concurrency."""
        if not self._out and len(self._streams) <= 1:  # a lone call: nothing to batch with
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(frame)
            return
        self._out.append(frame)
        if len(self._out) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    # ------------------------------------------------------------------ calls

    def call(self, headers_block: bytes, message: bytes, timeout_s: float
             ) -> asyncio.Future[tuple[bytes, dict[str, str]]]:
        """Start one unary call; the future gives ``(response message, trailers)``."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[tuple[bytes, dict[str, str]]] = loop.create_future()
        stream = H2Stream(waiter, loop.time() + timeout_s, timeout_s)
        body = b"\x00" + struct.pack(">I", len(message)) + message
        if self.closed:
            waiter.set_exception(RequestFailed("UNAVAILABLE: the connection is closing",
                                               unread=True))
            return waiter
        if len(body) > min(self._peer_stream_window, _H2_DEFAULT_FRAME):
            waiter.set_exception(RequestFailed(
                f"RESOURCE_EXHAUSTED: a {len(body)}-byte request exceeds the server's "
                f"{self._peer_stream_window}-byte stream window or one frame"))
            return waiter
        if (self._queued or len(body) > self._send_window
                or len(self._streams) >= self._peer_max_streams):
            # Open calls share one watchdog; a waiting call has its own timer.
            stream.timer = loop.call_at(stream.deadline, self._expire, stream)
            self._queued.append((stream, headers_block, body))
        else:
            self._start(stream, headers_block, body)
        return waiter

    def _start(self, stream: H2Stream, headers_block: bytes, body: bytes) -> None:
        stream_id = stream.stream_id = self._next_id
        self._next_id += 2
        if self._next_id > _H2_LAST_STREAM_ID:
            self.closed = True  # no new calls here; the transport opens a successor
        self._streams[stream_id] = stream
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_at(stream.deadline, self._watch)
        self._send_window -= len(body)
        self._write(_h2_frame(_H2_HEADERS, _H2_END_HEADERS, stream_id, headers_block)
                    + _h2_frame(_H2_DATA, _H2_END_STREAM, stream_id, body))

    def _flush_queue(self) -> None:
        while self._queued and not self.closed:
            stream, block, body = self._queued[0]
            if len(body) > self._send_window or len(self._streams) >= self._peer_max_streams:
                return
            self._queued.pop(0)
            if not stream.waiter.done():
                self._start(stream, block, body)

    def _watch(self) -> None:
        """Fail the open calls past their deadline, then wait for the earliest other one.

        One timer per connection instead of one per call: calls mostly end long before
        their deadline, and a timer set and cancelled per call is a measurable share of
        the client's CPU at concurrency 1."""
        self._watchdog = None
        now = asyncio.get_running_loop().time()
        late = [stream for stream in self._streams.values() if stream.deadline <= now]
        for stream in late:
            self._expire(stream)
        if self._streams:
            earliest = min(stream.deadline for stream in self._streams.values())
            self._watchdog = asyncio.get_running_loop().call_at(earliest, self._watch)

    def _expire(self, stream: H2Stream) -> None:
        error = RequestFailed(f"DEADLINE_EXCEEDED: no answer within {stream.timeout_s:g} s")
        if self._streams.get(stream.stream_id) is stream:
            # CANCEL: the server may drop the work.
            self._write(_h2_frame(_H2_RST_STREAM, 0, stream.stream_id, struct.pack(">I", 0x8)))
            self._finish(stream.stream_id, error)
        elif not stream.waiter.done():
            stream.waiter.set_exception(error)

    def _finish(self, stream_id: int, error: RequestFailed | None) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        if stream.timer is not None:
            stream.timer.cancel()
        if not stream.waiter.done():
            if error is not None:
                stream.waiter.set_exception(error)
            else:
                stream.waiter.set_result((bytes(stream.data), stream.headers))
        if self._queued:
            self._flush_queue()
        if self.closed and not self._streams and self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ frames in

    def data_received(self, data: bytes) -> None:
        if self._buffer:  # the rest of a frame cut by the previous read
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer.clear()
        at = 0
        size = len(data)
        unpack = _H2_FRAME.unpack_from
        while size - at >= 9:
            high, low, kind, flags, stream_id = unpack(data, at)
            end = at + 9 + ((high << 8) | low)
            if end > size:
                break
            self._frame(kind, flags, stream_id & 0x7FFFFFFF, data[at + 9: end])
            at = end
        if at < size:
            self._buffer += data[at:]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == _H2_DATA:
            self._received += len(payload)
            if self._received >= _H2_MAX_WINDOW // 2:
                self._write(_h2_frame(_H2_WINDOW_UPDATE, 0, 0, struct.pack(">I", self._received)))
                self._received = 0
            stream = self._streams.get(stream_id)
            if stream is not None:
                stream.data += _unpad(payload, flags)
                if flags & _H2_END_STREAM:
                    self._end_stream(stream_id, stream)
        elif kind == _H2_HEADERS:
            block = _unpad(payload, flags)
            if flags & _H2_PRIORITY:
                block = block[5:]
            if flags & _H2_END_HEADERS:
                self._headers(stream_id, flags, block)
            else:
                self._partial = (stream_id, flags, bytearray(block))
        elif kind == _H2_CONTINUATION and self._partial is not None:
            self._partial[2].extend(payload)
            if flags & _H2_END_HEADERS:
                first_stream, first_flags, pieces = self._partial
                self._partial = None
                self._headers(first_stream, first_flags, bytes(pieces))
        elif kind == _H2_SETTINGS and not flags & _H2_ACK:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, i)
                if key == 0x3:
                    self._peer_max_streams = value
                elif key == 0x4:
                    self._peer_stream_window = value
            self._write(_h2_frame(_H2_SETTINGS, _H2_ACK, 0))
            if not self.ready.done():
                self.ready.set_result(None)
            self._flush_queue()
        elif kind == _H2_WINDOW_UPDATE and stream_id == 0 and len(payload) == 4:
            self._send_window += struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            self._flush_queue()
        elif kind == _H2_PING and not flags & _H2_ACK:
            self._write(_h2_frame(_H2_PING, _H2_ACK, 0, payload))
        elif kind == _H2_RST_STREAM and len(payload) == 4:
            code = struct.unpack(">I", payload)[0]
            self._finish(stream_id, RequestFailed(
                f"UNAVAILABLE: the server reset the stream (HTTP/2 error {code})",
                unread=code == _H2_REFUSED_STREAM))
        elif kind == _H2_GOAWAY and len(payload) >= 8:
            last_id, code = struct.unpack_from(">II", payload)
            text = payload[8:].decode(errors="replace")
            # RFC 9113 6.8: the streams above the last id were not processed.
            self._fail_all(f"UNAVAILABLE: the server is going away (HTTP/2 error {code}"
                           f"{': ' + text if text else ''})", above=last_id & 0x7FFFFFFF,
                           unread=True)
            if not self._streams and self.transport is not None:
                self.transport.close()

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        # Every block must be decoded, in order, to keep the shared HPACK table in step.
        # Blocks of one-byte indexed fields do not change the table, so their decoding is
        # kept until one that may does: the answer's headers cost a dict lookup.
        fields = self._decoded.get(block)
        if fields is None:
            try:
                fields = [(str(k), str(v)) for k, v in self._decoder.decode(block)]
            except Exception as exc:  # noqa: BLE001 - a broken block ends the connection
                self._fail_all(f"INTERNAL: undecodable response headers ({exc})")
                if self.transport is not None:
                    self.transport.close()
                return
            if all(b >= 0x80 and b != 0xFF for b in block):
                if len(self._decoded) >= _HPACK_CACHE_BLOCKS:
                    self._decoded.clear()
                self._decoded[block] = fields
            else:
                self._decoded.clear()
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.headers.update(fields)
            if flags & _H2_END_STREAM:
                self._end_stream(stream_id, stream)

    def _end_stream(self, stream_id: int, stream: H2Stream) -> None:
        headers = stream.headers
        status = headers.get("grpc-status")
        if headers.get(":status", "200") != "200":
            error: RequestFailed | None = RequestFailed(
                f"UNAVAILABLE: HTTP {headers.get(':status')} from the gRPC endpoint")
        elif status is None:
            error = RequestFailed("INTERNAL: the answer ended without a grpc-status")
        elif status != "0":
            name = _GRPC_STATUS.get(int(status), f"STATUS_{status}") if status.isdigit() \
                else f"STATUS_{status}"
            error = RequestFailed(f"{name}: {unquote(headers.get('grpc-message', ''))}")
        else:
            error = None
        self._finish(stream_id, error)


def _unpad(payload: bytes, flags: int) -> bytes:
    """A DATA or HEADERS payload without its padding."""
    if flags & _H2_PADDED and payload:
        return payload[1: len(payload) - payload[0]]
    return payload

