"""The raw gRPC transport's HTTP/2 client against an in-process HTTP/2 server.

The server is built on the ``h2`` package (an independent HTTP/2 implementation, with
HPACK's dynamic table and Huffman coding), so these tests check our framing, header
decoding, flow control, deadlines and GOAWAY handling against another implementation,
on loopback, without Triton. The wire format Triton answers with is covered by
``tests/integration/test_loadgen.py``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from modelship.loadgen import (
    RAW_GRPC_MAX_MESSAGE_BYTES,
    LoadSpec,
    RequestFailed,
    Target,
    build_infer_request,
    grpc_timeout,
    hpack_literal_block,
    raw_grpc_fits,
)
from modelship.loadgen.transports.grpc_raw import RawGrpcTransport

MODEL = "m"
PAYLOAD = {"input": np.arange(12, dtype=np.float32).reshape(6, 2)}


@dataclass
class Seen:
    """What the fake server received."""

    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)
    ping_acks: int = 0


# An answer: (stream id, request headers, request body) -> None, sending on the connection.
Answer = Callable[[h2.connection.H2Connection, int, dict[str, str], bytes], None]


def ok_answer(version: str) -> Answer:
    def answer(conn: h2.connection.H2Connection, stream_id: int, headers: dict[str, str],
               body: bytes) -> None:
        request = service_pb2.ModelInferRequest.FromString(body[5:])
        response = service_pb2.ModelInferResponse(
            model_name=request.model_name, model_version=version, id=request.id)
        output = response.outputs.add(name="echo", datatype="FP32", shape=[1, 2])
        del output  # the tensor bytes go in raw_output_contents
        response.raw_output_contents.append(request.raw_input_contents[0])
        message = response.SerializeToString()
        conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
        conn.send_data(stream_id, b"\x00" + len(message).to_bytes(4, "big") + message)
        conn.send_headers(stream_id, [("grpc-status", "0"), ("grpc-message", "")],
                          end_stream=True)

    return answer


def error_answer(conn: h2.connection.H2Connection, stream_id: int, headers: dict[str, str],
                 body: bytes) -> None:
    conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc"),
                                  ("grpc-status", "5"),
                                  ("grpc-message", "model%20%27m%27%20is%20not%20found")],
                      end_stream=True)


def no_answer(conn: h2.connection.H2Connection, stream_id: int, headers: dict[str, str],
              body: bytes) -> None:
    return None


@asynccontextmanager
async def h2_server(answer: Answer, *, ping: bool = False, goaway_after: int | None = None,
                    settings: dict[int, int] | None = None) -> AsyncIterator[tuple[str, Seen]]:
    """An HTTP/2 server on a free loopback port; yields ``host:port`` and what it saw."""
    seen = Seen()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        if settings:
            conn.update_settings(settings)
        writer.write(conn.data_to_send())
        bodies: dict[int, bytearray] = {}
        heads: dict[int, dict[str, str]] = {}
        answered = 0
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    heads[event.stream_id] = {_text(k): _text(v) for k, v in event.headers}
                    bodies[event.stream_id] = bytearray()
                    if ping:
                        conn.ping(b"12345678")
                elif isinstance(event, h2.events.DataReceived):
                    bodies[event.stream_id] += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    body = bytes(bodies.pop(event.stream_id))
                    seen.requests.append((heads[event.stream_id], body))
                    if goaway_after is not None and answered >= goaway_after:
                        conn.close_connection(last_stream_id=event.stream_id - 2)
                    else:
                        answer(conn, event.stream_id, heads[event.stream_id], body)
                    answered += 1
                elif isinstance(event, h2.events.StreamReset):
                    seen.resets.append(event.stream_id)
                elif isinstance(event, h2.events.PingAckReceived):
                    seen.ping_acks += 1
            writer.write(conn.data_to_send())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        server.close()


def in_event_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test in a fresh event loop (the project uses no asyncio pytest plugin)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(asyncio.wait_for(test(), timeout=20.0))

    return run


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _transport(url: str, **spec: Any) -> RawGrpcTransport:
    return RawGrpcTransport([Target(url, MODEL, "3")], PAYLOAD,
                             LoadSpec(concurrency=1, **spec))


def test_header_block_is_literal_and_decodes_to_the_headers() -> None:
    headers = [(":method", "POST"), (":path", "/a/b"), ("grpc-timeout", "10000m"),
               ("x-long", "v" * 300)]
    block = hpack_literal_block(headers)
    assert hpack.Decoder().decode(block) == headers
    # Literal without indexing: it leaves no entry in the peer's table.
    decoder = hpack.Decoder()
    decoder.decode(block)
    assert len(decoder.header_table.dynamic_entries) == 0


@pytest.mark.parametrize(("seconds", "header"), [
    (10.0, "10000m"), (0.0001, "1m"), (2.5, "2500m"), (1e6, "1000000S"),
])
def test_grpc_timeout_header(seconds: float, header: str) -> None:
    assert grpc_timeout(seconds) == header
    assert len(header) <= 9  # at most 8 digits and a unit


def test_raw_transport_takes_small_fixed_size_tensors_only() -> None:
    assert raw_grpc_fits(PAYLOAD, 1)
    wide = {"input": np.zeros((2, RAW_GRPC_MAX_MESSAGE_BYTES // 4), dtype=np.float32)}
    assert not raw_grpc_fits(wide, 1)
    assert not raw_grpc_fits(PAYLOAD, 4096)
    assert not raw_grpc_fits({"text": np.array([b"a", b"bc"], dtype=object)}, 1)


@in_event_loop
async def test_calls_are_well_formed_grpc_and_answers_decode() -> None:
    async with h2_server(ok_answer("3")) as (url, seen):
        transport = _transport(url, keep_outputs=True, timeout_s=5.0)
        try:
            answers = await asyncio.gather(*[transport.send(0, i) for i in range(40)])
        finally:
            await transport.close()
    assert [version for version, _ in answers] == ["3"] * 40
    for i, (_, outputs) in enumerate(answers):
        assert outputs is not None
        np.testing.assert_array_equal(outputs["echo"], PAYLOAD["input"][[i % 6]])
    headers, body = seen.requests[0]
    assert headers[":method"] == "POST" and headers["te"] == "trailers"
    assert headers[":path"] == "/inference.GRPCInferenceService/ModelInfer"
    assert headers["content-type"] == "application/grpc"
    assert headers["grpc-timeout"] == "5000m"
    assert body[0] == 0 and int.from_bytes(body[1:5], "big") == len(body) - 5
    expected = build_infer_request(Target(url, MODEL, "3"), {"input": PAYLOAD["input"][[0]]})
    assert service_pb2.ModelInferRequest.FromString(body[5:]) == expected
    assert len(seen.requests) == 40


@in_event_loop
async def test_grpc_status_becomes_the_error_text() -> None:
    async with h2_server(error_answer) as (url, _):
        transport = _transport(url)
        try:
            with pytest.raises(RequestFailed, match="^NOT_FOUND: model 'm' is not found$"):
                await transport.send(0, 0)
            # The connection stays usable after an error answer.
            with pytest.raises(RequestFailed, match="^NOT_FOUND"):
                await transport.send(0, 1)
        finally:
            await transport.close()


@in_event_loop
async def test_a_call_past_its_deadline_fails_and_is_cancelled_on_the_server() -> None:
    async with h2_server(no_answer) as (url, seen):
        transport = _transport(url, timeout_s=0.2)
        try:
            with pytest.raises(RequestFailed, match="^DEADLINE_EXCEEDED"):
                await transport.send(0, 0)
            for _ in range(50):
                if seen.resets:
                    break
                await asyncio.sleep(0.01)
        finally:
            await transport.close()
    assert seen.resets == [1]


@in_event_loop
async def test_server_pings_are_acknowledged() -> None:
    async with h2_server(ok_answer("3"), ping=True) as (url, seen):
        transport = _transport(url)
        try:
            for i in range(3):
                await transport.send(0, i)
            await asyncio.sleep(0.05)
        finally:
            await transport.close()
    assert seen.ping_acks >= 3


@in_event_loop
async def test_a_call_above_the_goaway_last_stream_is_sent_again_on_a_new_connection() -> None:
    # The server answers stream 1, then goes away with last stream id 1 instead of
    # answering stream 3: stream 3 was not processed (RFC 9113 6.8), so it is sent again,
    # on a new connection, as gRPC clients do, and the caller sees its answer.
    async with h2_server(ok_answer("3"), goaway_after=1) as (url, seen):
        transport = _transport(url)
        try:
            assert (await transport.send(0, 0))[0] == "3"
            assert transport.resent == 0
            assert (await transport.send(0, 1))[0] == "3"
            assert transport.resent == 1
            assert (await transport.send(0, 2))[0] == "3"  # refused again, then answered
            assert transport.resent == 2
        finally:
            await transport.close()
    # each refused copy and its resend reached the server (three connections in all)
    assert len(seen.requests) == 5
    assert seen.requests[1][1] == seen.requests[2][1]


def refuse(code: int) -> Answer:
    def answer(conn: h2.connection.H2Connection, stream_id: int, headers: dict[str, str],
               body: bytes) -> None:
        conn.reset_stream(stream_id, error_code=code)

    return answer


async def _refused(code: int) -> tuple[int, int]:
    """``(resent, requests the server saw)`` for one call every stream of which the
    server resets with ``code``."""
    async with h2_server(refuse(code)) as (url, seen):
        transport = _transport(url)
        try:
            with pytest.raises(RequestFailed, match=f"reset the stream .HTTP/2 error {code}"):
                await transport.send(0, 0)
        finally:
            await transport.close()
    return transport.resent, len(seen.requests)


@in_event_loop
async def test_a_refused_stream_is_sent_again_once_at_most() -> None:
    # REFUSED_STREAM (7): not processed, sent once more; refused again, the call fails
    # (no loop of resends).
    assert await _refused(7) == (1, 2)


@in_event_loop
async def test_a_stream_reset_otherwise_is_never_sent_again() -> None:
    # INTERNAL_ERROR (2): the server may have processed it.
    assert await _refused(2) == (0, 1)


@in_event_loop
async def test_a_small_server_stream_limit_queues_calls_instead_of_failing_them() -> None:
    async with h2_server(ok_answer("3"), settings={
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2,
    }) as (url, seen):
        transport = _transport(url)
        try:
            await transport.send(0, 0)  # the server's SETTINGS are in
            answers = await asyncio.gather(*[transport.send(0, i) for i in range(10)])
        finally:
            await transport.close()
    assert [v for v, _ in answers] == ["3"] * 10 and len(seen.requests) == 11


@in_event_loop
async def test_unreachable_server_is_a_failed_request() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    transport = _transport(f"127.0.0.1:{port}", timeout_s=1.0)
    with pytest.raises(RequestFailed, match="^UNAVAILABLE"):
        await transport.send(0, 0)
    await transport.close()


@in_event_loop
async def test_each_open_call_fails_at_its_own_deadline() -> None:
    # Calls share one watchdog per connection; each must still end at its own deadline.
    loop = asyncio.get_running_loop()
    async with h2_server(no_answer) as (url, seen):
        transport = _transport(url, timeout_s=0.3)

        async def timed(delay_s: float, index: int) -> float:
            await asyncio.sleep(delay_s)
            started = loop.time()
            with pytest.raises(RequestFailed, match="^DEADLINE_EXCEEDED: no answer within 0.3 s"):
                await transport.send(0, index)
            return loop.time() - started

        try:
            elapsed = await asyncio.gather(*[timed(0.1 * i, i) for i in range(3)])
            for _ in range(50):
                if len(seen.resets) == 3:
                    break
                await asyncio.sleep(0.01)
        finally:
            await transport.close()
    assert all(0.28 <= e <= 0.45 for e in elapsed), elapsed
    assert sorted(seen.resets) == [1, 3, 5]
