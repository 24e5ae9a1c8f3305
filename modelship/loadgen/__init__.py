"""An asyncio load generator for Triton: the canary's replay engine and ``modelship load``.

Why not perf_analyzer: the canary needs what it cannot give, namely every request's
latency and the ``model_version`` that answered it (to split a run that crosses a swap),
the same input row sent to a baseline and a candidate back-to-back, and errors counted on
the client (Triton's metrics do not count a wrong-shape request as a failure). It keeps
perf_analyzer's method: warm-up, measurement windows, and a stability rule (the last
three windows agree on throughput and p95 latency within ``stability_pct``), and it says
``stable: false`` when the run hit ``max_duration_s`` first instead of pretending.

Throughput counts answered (ok) requests per second, and latency percentiles are over
answered requests; errors are counted separately. A summary with no answered request has
``None`` percentiles: no data is never a good figure.

The package, one concept a module:

- :mod:`.spec` and :mod:`.payload`: what a run is asked to do (pure);
- :mod:`.report` and :mod:`.stats`: what it measured, and the statistics (pure);
- :mod:`.engine`: the run itself (workers, arrivals, windows, paired arms);
- :mod:`.transports`: how requests reach Triton (raw HTTP/2 gRPC, grpc.aio, raw
  HTTP/1.1, aiohttp), each written for the client's CPU.

This module re-exports the public names, so importers say ``from modelship.loadgen
import ...``.
"""

from __future__ import annotations

from modelship.loadgen.engine import run_load, run_load_sync, run_paired
from modelship.loadgen.payload import check_payload, distinct_requests, request_rows
from modelship.loadgen.report import LoadReport, RequestRecord, WindowStats
from modelship.loadgen.spec import Arrival, LoadSpec, Protocol_, Target, arrival_gaps_s
from modelship.loadgen.stats import (
    ERROR_TEXT_MAX_CHARS,
    PERCENTILES,
    group_stats,
    is_stable,
    percentiles_ms,
    short_error,
    summarize,
    window_stats,
)
from modelship.loadgen.transports import RequestFailed, raw_grpc_fits
from modelship.loadgen.transports.grpc_codec import build_infer_request
from modelship.loadgen.transports.h2 import (
    RAW_GRPC_MAX_MESSAGE_BYTES,
    grpc_timeout,
    hpack_literal_block,
)

__all__ = [
    "ERROR_TEXT_MAX_CHARS",
    "PERCENTILES",
    "RAW_GRPC_MAX_MESSAGE_BYTES",
    "Arrival",
    "LoadReport",
    "LoadSpec",
    "Protocol_",
    "RequestFailed",
    "RequestRecord",
    "Target",
    "WindowStats",
    "arrival_gaps_s",
    "build_infer_request",
    "check_payload",
    "distinct_requests",
    "group_stats",
    "grpc_timeout",
    "hpack_literal_block",
    "is_stable",
    "percentiles_ms",
    "raw_grpc_fits",
    "request_rows",
    "run_load",
    "run_load_sync",
    "run_paired",
    "short_error",
    "summarize",
    "window_stats",
]
