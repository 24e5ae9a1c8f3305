"""An asyncio load generator for Triton: the canary's replay engine and ``modelship load``.

Why not perf_analyzer: the canary needs what it cannot give, namely every request's
latency and the ``model_version`` that answered it (to split a run that crosses a swap),
the same input row sent to a baseline and a candidate back-to-back, and errors counted on
the client (Triton's metrics do not count a wrong-shape request as a failure). It keeps
perf_analyzer's method: warm-up, measurement windows, and a stability rule (the last
three windows agree on throughput and p95 latency within ``stability_pct``), and it says
``stable: false`` when the run hit ``max_duration_s`` first instead of pretending.

Shapes of a run:

- **concurrency**: ``concurrency`` workers in a closed loop (send, wait, send again).
- **rate**: open loop at ``rate_rps`` with constant or Poisson gaps; at most
  ``max_outstanding`` requests in flight, after which new arrivals wait (and are counted
  as ``throttled``) rather than pile up without bound.
- **stability** (default) or **fixed duration** (``duration_s``: no stability rule, for
  benchmarks that run through a swap); both end early on a ``stop`` event.
- **paired**: two arms (server, model, version) get the SAME row back-to-back, alternating
  which goes first, each record tagged with its arm. ``concurrency`` and ``rate_rps`` then
  count pairs, i.e. they are per arm.

Transports: gRPC and HTTP, each written for the client's CPU, which on small machines is
shared with the server under test.

- **gRPC** (:class:`_RawGrpcTransport`): unary calls as prebuilt HTTP/2 frames, many
  streams on one connection per server; frames queued in one turn of the event loop go
  out in one write. The request is tritonclient's ``ModelInferRequest`` serialized once,
  the answer is parsed with the generated ``ModelInferResponse``, and header blocks are
  decoded with ``hpack``. Requests over one frame (16 KiB) or with BYTES tensors, or
  without ``hpack``, go through ``grpc.aio`` (:class:`_GrpcTransport`).
- **HTTP**: binary tensors over plain keep-alive asyncio connections
  (:class:`_HttpConnection`); aiohttp only for ``https://``. The whole request is one byte
  string from ``tritonclient.http.InferenceServerClient.generate_request_body``.

Measured client CPU per request (``bench/loadgen``, interleaved A/B medians, 2 busy
cores, concurrency 16 / 1): raw gRPC ≈ 55-67 / 180-240 µs against grpc.aio's ≈ 190-260 /
460-670 µs; raw HTTP ≈ 105-120 / 225-275 µs against aiohttp's ≈ 355-460 / 675-1000 µs.
Every call has a timeout (``timeout_s``), sent to the server too (``grpc-timeout``).

Throughput counts answered (ok) requests per second, and latency percentiles are over
answered requests; errors are counted separately. A summary with no answered request has
``None`` percentiles: no data is never a good figure.
"""

from __future__ import annotations

import asyncio
import math
import random
import struct
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import quote

import numpy as np

from modelship.errors import UsageError
from modelship.triton.infer import host_port

Protocol_ = Literal["grpc", "http"]
Arrival = Literal["constant", "poisson"]

PERCENTILES = (50, 90, 95, 99)
ERROR_TEXT_MAX_CHARS = 200
_DRAIN_GRACE_S = 1.0
_MAX_GRPC_MESSAGE_BYTES = 2**31 - 1


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Target:
    """Where one stream of requests goes.

    Attributes:
        url: ``host:port`` (gRPC) or ``http://host:port`` (HTTP); a scheme is tolerated
            for gRPC and added for HTTP.
        model: Triton model name.
        version: Explicit version, or ``""`` for Triton's choice (highest ready).
    """

    url: str
    model: str
    version: str = ""


@dataclass(frozen=True)
class LoadSpec:
    """How to load the targets. Exactly one of ``concurrency`` and ``rate_rps``.

    Attributes:
        protocol: ``grpc`` (default, fastest) or ``http``.
        concurrency: Closed-loop workers (pairs in paired mode).
        rate_rps: Open-loop arrivals per second (pairs per second in paired mode).
        arrival: ``constant`` gaps or ``poisson`` (exponential gaps) in rate mode.
        max_outstanding: In-flight bound in rate mode, so a slow server cannot make the
            client open requests without limit.
        batch_size: Rows per request, taken cyclically from the payload.
        warmup_s: Seconds before measurement starts (connections, caches, batcher).
        window_s: Length of one measurement window, in seconds.
        stability_pct: Allowed deviation of each of the last ``stable_windows`` windows
            from their mean, for throughput and p95 latency, in percent.
        stable_windows: How many consecutive windows must agree (perf_analyzer uses 3).
        max_duration_s: Give up on stability after this many seconds, warm-up included,
            and report ``stable: false``.
        duration_s: Fixed-duration mode when set: run this long (warm-up included), keep
            every record, apply no stability rule.
        timeout_s: Per-request timeout, in seconds.
        seed: Seed of the Poisson arrivals.
        keep_outputs: Keep each answer's output arrays on its record (the canary compares
            the two arms' outputs); costs client CPU, so off for plain load.
    """

    protocol: Protocol_ = "grpc"
    concurrency: int | None = None
    rate_rps: float | None = None
    arrival: Arrival = "constant"
    max_outstanding: int = 256
    batch_size: int = 1
    warmup_s: float = 1.0
    window_s: float = 2.0
    stability_pct: float = 10.0
    stable_windows: int = 3
    max_duration_s: float = 60.0
    duration_s: float | None = None
    timeout_s: float = 10.0
    seed: int = 0
    keep_outputs: bool = False

    @property
    def mode(self) -> str:
        """``concurrency`` or ``rate``."""
        return "rate" if self.rate_rps is not None else "concurrency"

    def validate(self) -> None:
        """Refuse a spec that cannot describe a bounded run.

        Raises:
            UsageError: Both or neither load shapes, or a non-positive size or duration.
        """
        if (self.concurrency is None) == (self.rate_rps is None):
            raise UsageError(
                "give exactly one of concurrency and rate_rps",
                hint="Use --concurrency C for a closed loop or --rate R for an open loop",
            )
        if self.concurrency is not None and self.concurrency < 1:
            raise UsageError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate_rps is not None and not (self.rate_rps > 0 and math.isfinite(self.rate_rps)):
            raise UsageError(f"rate_rps must be a positive number, got {self.rate_rps}")
        if self.protocol not in ("grpc", "http"):
            raise UsageError(f"protocol must be grpc or http, got {self.protocol!r}")
        if self.arrival not in ("constant", "poisson"):
            raise UsageError(f"arrival must be constant or poisson, got {self.arrival!r}")
        positive = {
            "max_outstanding": self.max_outstanding,
            "batch_size": self.batch_size,
            "window_s": self.window_s,
            "max_duration_s": self.max_duration_s,
            "timeout_s": self.timeout_s,
            "stable_windows": self.stable_windows,
        }
        if self.duration_s is not None:
            positive["duration_s"] = self.duration_s
        for name, value in positive.items():
            if not value > 0:
                raise UsageError(f"{name} must be > 0, got {value}")
        if self.warmup_s < 0 or self.stability_pct < 0:
            raise UsageError("warmup_s and stability_pct must be >= 0")


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it.

    Attributes:
        start_s: Send time, seconds since the run started (monotonic clock).
        latency_ms: Send to answer (or to failure), in ms.
        ok: Whether the server answered with outputs.
        error: Short error text when not ok.
        server: Index of the target (the server in :func:`run_load`, the arm in
            :func:`run_paired`).
        model_version: The version that answered, from the response (``""`` on error).
        row: First payload row of the request.
        tag: Arm name in paired mode (``baseline`` / ``candidate``), else ``None``.
        outputs: Output arrays when ``keep_outputs`` is set.
    """

    start_s: float
    latency_ms: float
    ok: bool
    error: str | None
    server: int
    model_version: str
    row: int
    tag: str | None = None
    outputs: dict[str, np.ndarray] | None = None

    @property
    def end_s(self) -> float:
        """Completion time, seconds since the run started."""
        return self.start_s + self.latency_ms / 1000.0


@dataclass(frozen=True)
class WindowStats:
    """One measurement window (requests assigned by completion time)."""

    start_s: float
    end_s: float
    requests: int
    errors: int
    throughput_rps: float
    p95_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "start_s": round(self.start_s, 3),
            "end_s": round(self.end_s, 3),
            "requests": self.requests,
            "errors": self.errors,
            "throughput_rps": round(self.throughput_rps, 2),
            "p95_ms": _round(self.p95_ms),
        }


@dataclass
class LoadReport:
    """The summary of a run; ``to_dict()`` is the ``modelship load --json`` document.

    The first four fields are DESIGN §6's contract; the rest are extras. ``records`` holds
    every request of the run, warm-up and drain included (see :meth:`measured_records`),
    and stays out of ``to_dict()``.
    """

    requests: int
    errors: int
    throughput_rps: float
    latency_ms: dict[str, float | None]
    stable: bool | None
    windows: list[WindowStats]
    duration_s: float
    measured_from_s: float
    measured_to_s: float
    mode: str
    protocol: str
    concurrency: int | None
    rate_rps: float | None
    by_version: dict[str, dict[str, Any]]
    by_server: dict[str, dict[str, Any]]
    by_arm: dict[str, dict[str, Any]] = field(default_factory=dict)
    error_texts: dict[str, int] = field(default_factory=dict)
    throttled: int = 0
    stopped: bool = False
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    def measured_records(self) -> list[RequestRecord]:
        """The records the summary is computed from (completed inside the measurement)."""
        return [r for r in self.records if _in_range(r, self.measured_from_s, self.measured_to_s)]

    def to_dict(self) -> dict[str, Any]:
        """DESIGN §6 keys first, then the extras; no records."""
        document: dict[str, Any] = {
            "requests": self.requests,
            "errors": self.errors,
            "throughput_rps": round(self.throughput_rps, 2),
            "latency_ms": {k: _round(v) for k, v in self.latency_ms.items()},
            "stable": self.stable,
            "windows": [w.to_dict() for w in self.windows],
            "duration_s": round(self.duration_s, 3),
            "mode": self.mode,
            "protocol": self.protocol,
            "concurrency": self.concurrency,
            "rate_rps": self.rate_rps,
            "by_version": self.by_version,
            "by_server": self.by_server,
            "error_texts": self.error_texts,
            "throttled": self.throttled,
            "stopped": self.stopped,
        }
        if self.by_arm:
            document["by_arm"] = self.by_arm
        return document


# --------------------------------------------------------------------------- pure pieces


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _in_range(record: RequestRecord, from_s: float, to_s: float) -> bool:
    return from_s <= record.end_s <= to_s


def percentiles_ms(latencies_ms: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    """p50/p90/p95/p99 of latencies in ms; all ``None`` for no data (never a fake 0)."""
    values = np.asarray(latencies_ms, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(values, PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points, strict=True)}


def window_stats(records: Sequence[RequestRecord], start_s: float, end_s: float) -> WindowStats:
    """Statistics of the records completed in ``(start_s, end_s]``."""
    inside = [r for r in records if start_s < r.end_s <= end_s]
    ok = [r.latency_ms for r in inside if r.ok]
    length_s = end_s - start_s
    return WindowStats(
        start_s=start_s,
        end_s=end_s,
        requests=len(inside),
        errors=len(inside) - len(ok),
        throughput_rps=len(ok) / length_s if length_s > 0 else 0.0,
        p95_ms=percentiles_ms(ok)["p95"],
    )


def is_stable(windows: Sequence[WindowStats], stability_pct: float, count: int = 3) -> bool:
    """perf_analyzer's rule: the last ``count`` windows each within ``stability_pct`` % of
    their mean, for throughput and for p95 latency.

    Fewer windows than ``count``, or a window with no answered request, is not stable.
    """
    if count < 1 or len(windows) < count:
        return False
    last = windows[-count:]
    if any(w.p95_ms is None or w.throughput_rps <= 0 for w in last):
        return False
    tolerance = stability_pct / 100.0
    for values in ([w.throughput_rps for w in last], [float(w.p95_ms or 0.0) for w in last]):
        mean = sum(values) / len(values)
        if mean <= 0 or any(abs(v - mean) > tolerance * mean for v in values):
            return False
    return True


def group_stats(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Requests, errors, ok throughput (per ``duration_s``) and percentiles of a group."""
    ok = [r.latency_ms for r in records if r.ok]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "throughput_rps": round(len(ok) / duration_s, 2) if duration_s > 0 else 0.0,
        "latency_ms": {k: _round(v) for k, v in percentiles_ms(ok).items()},
    }


def short_error(text: str) -> str:
    """One line of at most :data:`ERROR_TEXT_MAX_CHARS`, for records and summaries."""
    line = " ".join(text.split())
    if len(line) > ERROR_TEXT_MAX_CHARS:
        line = line[: ERROR_TEXT_MAX_CHARS - 1] + "…"
    return line


def summarize(
    records: Sequence[RequestRecord],
    *,
    measured_from_s: float,
    measured_to_s: float,
    spec: LoadSpec,
    server_names: Sequence[str],
    windows: Sequence[WindowStats] = (),
    stable: bool | None = None,
    throttled: int = 0,
    stopped: bool = False,
) -> LoadReport:
    """Build the report from every record of a run and the measured interval.

    Args:
        records: All records (warm-up and drain included); only those completed inside
            ``[measured_from_s, measured_to_s]`` count.
        measured_from_s: Start of the measured interval, seconds since the run start.
        measured_to_s: End of the measured interval.
        spec: The run's spec (mode, protocol, shape).
        server_names: Name of each target index, for ``by_server``.
        windows: The measurement windows, for the report.
        stable: The stability verdict (``None`` in fixed-duration mode).
        throttled: Rate-mode arrivals that waited for the in-flight bound.
        stopped: Whether a stop event ended the run.
    """
    duration_s = max(measured_to_s - measured_from_s, 0.0)
    measured = [r for r in records if _in_range(r, measured_from_s, measured_to_s)]
    overall = group_stats(measured, duration_s)
    latency = percentiles_ms([r.latency_ms for r in measured if r.ok])

    def grouped(key: Callable[[RequestRecord], str | None]) -> dict[str, dict[str, Any]]:
        groups: dict[str, list[RequestRecord]] = {}
        for r in measured:
            name = key(r)
            if name is not None:
                groups.setdefault(name, []).append(r)
        return {name: group_stats(rs, duration_s) for name, rs in sorted(groups.items())}

    errors = Counter(r.error or "unknown error" for r in measured if not r.ok)
    return LoadReport(
        requests=overall["requests"],
        errors=overall["errors"],
        throughput_rps=(len(measured) - overall["errors"]) / duration_s if duration_s > 0 else 0.0,
        latency_ms=latency,
        stable=stable,
        windows=list(windows),
        duration_s=duration_s,
        measured_from_s=measured_from_s,
        measured_to_s=measured_to_s,
        mode=spec.mode,
        protocol=spec.protocol,
        concurrency=spec.concurrency,
        rate_rps=spec.rate_rps,
        # Only answered requests carry a version; errors are under by_server.
        by_version=grouped(lambda r: r.model_version if r.ok else None),
        by_server=grouped(lambda r: server_names[r.server]),
        by_arm=grouped(lambda r: r.tag),
        error_texts=dict(errors.most_common(5)),
        throttled=throttled,
        stopped=stopped,
        records=list(records),
    )


def request_rows(request_index: int, batch_size: int, n_rows: int) -> list[int]:
    """Payload rows of the ``request_index``-th request: the next ``batch_size`` rows,
    wrapping around the payload."""
    first = request_index * batch_size
    return [(first + j) % n_rows for j in range(batch_size)]


def distinct_requests(batch_size: int, n_rows: int) -> int:
    """How many requests before the row sequence repeats."""
    return n_rows // math.gcd(n_rows, batch_size)


def arrival_gaps_s(spec: LoadSpec, rng: random.Random) -> Callable[[], float]:
    """Seconds to the next arrival: constant ``1/rate`` or exponential with that mean."""
    rate = float(spec.rate_rps or 1.0)
    if spec.arrival == "poisson":
        return lambda: rng.expovariate(rate)
    return lambda: 1.0 / rate


def check_payload(payload: Mapping[str, np.ndarray]) -> int:
    """Number of rows of a payload whose arrays share a leading row dimension.

    Raises:
        UsageError: No inputs, a scalar, or arrays with different row counts.
    """
    if not payload:
        raise UsageError("the payload has no input arrays")
    rows = {
        name: np.asarray(a).shape[0] if np.asarray(a).ndim else 0 for name, a in payload.items()
    }
    counts = set(rows.values())
    if len(counts) != 1 or 0 in counts:
        raise UsageError(
            f"payload arrays need one shared, non-empty leading row dimension, got {rows}"
        )
    return counts.pop()


# --------------------------------------------------------------------------- transports


class RequestFailed(Exception):
    """A request got no answer; ``str()`` is the short error text for the record."""


class _Transport(Protocol):
    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        """Send a prepared request; return the answering version and maybe the outputs."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class _Requests:
    """Lazily built, cached request bodies per (target, request index)."""

    def __init__(
        self,
        targets: Sequence[Target],
        payload: Mapping[str, np.ndarray],
        batch_size: int,
        build: Callable[[Target, dict[str, np.ndarray]], Any],
    ) -> None:
        self._targets = targets
        self._payload = {k: np.ascontiguousarray(v) for k, v in payload.items()}
        self._batch_size = batch_size
        self._n_rows = check_payload(payload)
        self._period = distinct_requests(batch_size, self._n_rows)
        self._build = build
        self._cache: list[dict[int, Any]] = [{} for _ in targets]

    def get(self, target: int, request: int) -> Any:
        key = request % self._period
        cache = self._cache[target]
        built = cache.get(key)
        if built is None:
            rows = request_rows(key, self._batch_size, self._n_rows)
            arrays = {name: np.ascontiguousarray(a[rows]) for name, a in self._payload.items()}
            built = cache[key] = self._build(self._targets[target], arrays)
        return built


def _raw_bytes(array: np.ndarray) -> bytes:
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    if np_to_triton_dtype(array.dtype) == "BYTES":
        serialized = serialize_byte_tensor(array)
        return bytes(serialized.item()) if serialized.size > 0 else b""
    return np.ascontiguousarray(array).tobytes()


def build_infer_request(target: Target, arrays: Mapping[str, np.ndarray]) -> Any:
    """The ``ModelInferRequest`` protobuf of one request: inputs as raw tensor contents,
    as tritonclient's gRPC client sends them."""
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


def _build_grpc_message(target: Target, arrays: Mapping[str, np.ndarray]) -> bytes:
    message: bytes = build_infer_request(target, arrays).SerializeToString()
    if len(message) > RAW_GRPC_MAX_MESSAGE_BYTES:
        raise RequestFailed(
            f"INVALID_ARGUMENT: a {len(message)}-byte request is over the raw gRPC transport's "
            f"{RAW_GRPC_MAX_MESSAGE_BYTES} bytes")
    return message


def _grpc_outputs(response: Any, keep: bool) -> dict[str, np.ndarray] | None:
    """A ModelInferResponse's outputs as arrays (through tritonclient), when they are kept."""
    if not keep:
        return None
    from tritonclient.grpc import InferResult

    result = InferResult(response)
    return {o.name: result.as_numpy(o.name) for o in response.outputs}


class _GrpcTransport:
    """KServe v2 gRPC with tritonclient's generated stubs, one channel per server URL."""

    def __init__(
        self, targets: Sequence[Target], payload: Mapping[str, np.ndarray], spec: LoadSpec
    ) -> None:
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
        self._requests = _Requests(targets, payload, spec.batch_size, build_infer_request)

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        try:
            response = await self._stubs[target].ModelInfer(
                self._requests.get(target, request), timeout=self._timeout_s
            )
        except self._grpc.aio.AioRpcError as exc:
            raise RequestFailed(f"{exc.code().name}: {exc.details()}") from None
        return response.model_version, _grpc_outputs(response, self._keep_outputs)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


# gRPC over HTTP/2, written by hand (RFC 9113 framing, RFC 7541 header compression by the
# ``hpack`` package that comes with httpx[http2]).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_FRAME = struct.Struct(">HBBBI")  # 24-bit length as (high 16, low 8), type, flags, stream
_H2_DATA, _H2_HEADERS, _H2_RST_STREAM, _H2_SETTINGS = 0x0, 0x1, 0x3, 0x4
_H2_PING, _H2_GOAWAY, _H2_WINDOW_UPDATE, _H2_CONTINUATION = 0x6, 0x7, 0x8, 0x9
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


def _no_delay(transport: asyncio.Transport) -> asyncio.Transport:
    """The transport with Nagle off: a small request goes out at once, not after an ACK."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        import socket

        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return transport


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


class _H2Stream:
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


class _H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying unary gRPC calls, many streams at a time.

    Why not grpc.aio for the hot path: its per-call machinery (call objects, metadata,
    interceptor checks, a completion queue polled from the event loop) costs ~250-450 µs
    of client CPU per request here, 2-4× the raw HTTP transport, and that CPU is taken from
    the server under test on a small machine. This class writes one prebuilt HEADERS and
    DATA frame per call and reads the answer's frames in place. It honours the server's
    SETTINGS (stream limit, initial window, frame size), the connection's send window, PING
    and GOAWAY; it opens its own receive windows to the maximum.
    """

    def __init__(self) -> None:
        import hpack

        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decoder = hpack.Decoder()
        self._decoded: dict[bytes, list[tuple[str, str]]] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self._buffer = bytearray()
        self._streams: dict[int, _H2Stream] = {}
        self._next_id = 1
        self._send_window = _H2_DEFAULT_WINDOW
        self._peer_stream_window = _H2_DEFAULT_WINDOW
        self._peer_max_streams = _H2_MAX_WINDOW
        self._received = 0
        self._queued: list[tuple[_H2Stream, bytes, bytes]] = []
        self._partial: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self._out: list[bytes] = []

    # ------------------------------------------------------------------ asyncio side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = _no_delay(transport)
        settings = struct.pack(">HIHI", 0x2, 0, 0x4, _H2_MAX_WINDOW)  # no push, max window
        transport.write(
            _H2_PREFACE
            + _h2_frame(_H2_SETTINGS, 0, 0, settings)
            + _h2_frame(_H2_WINDOW_UPDATE, 0, 0,
                        struct.pack(">I", _H2_MAX_WINDOW - _H2_DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(f"UNAVAILABLE: the server closed the connection ({exc or 'EOF'})")
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _fail_all(self, text: str, above: int = 0) -> None:
        """Close to new calls; fail the queued calls and the open ones above ``above``."""
        self.closed = True
        if not self.ready.done():
            self.ready.set_exception(RequestFailed(text))
        queued, self._queued = self._queued, []
        for stream, _, _ in queued:
            if stream.timer is not None:
                stream.timer.cancel()
            if not stream.waiter.done():
                stream.waiter.set_exception(RequestFailed(text))
        for stream_id in [s for s in self._streams if s > above]:
            self._finish(stream_id, RequestFailed(text))

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
        stream = _H2Stream(waiter, loop.time() + timeout_s, timeout_s)
        body = b"\x00" + struct.pack(">I", len(message)) + message
        if self.closed:
            waiter.set_exception(RequestFailed("UNAVAILABLE: the connection is closing"))
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

    def _start(self, stream: _H2Stream, headers_block: bytes, body: bytes) -> None:
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

    def _expire(self, stream: _H2Stream) -> None:
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
                f"UNAVAILABLE: the server reset the stream (HTTP/2 error {code})"))
        elif kind == _H2_GOAWAY and len(payload) >= 8:
            last_id, code = struct.unpack_from(">II", payload)
            text = payload[8:].decode(errors="replace")
            self._fail_all(f"UNAVAILABLE: the server is going away (HTTP/2 error {code}"
                           f"{': ' + text if text else ''})", above=last_id & 0x7FFFFFFF)
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

    def _end_stream(self, stream_id: int, stream: _H2Stream) -> None:
        headers = stream.headers
        status = headers.get("grpc-status")
        if headers.get(":status", "200") != "200":
            error: RequestFailed | None = RequestFailed(
                f"UNAVAILABLE: HTTP {headers.get(':status')} from the gRPC endpoint")
        elif status is None:
            error = RequestFailed("INTERNAL: the answer ended without a grpc-status")
        elif status != "0":
            from urllib.parse import unquote

            name = _GRPC_STATUS.get(int(status), f"STATUS_{status}") if status.isdigit() \
                else f"STATUS_{status}"
            error = RequestFailed(f"{name}: {unquote(headers.get('grpc-message', ''))}")
        else:
            error = None
        self._finish(stream_id, error)


def _unpad(payload: bytes, flags: int) -> bytes:
    if flags & _H2_PADDED and payload:
        return payload[1: len(payload) - payload[0]]
    return payload


class _RawGrpcTransport:
    """KServe v2 gRPC as prebuilt HTTP/2 frames on one connection per server.

    Each distinct request is one serialized ``ModelInferRequest`` (built like
    :class:`_GrpcTransport` builds it) and each target one literal header block; a call
    writes both as two frames. The answer is parsed with the generated
    ``ModelInferResponse`` (``model_version``, and the outputs through tritonclient's
    ``InferResult`` when ``keep_outputs`` is set), so records mean the same as with
    grpc.aio. Error texts are ``STATUS_NAME: message`` as there.
    """

    def __init__(self, targets: Sequence[Target], payload: Mapping[str, np.ndarray],
                 spec: LoadSpec) -> None:
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
        self._connections: dict[tuple[str, int], _H2Connection] = {}
        self._opening: dict[tuple[str, int], asyncio.Future[_H2Connection]] = {}
        self._requests = _Requests(targets, payload, spec.batch_size, _build_grpc_message)

    async def _connection(self, address: tuple[str, int]) -> _H2Connection:
        conn = self._connections.get(address)
        if conn is not None and not conn.closed:
            return conn
        opening = self._opening.get(address)
        if opening is None:
            opening = self._opening[address] = asyncio.ensure_future(self._open(address))
            opening.add_done_callback(lambda _: self._opening.pop(address, None))
        return await asyncio.shield(opening)

    async def _open(self, address: tuple[str, int]) -> _H2Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                _, conn = await loop.create_connection(_H2Connection, *address)
                await conn.ready
        except (OSError, TimeoutError) as exc:
            raise RequestFailed(f"UNAVAILABLE: {type(exc).__name__}: {exc}") from None
        self._connections[address] = conn
        return conn

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        address = self._addresses[target]
        conn = self._connections.get(address)
        if conn is None or conn.closed:
            conn = await self._connection(address)
        message, _ = await conn.call(
            self._blocks[target], self._requests.get(target, request), self._timeout_s)
        if len(message) < 5:
            raise RequestFailed("INTERNAL: the answer carried no message")
        if message[0] != 0:
            raise RequestFailed("INTERNAL: a compressed answer (none was asked for)")
        response = self._response.FromString(message[5:])
        return response.model_version, _grpc_outputs(response, self._keep_outputs)

    async def close(self) -> None:
        for conn in self._connections.values():
            if conn.transport is not None:
                conn.transport.close()


def _grpc_address(url: str) -> tuple[str, int]:
    host, _, port = host_port(url).rpartition(":")
    if not port.isdigit():
        raise UsageError(f"a gRPC endpoint needs host:port, got {url!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class _HttpTransport:
    """KServe v2 HTTP/REST over aiohttp with binary tensors, one pool per server."""

    def __init__(
        self,
        targets: Sequence[Target],
        payload: Mapping[str, np.ndarray],
        spec: LoadSpec,
        connections: int,
    ) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._keep_outputs = spec.keep_outputs
        self._timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
        self._connections = connections
        self._sessions: dict[str, Any] = {}
        self._bases = [_http_base(t.url) for t in targets]
        self._urls = [
            f"{base}{_infer_path(t)}" for base, t in zip(self._bases, targets, strict=True)
        ]
        self._requests = _Requests(targets, payload, spec.batch_size, self._build)

    def _session(self, base: str) -> Any:
        # Created lazily: aiohttp sessions must be made inside the running event loop.
        session = self._sessions.get(base)
        if session is None:
            connector = self._aiohttp.TCPConnector(limit=self._connections)
            session = self._sessions[base] = self._aiohttp.ClientSession(
                connector=connector, timeout=self._timeout
            )
        return session

    @staticmethod
    def _build(target: Target, arrays: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
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

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        import json

        body, headers = self._requests.get(target, request)
        session = self._session(self._bases[target])
        try:
            async with session.post(self._urls[target], data=body, headers=headers) as response:
                content = await response.read()
                status = response.status
                header_length = response.headers.get("Inference-Header-Content-Length")
        except (self._aiohttp.ClientError, TimeoutError) as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None
        if status != 200:
            try:
                message = json.loads(content).get("error", "")
            except (ValueError, AttributeError):
                message = content[:ERROR_TEXT_MAX_CHARS].decode(errors="replace")
            raise RequestFailed(f"HTTP {status}: {message}")
        header = content[: int(header_length)] if header_length else content
        version = str(json.loads(header).get("model_version", ""))
        outputs = None
        if self._keep_outputs:
            import tritonclient.http as httpclient

            result = httpclient.InferenceServerClient.parse_response_body(
                content, header_length=int(header_length) if header_length else None
            )
            outputs = {
                o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]
            }
        return version, outputs

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()


class _HttpConnection(asyncio.Protocol):
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = _no_delay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(RequestFailed(
                f"ConnectionError: the server closed the connection ({exc or 'EOF'})"))

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
            length = _header(self._head, b"content-length")
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
        if waiter is not None and not waiter.done():
            status = int(self._head[9:12])
            waiter.set_result((status, self._head, body))
        if _header(self._head, b"connection") == b"close" and self.transport is not None:
            self.transport.close()


def _header(head: bytes, name: bytes) -> bytes | None:
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


class _RawHttpTransport:
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
        self._addresses = [_http_address(t.url) for t in targets]
        self._idle: dict[tuple[str, int], list[_HttpConnection]] = {}
        self._all: list[_HttpConnection] = []
        self._paths = [_infer_path(t) for t in targets]
        self._requests = _Requests(targets, payload, spec.batch_size, self._build)

    def _build(self, target: Target, arrays: dict[str, np.ndarray]) -> bytes:
        body, headers = _HttpTransport._build(target, arrays)
        host, port = _http_address(target.url)
        head = [f"POST {_infer_path(target)} HTTP/1.1", f"Host: {host}:{port}",
                f"Content-Length: {len(body)}", "Connection: keep-alive",
                *[f"{k}: {v}" for k, v in headers.items()]]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body

    async def _connection(self, address: tuple[str, int]) -> _HttpConnection:
        idle = self._idle.setdefault(address, [])
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_HttpConnection, *address), self._timeout_s)
        except (OSError, TimeoutError) as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None
        self._all.append(conn)
        return conn

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        import json

        address = self._addresses[target]
        conn = await self._connection(address)
        waiter = conn.request(self._requests.get(target, request))
        timer = asyncio.get_running_loop().call_later(
            self._timeout_s, _expire, waiter, self._timeout_s)
        try:
            status, head, content = await waiter
        except RequestFailed:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()
            raise
        finally:
            timer.cancel()
        if not conn.closed:
            self._idle[address].append(conn)
        length = _header(head, b"inference-header-content-length")
        if status != 200:
            try:
                message = json.loads(content).get("error", "")
            except (ValueError, AttributeError):
                message = content[:ERROR_TEXT_MAX_CHARS].decode(errors="replace")
            raise RequestFailed(f"HTTP {status}: {message}")
        header = content[: int(length)] if length else content
        outputs = None
        if self._keep_outputs:
            import tritonclient.http as httpclient

            result = httpclient.InferenceServerClient.parse_response_body(
                content, header_length=int(length) if length else None)
            outputs = {o["name"]: result.as_numpy(o["name"])
                       for o in result.get_response()["outputs"]}
        return _model_version(header), outputs

    async def close(self) -> None:
        for conn in self._all:
            if conn.transport is not None:
                conn.transport.close()


def _expire(waiter: asyncio.Future[Any], timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(RequestFailed(f"TimeoutError: no answer within {timeout_s:g} s"))


def _model_version(header: bytes) -> str:
    """``model_version`` from an inference answer's JSON header, without parsing it all."""
    at = header.find(b'"model_version"')
    if at < 0:
        return ""
    start = header.find(b'"', header.find(b":", at) + 1) + 1
    return header[start: header.find(b'"', start)].decode()


def _http_address(url: str) -> tuple[str, int]:
    base = _http_base(url).split("://", 1)[1]
    host, _, port = base.partition("/")[0].rpartition(":")
    return (host or base, int(port)) if port.isdigit() else (base.partition("/")[0], 80)


def _http_base(url: str) -> str:
    return url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"


def _infer_path(target: Target) -> str:
    model = quote(target.model, safe="")
    if target.version:
        return f"/v2/models/{model}/versions/{quote(target.version, safe='')}/infer"
    return f"/v2/models/{model}/infer"


# --------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class _Leg:
    target: int
    tag: str | None


class _Engine:
    """Runs one load: workers or an arrival scheduler, plus the window monitor."""

    def __init__(
        self,
        transport: _Transport,
        units: Callable[[int], Sequence[_Leg]],
        spec: LoadSpec,
        stop: asyncio.Event | None,
        n_rows: int,
    ) -> None:
        self._transport = transport
        self._n_rows = n_rows
        self._units = units
        self._spec = spec
        self._stop = stop
        self._records: list[RequestRecord] = []
        self._counter = 0
        self._stopping = False
        self._throttled = 0
        self._t0 = 0.0

    def _next(self) -> int:
        index = self._counter
        self._counter += 1
        return index

    async def _unit(self, index: int) -> None:
        """Send one unit: one request, or one row to both arms in turn."""
        records = self._records
        send = self._transport.send
        t0 = self._t0
        for leg in self._units(index):
            started = time.perf_counter()
            error: str | None = None
            version = ""
            outputs = None
            try:
                version, outputs = await send(leg.target, index)
            except RequestFailed as exc:
                error = short_error(str(exc))
            except Exception as exc:  # noqa: BLE001 - any failure is a failed request
                error = short_error(f"{type(exc).__name__}: {exc}")
            ended = time.perf_counter()
            records.append(
                RequestRecord(
                    start_s=started - t0,
                    latency_ms=(ended - started) * 1000.0,
                    ok=error is None,
                    error=error,
                    server=leg.target,
                    model_version=version,
                    row=(index * self._spec.batch_size) % self._n_rows,
                    tag=leg.tag,
                    outputs=outputs,
                )
            )

    async def _worker(self) -> None:
        while not self._stopping:
            await self._unit(self._next())

    async def _scheduler(self) -> None:
        spec = self._spec
        gap = arrival_gaps_s(spec, random.Random(spec.seed))
        slots = asyncio.Semaphore(spec.max_outstanding)
        in_flight: set[asyncio.Task[None]] = set()

        async def one(index: int) -> None:
            try:
                await self._unit(index)
            finally:
                slots.release()

        next_s = time.perf_counter()
        try:
            while not self._stopping:
                delay_s = next_s - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                if self._stopping:
                    break
                if slots.locked():
                    self._throttled += 1
                await slots.acquire()
                task = asyncio.ensure_future(one(self._next()))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                next_s += gap()
        finally:
            if in_flight:
                await asyncio.wait(in_flight, timeout=spec.timeout_s + _DRAIN_GRACE_S)
                for task in in_flight:
                    task.cancel()

    async def _sleep_until(self, at_s: float) -> bool:
        """Sleep until ``at_s`` (run-relative); ``True`` if the stop event fired first."""
        delay_s = at_s - (time.perf_counter() - self._t0)
        if self._stop is None:
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            return False
        if self._stop.is_set():
            return True
        if delay_s <= 0:
            return False
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=delay_s)
        except TimeoutError:
            return False
        return True

    async def _monitor(self) -> tuple[float, float, list[WindowStats], bool | None, bool]:
        """Warm up, then close windows until stable, out of time or stopped."""
        spec = self._spec
        fixed = spec.duration_s is not None
        end_s = spec.duration_s if fixed else spec.max_duration_s
        assert end_s is not None
        warmup_s = min(spec.warmup_s, end_s)
        windows: list[WindowStats] = []
        if await self._sleep_until(warmup_s):
            now_s = time.perf_counter() - self._t0
            return warmup_s, max(now_s, warmup_s), windows, (None if fixed else False), True
        seen = _completed_after(self._records, warmup_s)
        window_start_s = warmup_s
        while True:
            window_end_s = min(window_start_s + spec.window_s, end_s)
            stopped = await self._sleep_until(window_end_s)
            if stopped:
                window_end_s = time.perf_counter() - self._t0
            fresh = self._records[seen:]
            seen = len(self._records)
            if window_end_s - window_start_s >= spec.window_s * 0.5 or not windows:
                windows.append(window_stats(fresh, window_start_s, window_end_s))
            if stopped:
                return warmup_s, window_end_s, windows, (None if fixed else False), True
            if not fixed and is_stable(windows, spec.stability_pct, spec.stable_windows):
                first = windows[-spec.stable_windows].start_s
                return first, window_end_s, windows, True, False
            if fixed and window_end_s >= end_s:
                return warmup_s, window_end_s, windows, None, False
            if not fixed and window_end_s + spec.window_s > end_s + 1e-9:
                return warmup_s, window_end_s, windows, False, False
            window_start_s = window_end_s

    async def run(self, server_names: Sequence[str]) -> LoadReport:
        spec = self._spec
        self._t0 = time.perf_counter()
        if spec.concurrency is not None:
            drivers = [asyncio.ensure_future(self._worker()) for _ in range(spec.concurrency)]
        else:
            drivers = [asyncio.ensure_future(self._scheduler())]
        try:
            from_s, to_s, windows, stable, stopped = await self._monitor()
        finally:
            self._stopping = True
            done, pending = await asyncio.wait(drivers, timeout=spec.timeout_s * 2 + 2.0)
            for task in pending:
                task.cancel()
            await self._transport.close()
        for task in done:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure
        return summarize(
            self._records,
            measured_from_s=from_s,
            measured_to_s=to_s,
            spec=spec,
            server_names=server_names,
            windows=windows,
            stable=stable,
            throttled=self._throttled,
            stopped=stopped,
        )


def _completed_after(records: Sequence[RequestRecord], at_s: float) -> int:
    """Index of the first record (records are in completion order) completed after at_s."""
    for i in range(len(records) - 1, -1, -1):
        if records[i].end_s <= at_s:
            return i + 1
    return 0


def _transport(
    targets: Sequence[Target], payload: Mapping[str, np.ndarray], spec: LoadSpec
) -> _Transport:
    if spec.protocol == "http":
        if not any(t.url.startswith("https://") for t in targets):
            return _RawHttpTransport(targets, payload, spec)
        in_flight = spec.concurrency if spec.concurrency is not None else spec.max_outstanding
        return _HttpTransport(targets, payload, spec, connections=max(in_flight, 1))
    if raw_grpc_fits(payload, spec.batch_size):
        return _RawGrpcTransport(targets, payload, spec)
    return _GrpcTransport(targets, payload, spec)


def raw_grpc_fits(payload: Mapping[str, np.ndarray], batch_size: int) -> bool:
    """Whether gRPC requests can take the raw HTTP/2 transport: fixed-size tensors whose
    request fits one frame (with room for names and shapes), and ``hpack`` importable
    (it comes with httpx[http2]). Otherwise grpc.aio carries them."""
    import importlib.util

    if importlib.util.find_spec("hpack") is None:
        return False
    arrays = [np.asarray(a) for a in payload.values()]
    if any(a.dtype.hasobject or a.dtype.kind in "SU" or a.ndim == 0 for a in arrays):
        return False
    tensor_bytes = sum(a[:1].nbytes for a in arrays) * batch_size
    overhead = sum(64 + 8 * a.ndim for a in arrays) + 256
    return tensor_bytes + overhead <= RAW_GRPC_MAX_MESSAGE_BYTES


# --------------------------------------------------------------------------- public API


async def run_load(
    servers: Sequence[str],
    model: str,
    payload: Mapping[str, np.ndarray],
    spec: LoadSpec,
    *,
    version: str = "",
    stop: asyncio.Event | None = None,
) -> LoadReport:
    """Load one model on one or more servers, requests spread round-robin over them.

    Args:
        servers: gRPC ``host:port`` or HTTP ``http://host:port`` of each server (e.g.
            every replica), matching ``spec.protocol``.
        model: Triton model name.
        payload: Input arrays by name, rows first; request ``i`` takes the next
            ``spec.batch_size`` rows, cyclically.
        spec: Load shape, windows and timeouts.
        version: Explicit model version, or ``""`` for Triton's choice.
        stop: Ends the run early when set (the report then has ``stopped: true``).

    Returns:
        The report; ``report.records`` has every request.

    Raises:
        UsageError: An invalid spec, payload or an empty server list.
    """
    spec.validate()
    if not servers:
        raise UsageError("no servers to load", hint="Give at least one Triton endpoint")
    n_rows = check_payload(payload)
    targets = [Target(url, model, version) for url in servers]
    n = len(targets)
    legs = [(_Leg(i, None),) for i in range(n)]
    engine = _Engine(_transport(targets, payload, spec), lambda i: legs[i % n], spec, stop, n_rows)
    return await engine.run(list(servers))


async def run_paired(
    baseline: Target,
    candidate: Target,
    payload: Mapping[str, np.ndarray],
    spec: LoadSpec,
    *,
    stop: asyncio.Event | None = None,
    tags: tuple[str, str] = ("baseline", "candidate"),
) -> LoadReport:
    """Send the same rows to two arms back-to-back, alternating which goes first.

    Records carry the arm as ``tag`` and ``server`` (0 baseline, 1 candidate), so the
    canary compares latency, errors and outputs (``spec.keep_outputs``) on identical
    inputs at the same time, as Kayenta compares against a concurrent baseline.

    Args:
        baseline: The production arm.
        candidate: The arm under test.
        payload: Input arrays by name, rows first.
        spec: Load shape; ``concurrency`` and ``rate_rps`` count pairs (per arm).
        stop: Ends the run early when set.
        tags: Names of the two arms in records and ``by_arm``.

    Returns:
        The report, with ``by_arm`` per arm.

    Raises:
        UsageError: An invalid spec or payload.
    """
    spec.validate()
    n_rows = check_payload(payload)
    targets = [baseline, candidate]
    orders = (
        (_Leg(0, tags[0]), _Leg(1, tags[1])),
        (_Leg(1, tags[1]), _Leg(0, tags[0])),
    )
    engine = _Engine(
        _transport(targets, payload, spec), lambda i: orders[i % 2], spec, stop, n_rows
    )
    names = [f"{t.url}/{t.model}/{t.version or '-'}" for t in targets]
    return await engine.run(names)


def run_load_sync(
    servers: Sequence[str],
    model: str,
    payload: Mapping[str, np.ndarray],
    spec: LoadSpec,
    *,
    version: str = "",
) -> LoadReport:
    """:func:`run_load` in a fresh event loop, for the CLI and scripts."""
    return asyncio.run(run_load(servers, model, payload, spec, version=version))
