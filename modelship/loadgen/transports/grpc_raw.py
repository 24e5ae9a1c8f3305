"""gRPC as prebuilt HTTP/2 frames (:mod:`.h2`): the default transport for ``grpc``.

It carries requests whose message fits one HTTP/2 frame and has no BYTES tensors
(:func:`raw_grpc_fits`); others go through grpc.aio (:mod:`.grpc_aio`). Records mean the
same with either: the same request message, the same answer parsing, the same error texts.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Mapping, Sequence

import numpy as np

from modelship.errors import UsageError
from modelship.loadgen.spec import LoadSpec, Target
from modelship.loadgen.transports.base import RequestFailed, Requests
from modelship.loadgen.transports.grpc_codec import build_infer_request, grpc_outputs
from modelship.loadgen.transports.h2 import (
    RAW_GRPC_MAX_MESSAGE_BYTES,
    H2Connection,
    grpc_timeout,
    hpack_literal_block,
)
from modelship.triton.infer import host_port


def raw_grpc_fits(payload: Mapping[str, np.ndarray], batch_size: int) -> bool:
    """Whether gRPC requests can take the raw HTTP/2 transport: fixed-size tensors whose
    request fits one frame (with room for names and shapes), and ``hpack`` importable
    (it comes with httpx[http2]). Otherwise grpc.aio carries them."""
    if importlib.util.find_spec("hpack") is None:
        return False
    arrays = [np.asarray(a) for a in payload.values()]
    if any(a.dtype.hasobject or a.dtype.kind in "SU" or a.ndim == 0 for a in arrays):
        return False
    tensor_bytes = sum(a[:1].nbytes for a in arrays) * batch_size
    overhead = sum(64 + 8 * a.ndim for a in arrays) + 256
    return tensor_bytes + overhead <= RAW_GRPC_MAX_MESSAGE_BYTES


def _build_grpc_message(target: Target, arrays: Mapping[str, np.ndarray]) -> bytes:
    """The serialized request; one over a frame fails as a request, not as the run."""
    message: bytes = build_infer_request(target, arrays).SerializeToString()
    if len(message) > RAW_GRPC_MAX_MESSAGE_BYTES:
        raise RequestFailed(
            f"INVALID_ARGUMENT: a {len(message)}-byte request is over the raw gRPC transport's "
            f"{RAW_GRPC_MAX_MESSAGE_BYTES} bytes")
    return message


class RawGrpcTransport:
    """KServe v2 gRPC as prebuilt HTTP/2 frames on one connection per server.

    Each distinct request is one serialized ``ModelInferRequest`` (built as grpc.aio's
    transport builds it) and each target one literal header block; a call writes both as
    two frames. The answer is parsed with the generated
    ``ModelInferResponse`` (``model_version``, and the outputs through tritonclient's
    ``InferResult`` when ``keep_outputs`` is set), so records mean the same as with
    grpc.aio. Error texts are ``STATUS_NAME: message`` as there.
    """

    def __init__(self, targets: Sequence[Target], payload: Mapping[str, np.ndarray],
                 spec: LoadSpec) -> None:
        # Lazy: tritonclient.grpc (grpc + protobuf) costs ~2 s to import on a busy machine.
        from tritonclient.grpc import service_pb2

        self._response = service_pb2.ModelInferResponse
        self._timeout_s = spec.timeout_s
        self._keep_outputs = spec.keep_outputs
        self._addresses = [_grpc_address(t.url) for t in targets]
        self._blocks = [
            hpack_literal_block([
                (":method", "POST"), (":scheme", "http"),
                (":path", "/inference.GRPCInferenceService/ModelInfer"),
                (":authority", host_port(t.url)), ("content-type", "application/grpc"),
                ("te", "trailers"), ("grpc-timeout", grpc_timeout(spec.timeout_s)),
            ])
            for t in targets
        ]
        self._connections: dict[tuple[str, int], H2Connection] = {}
        self._opening: dict[tuple[str, int], asyncio.Future[H2Connection]] = {}
        self._requests = Requests(targets, payload, spec.batch_size, _build_grpc_message)
        #: calls sent again because the server had not read them (a GOAWAY, a refused stream)
        self.resent = 0

    async def _connection(self, address: tuple[str, int]) -> H2Connection:
        """The open connection to ``address``; concurrent callers share one opening."""
        conn = self._connections.get(address)
        if conn is not None and not conn.closed:
            return conn
        opening = self._opening.get(address)
        if opening is None:
            opening = self._opening[address] = asyncio.ensure_future(self._open(address))
            opening.add_done_callback(lambda _: self._opening.pop(address, None))
        return await asyncio.shield(opening)

    async def _open(self, address: tuple[str, int]) -> H2Connection:
        """Connect and wait for the server's SETTINGS, within the request timeout."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                _, conn = await loop.create_connection(H2Connection, *address)
                await conn.ready
        except (OSError, TimeoutError) as exc:
            raise RequestFailed(f"UNAVAILABLE: {type(exc).__name__}: {exc}") from None
        self._connections[address] = conn
        return conn

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        """One unary ModelInfer call on the target's connection (opened on demand).

        A call the server did not read (it went away, or refused the stream, as a proxy
        does on a graceful reload) is sent once more on a new connection, as gRPC clients
        do (transparent retry)."""
        address = self._addresses[target]
        try:
            message = await self._call(address, target, request)
        except RequestFailed as exc:
            if not exc.unread:
                raise
            self.resent += 1
            message = await self._call(address, target, request)
        if len(message) < 5:
            raise RequestFailed("INTERNAL: the answer carried no message")
        if message[0] != 0:
            raise RequestFailed("INTERNAL: a compressed answer (none was asked for)")
        response = self._response.FromString(message[5:])
        return response.model_version, grpc_outputs(response, self._keep_outputs)

    async def _call(self, address: tuple[str, int], target: int, request: int) -> bytes:
        conn = self._connections.get(address)
        if conn is None or conn.closed:
            conn = await self._connection(address)
        message, _ = await conn.call(
            self._blocks[target], self._requests.get(target, request), self._timeout_s)
        return message

    async def close(self) -> None:
        """Close every connection."""
        for conn in self._connections.values():
            if conn.transport is not None:
                conn.transport.close()


def _grpc_address(url: str) -> tuple[str, int]:
    """``(host, port)`` of a gRPC endpoint, refusing one without a port."""
    host, _, port = host_port(url).rpartition(":")
    if not port.isdigit():
        raise UsageError(f"a gRPC endpoint needs host:port, got {url!r}")
    return host.strip("[]") or "127.0.0.1", int(port)
