"""KServe v2 HTTP/REST as Triton speaks it: URLs, the binary-tensor request body, and
the answer's version, error and outputs.

Shared by the raw HTTP/1.1 transport and the aiohttp one (``https://``), so both send the
same bytes and read answers alike.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import numpy as np

from modelship.loadgen.spec import Target
from modelship.loadgen.stats import ERROR_TEXT_MAX_CHARS
from modelship.loadgen.transports.base import RequestFailed


def http_base(url: str) -> str:
    """``scheme://host:port`` of an endpoint; ``http://`` when none is given."""
    return url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"


def http_address(url: str) -> tuple[str, int]:
    """``(host, port)`` of an HTTP endpoint; port 80 when none is given."""
    base = http_base(url).split("://", 1)[1]
    host, _, port = base.partition("/")[0].rpartition(":")
    return (host or base, int(port)) if port.isdigit() else (base.partition("/")[0], 80)


def infer_path(target: Target) -> str:
    """The v2 inference path of a target, versioned when the target names a version."""
    model = quote(target.model, safe="")
    if target.version:
        return f"/v2/models/{model}/versions/{quote(target.version, safe='')}/infer"
    return f"/v2/models/{model}/infer"


def build_body(target: Target, arrays: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The request body (JSON header plus binary tensors, from tritonclient's
    ``generate_request_body``) and its content headers."""
    # Lazy: tritonclient.http and tritonclient.utils cost ~1.5 s to import on a busy machine.
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        item = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        item.set_data_from_numpy(array, binary_data=True)
        inputs.append(item)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return bytes(body), headers


def model_version(header: bytes) -> str:
    """``model_version`` from an inference answer's JSON header, without parsing it all."""
    at = header.find(b'"model_version"')
    if at < 0:
        return ""
    start = header.find(b'"', header.find(b":", at) + 1) + 1
    return header[start: header.find(b'"', start)].decode()


def failed_answer(status: int, content: bytes) -> RequestFailed:
    """The failure of a non-200 answer: Triton's JSON ``error``, else the body's start."""
    try:
        message = json.loads(content).get("error", "")
    except (ValueError, AttributeError):
        message = content[:ERROR_TEXT_MAX_CHARS].decode(errors="replace")
    return RequestFailed(f"HTTP {status}: {message}")


def answer_outputs(content: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """The output arrays of an answer (JSON header of ``header_length`` bytes, then binary
    tensors), decoded by tritonclient."""
    # Lazy: tritonclient.http costs ~1.5 s to import; only runs that keep outputs need it.
    import tritonclient.http as httpclient

    result = httpclient.InferenceServerClient.parse_response_body(
        content, header_length=header_length
    )
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}
