"""What a canary measured, as plain data: the input of the (pure) gates.

The canary (``tasks/canary.py``) fills a :class:`CanarySnapshot` from the load generator's
records and Triton's metrics; the gates (``tasks/gates.py``) judge it. Keeping the snapshot
free of I/O lets the gates be table-tested and the judge benchmark simulate canaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class MeasurementError(ValueError):
    """A latency sample that is not a measurement: non-numeric, non-finite or negative.

    A ValueError for callers of the pure functions; the gates turn it into an ``error``
    verdict that carries this message.
    """


def check_latency(latency_ms: object, who: str = "the sample") -> np.ndarray:
    """The latencies as a flat float array, or a clear error when they cannot be real.

    Latencies are durations: finite and ≥ 0 ms. NaN, ±inf and negative values come from a
    broken clock or a broken collector; flooring or dropping them would judge invented
    data, so they are refused.

    Raises:
        MeasurementError: Naming how many values are bad, of which kind, and whose.
    """
    try:
        lat = np.asarray(latency_ms, dtype=float).ravel()
    except (TypeError, ValueError) as exc:
        raise MeasurementError(f"the latencies of {who} are not numbers ({exc})") from exc
    nonfinite = int(np.count_nonzero(~np.isfinite(lat)))
    negative = int(np.count_nonzero(lat < 0))
    if nonfinite or negative:
        parts = ([f"{nonfinite} NaN or infinite"] if nonfinite else []) + \
            ([f"{negative} negative"] if negative else [])
        raise MeasurementError(
            f"{' and '.join(parts)} of {lat.size} latencies of {who}: the measurement is "
            "broken (latencies must be finite and ≥ 0 ms); check the load generator's clock "
            "and records")
    return lat


@dataclass(frozen=True)
class ArmMeasurements:
    """One side of the comparison (baseline P or candidate C) on the canary server.

    Attributes:
        version: The Triton/MLflow version of this arm.
        latency_ms: Client-side latency of every *successful* measured request, in ms.
        requests: Requests sent in the measurement window (successful + failed).
        errors: Requests that failed (client-side count: Triton does not count every
            failure).
        throughput_rps: Successful requests per second in the measurement window.
        queue_us_mean: Server-side mean queue time per request, in µs (None if unknown).
        compute_us_mean: Server-side mean compute time per request, in µs (None if unknown).
        latency_s: Send time of each successful request (aligned with ``latency_ms``), s
            since the measurement started; None when unknown (the order of ``latency_ms``
            is then taken as the time order). The gates split the run into time blocks by
            it (:mod:`tasks.blocks`): requests are correlated, blocks much less so.
        error_s: Send time of each failed request, s; None when unknown (errors are then
            judged as independent, and the report says so).
    """

    version: int
    latency_ms: np.ndarray
    requests: int
    errors: int
    throughput_rps: float | None = None
    queue_us_mean: float | None = None
    compute_us_mean: float | None = None
    latency_s: np.ndarray | None = None
    error_s: np.ndarray | None = None

    def to_dict(self) -> dict[str, Any]:
        lat = np.asarray(self.latency_ms, dtype=float)
        pct = {f"p{q}": (float(np.percentile(lat, q)) if lat.size else None)
               for q in (50, 90, 95, 99)}
        return {"version": self.version, "requests": self.requests, "errors": self.errors,
                "samples": int(lat.size), "latency_ms": pct,
                "throughput_rps": self.throughput_rps, "queue_us_mean": self.queue_us_mean,
                "compute_us_mean": self.compute_us_mean}


@dataclass(frozen=True)
class CanarySnapshot:
    """Everything the gates judge.

    Attributes:
        model: Model name, for messages.
        candidate: The candidate's measurements.
        baseline: The production version's measurements, measured at the same time on the
            same inputs; None on a first release (only absolute gates then apply).
        agreement: Share of identical inputs on which both versions' outputs agree, in
            [0, 1]; None when there is no baseline or no pair was compared.
        agreement_samples: Number of input pairs compared.
        agreement_kind: ``classifier`` (top-1 label) or ``regressor`` (relative error).
        window_s: Length of the measurement window, in s (for "no requests in N s").
    """

    model: str
    candidate: ArmMeasurements
    baseline: ArmMeasurements | None = None
    agreement: float | None = None
    agreement_samples: int = 0
    agreement_kind: str = "classifier"
    window_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "candidate": self.candidate.to_dict(),
                "baseline": self.baseline.to_dict() if self.baseline else None,
                "agreement": self.agreement, "agreement_samples": self.agreement_samples,
                "agreement_kind": self.agreement_kind, "window_s": self.window_s,
                **self.extra}
