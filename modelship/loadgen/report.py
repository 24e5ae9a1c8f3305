"""What a load run produced: one record per request, the windows, and the report.

These are the data every consumer reads (the canary, the bake, ``modelship load --json``,
the benchmarks); the statistics that fill them live in :mod:`modelship.loadgen.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def rounded(value: float | None, digits: int = 3) -> float | None:
    """``value`` rounded for a JSON document; ``None`` (no data) stays ``None``."""
    return None if value is None else round(value, digits)


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


def completed_in(record: RequestRecord, from_s: float, to_s: float) -> bool:
    """Whether ``record`` completed inside ``[from_s, to_s]`` (the measured interval)."""
    return from_s <= record.end_s <= to_s


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
            "p95_ms": rounded(self.p95_ms),
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
        return [
            r for r in self.records if completed_in(r, self.measured_from_s, self.measured_to_s)
        ]

    def to_dict(self) -> dict[str, Any]:
        """DESIGN §6 keys first, then the extras; no records."""
        document: dict[str, Any] = {
            "requests": self.requests,
            "errors": self.errors,
            "throughput_rps": round(self.throughput_rps, 2),
            "latency_ms": {k: rounded(v) for k, v in self.latency_ms.items()},
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
