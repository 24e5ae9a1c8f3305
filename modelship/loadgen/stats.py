"""The statistics of a load run (pure): percentiles, windows, stability, the summary.

perf_analyzer's method, kept apart from the engine so each decision is table-tested on
hand-made records: latency percentiles over answered requests only (``None`` for no data,
never a fake 0), windows by completion time, and its stability rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from modelship.loadgen.report import (
    LoadReport,
    RequestRecord,
    WindowStats,
    completed_in,
    rounded,
)
from modelship.loadgen.spec import LoadSpec

PERCENTILES = (50, 90, 95, 99)
ERROR_TEXT_MAX_CHARS = 200


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
        "latency_ms": {k: rounded(v) for k, v in percentiles_ms(ok).items()},
    }


def short_error(text: str) -> str:
    """One line of at most :data:`ERROR_TEXT_MAX_CHARS`, for records and summaries."""
    line = " ".join(text.split())
    if len(line) > ERROR_TEXT_MAX_CHARS:
        line = line[: ERROR_TEXT_MAX_CHARS - 1] + "…"
    return line


def _grouped(
    measured: Sequence[RequestRecord],
    duration_s: float,
    key: Callable[[RequestRecord], str | None],
) -> dict[str, dict[str, Any]]:
    """:func:`group_stats` of each group of ``measured`` by ``key`` (``None``: in no group)."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in measured:
        name = key(r)
        if name is not None:
            groups.setdefault(name, []).append(r)
    return {name: group_stats(rs, duration_s) for name, rs in sorted(groups.items())}


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
    measured = [r for r in records if completed_in(r, measured_from_s, measured_to_s)]
    overall = group_stats(measured, duration_s)
    latency = percentiles_ms([r.latency_ms for r in measured if r.ok])
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
        by_version=_grouped(measured, duration_s, lambda r: r.model_version if r.ok else None),
        by_server=_grouped(measured, duration_s, lambda r: server_names[r.server]),
        by_arm=_grouped(measured, duration_s, lambda r: r.tag),
        error_texts=dict(errors.most_common(5)),
        throttled=throttled,
        stopped=stopped,
        records=list(records),
    )
