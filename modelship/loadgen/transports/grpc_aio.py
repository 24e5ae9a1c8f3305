"""gRPC through ``grpc.aio`` and tritonclient's generated stubs.

The fallback for what the raw HTTP/2 transport does not carry: requests over one frame,
BYTES tensors, or no ``hpack`` installed. It costs 2-4x the raw transport's client CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from modelship.loadgen.spec import LoadSpec, Target
from modelship.loadgen.transports.base import RequestFailed, Requests
from modelship.loadgen.transports.grpc_codec import build_infer_request, grpc_outputs
from modelship.triton.infer import host_port

_MAX_GRPC_MESSAGE_BYTES = 2**31 - 1


class GrpcTransport:
    """KServe v2 gRPC with tritonclient's generated stubs, one channel per server URL."""

    def __init__(
        self, targets: Sequence[Target], payload: Mapping[str, np.ndarray], spec: LoadSpec
    ) -> None:
        # Lazy: grpc and tritonclient.grpc cost ~2 s to import; most runs take the raw path.
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self._grpc = grpc
        self._timeout_s = spec.timeout_s
        self._keep_outputs = spec.keep_outputs
        options = [
            ("grpc.max_send_message_length", _MAX_GRPC_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MAX_GRPC_MESSAGE_BYTES),
            # No retry policy is configured, but the retry filter still buffers every
            # call; off, it saves ~5-10% of the client's CPU per request.
            ("grpc.enable_retries", 0),
        ]
        self._channels: dict[str, Any] = {}
        self._stubs: list[Any] = []
        for target in targets:
            address = host_port(target.url)
            if address not in self._channels:
                self._channels[address] = grpc.aio.insecure_channel(address, options=options)
            self._stubs.append(service_pb2_grpc.GRPCInferenceServiceStub(self._channels[address]))
        self._requests = Requests(targets, payload, spec.batch_size, build_infer_request)

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        """One ModelInfer call; a gRPC error becomes ``STATUS_NAME: details``."""
        try:
            response = await self._stubs[target].ModelInfer(
                self._requests.get(target, request), timeout=self._timeout_s
            )
        except self._grpc.aio.AioRpcError as exc:
            raise RequestFailed(f"{exc.code().name}: {exc.details()}") from None
        return response.model_version, grpc_outputs(response, self._keep_outputs)

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            await channel.close()
