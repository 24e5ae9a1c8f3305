"""How requests reach Triton: one transport per protocol and endpoint kind.

Each is written for the client's CPU, which on small machines is shared with the server
under test, and each call has a timeout (``timeout_s``, sent to the server too as
``grpc-timeout``):

- ``grpc``: prebuilt HTTP/2 frames (:mod:`.grpc_raw` on :mod:`.h2`); ``grpc.aio``
  (:mod:`.grpc_aio`) for requests over one frame, BYTES tensors, or no ``hpack``.
- ``http``: raw keep-alive HTTP/1.1 (:mod:`.http1`); aiohttp (:mod:`.http_aiohttp`) only
  for ``https://``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from modelship.loadgen.spec import LoadSpec, Target
from modelship.loadgen.transports.base import RequestFailed, Transport
from modelship.loadgen.transports.grpc_aio import GrpcTransport
from modelship.loadgen.transports.grpc_raw import RawGrpcTransport, raw_grpc_fits
from modelship.loadgen.transports.http1 import RawHttpTransport
from modelship.loadgen.transports.http_aiohttp import AiohttpTransport

__all__ = ["RequestFailed", "Transport", "choose_transport", "raw_grpc_fits"]


def choose_transport(
    targets: Sequence[Target], payload: Mapping[str, np.ndarray], spec: LoadSpec
) -> Transport:
    """The cheapest transport that can carry this run's requests to these targets."""
    if spec.protocol == "http":
        if not any(t.url.startswith("https://") for t in targets):
            return RawHttpTransport(targets, payload, spec)
        in_flight = spec.concurrency if spec.concurrency is not None else spec.max_outstanding
        return AiohttpTransport(targets, payload, spec, connections=max(in_flight, 1))
    if raw_grpc_fits(payload, spec.batch_size):
        return RawGrpcTransport(targets, payload, spec)
    return GrpcTransport(targets, payload, spec)
