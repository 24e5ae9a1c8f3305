"""KServe v2 gRPC messages: the ``ModelInferRequest`` a run sends and the outputs of an
answer, built exactly as tritonclient builds them.

Shared by the grpc.aio and the raw HTTP/2 transports, so a record means the same
whichever of them carried it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from modelship.loadgen.spec import Target


def _raw_bytes(array: np.ndarray) -> bytes:
    """The tensor's raw contents as Triton reads them (BYTES length-prefixed)."""
    # Lazy: tritonclient.utils costs ~1 s to import on a busy 2-core machine.
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    if np_to_triton_dtype(array.dtype) == "BYTES":
        serialized = serialize_byte_tensor(array)
        return bytes(serialized.item()) if serialized.size > 0 else b""
    return np.ascontiguousarray(array).tobytes()


def build_infer_request(target: Target, arrays: Mapping[str, np.ndarray]) -> Any:
    """The ``ModelInferRequest`` protobuf of one request: inputs as raw tensor contents,
    as tritonclient's gRPC client sends them."""
    # Lazy: tritonclient.grpc (grpc + protobuf) costs ~2 s to import on a busy machine.
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype

    request = service_pb2.ModelInferRequest(model_name=target.model, model_version=target.version)
    for name, array in arrays.items():
        tensor = request.inputs.add()
        tensor.name = name
        tensor.datatype = np_to_triton_dtype(array.dtype)
        tensor.shape.extend(array.shape)
        request.raw_input_contents.append(_raw_bytes(array))
    return request


def grpc_outputs(response: Any, keep: bool) -> dict[str, np.ndarray] | None:
    """A ModelInferResponse's outputs as arrays (through tritonclient), when they are kept."""
    if not keep:
        return None
    # Lazy: tritonclient.grpc costs ~2 s to import; only runs that keep outputs need it here.
    from tritonclient.grpc import InferResult

    result = InferResult(response)
    return {o.name: result.as_numpy(o.name) for o in response.outputs}
