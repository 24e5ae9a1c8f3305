"""Triton's Prometheus metrics, per model version: scrape, difference, per-request means.

The canary reads the server's side of each arm from here: how long requests queued and
computed, in µs, on the same server at the same time. Triton (2.51) exposes cumulative
counters per ``(model, version)``; a canary takes one scrape before its load and one after
and works on the difference. Two facts from RECIPES shape it:

- After a swap or an unload the old version's series **vanish**, and a reloaded version's
  counters **restart at 0**. :func:`delta` therefore treats ``after < before`` as a reset
  (the after value is the delta) and reports a series missing after as ``None``, never as
  a zero: no data is never a good figure.
- A wrong-shape request is not counted as a failure, so these counters complement the
  client-side error count and never replace it.

The text exposition is parsed by ``prometheus_client.parser`` (the reference parser).
One quirk of it matters here: a family declared ``# TYPE x counter`` yields samples named
``x_total`` even when the exposition wrote ``x`` (Triton writes ``nv_inference_count``,
not ``..._total``). :func:`parse_text` therefore gives counter samples their family name
back, without ``_total``, so the names match Triton's documentation and the constants
below. ``Nan`` in empty summaries parses as NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from modelship.errors import InfrastructureError
from modelship.http import get

SUCCESS = "nv_inference_request_success"
FAILURE = "nv_inference_request_failure"
INFERENCE_COUNT = "nv_inference_count"
EXEC_COUNT = "nv_inference_exec_count"
REQUEST_US = "nv_inference_request_duration_us"
QUEUE_US = "nv_inference_queue_duration_us"
COMPUTE_INPUT_US = "nv_inference_compute_input_duration_us"
COMPUTE_INFER_US = "nv_inference_compute_infer_duration_us"
COMPUTE_OUTPUT_US = "nv_inference_compute_output_duration_us"
PENDING = "nv_inference_pending_request_count"

COUNTERS: tuple[str, ...] = (
    SUCCESS,
    FAILURE,
    INFERENCE_COUNT,
    EXEC_COUNT,
    REQUEST_US,
    QUEUE_US,
    COMPUTE_INPUT_US,
    COMPUTE_INFER_US,
    COMPUTE_OUTPUT_US,
)
"""The cumulative per-version counters kept (failures are summed over ``reason``)."""

GAUGES: tuple[str, ...] = (PENDING,)
"""Per-version gauges kept as seen at the scrape (never differenced): requests queued or
executing in the server at that instant (Triton ≥ 2.31)."""

SUMMARIES: tuple[str, ...] = (
    "nv_inference_request_summary_us",
    "nv_inference_queue_summary_us",
    "nv_inference_compute_input_summary_us",
    "nv_inference_compute_infer_summary_us",
    "nv_inference_compute_output_summary_us",
)
"""Latency summaries (``--metrics-config=summary_latencies=true``): quantiles in µs over
Triton's recent window, not cumulative, so they are reported as seen and never differenced."""

VersionKey = tuple[str, str]
"""``(model, version)`` as Triton labels them (the version is a string)."""


@dataclass(frozen=True)
class Sample:
    """One line of the exposition: a metric name, its labels and its value."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class VersionMetrics:
    """Everything one scrape says about one model version.

    Attributes:
        counters: Cumulative counters by metric name (see :data:`COUNTERS`), requests or µs.
        quantiles_us: Summary quantiles by summary name, then quantile (``"0.99"``), in µs;
            NaN (an empty summary) is left out.
        gauges: Gauges by metric name (see :data:`GAUGES`), as seen at the scrape.
    """

    counters: dict[str, float] = field(default_factory=dict)
    quantiles_us: dict[str, dict[str, float]] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


Scrape = dict[VersionKey, VersionMetrics]


@dataclass(frozen=True)
class VersionDelta:
    """What one version did between two scrapes.

    Attributes:
        counters: After minus before for each counter present after; a counter that went
            down was reset (a reload) and contributes its after value.
        resets: Names of the counters that went down between the scrapes.
        new: The series did not exist before (the version loaded in between).
        quantiles_us: The after scrape's summary quantiles, in µs.
        gauges: The after scrape's gauges (requests pending at its instant).
    """

    counters: dict[str, float]
    resets: tuple[str, ...] = ()
    new: bool = False
    quantiles_us: dict[str, dict[str, float]] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)

    @property
    def requests(self) -> float:
        """Successful requests counted by the server in the interval."""
        return self.counters.get(SUCCESS, 0.0)

    @property
    def failures(self) -> float:
        """Failed requests the server counted (not wrong-shape ones, see the module doc)."""
        return self.counters.get(FAILURE, 0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with the per-request means."""
        return {
            "requests": self.requests,
            "failures": self.failures,
            "queue_us_mean": mean_queue_us(self),
            "compute_us_mean": mean_compute_us(self),
            "compute_infer_us_mean": mean_per_request_us(self, COMPUTE_INFER_US),
            "request_us_mean": mean_per_request_us(self, REQUEST_US),
            "batch_size_mean": mean_batch_size(self),
            "resets": list(self.resets),
            "new": self.new,
            "quantiles_us": self.quantiles_us,
        }


# --------------------------------------------------------------------------- parsing


def parse_text(text: str) -> Iterator[Sample]:
    """The samples of a Prometheus text exposition, through ``prometheus_client.parser``.

    Counter samples keep their exposition name without ``_total`` (see the module doc).
    A malformed line makes the reference parser reject the whole text; then the text is
    parsed line by line (each line with the ``# TYPE`` seen before it) and only the
    malformed lines are skipped, so one bad series cannot hide every other one.
    """
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        yield from _parse_lines(text)
        return
    for family in families:
        yield from _samples(family)


def _samples(family: Any) -> Iterator[Sample]:
    counter = family.type == "counter"
    for sample in family.samples:
        name = sample.name
        if counter and name == f"{family.name}_total":
            name = family.name
        elif counter and name == f"{family.name}_created":
            continue  # client-library timestamps, not counts
        yield Sample(name, dict(sample.labels), float(sample.value))


def _parse_lines(text: str) -> Iterator[Sample]:
    types: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        header = f"# TYPE {name} {types[name]}\n" if name in types else ""
        try:
            families = list(text_string_to_metric_families(header + line + "\n"))
        except ValueError:
            continue
        for family in families:
            yield from _samples(family)


def parse_metrics(text: str) -> Scrape:
    """Triton's per-version counters and summary quantiles from one exposition (pure).

    Series without ``model`` and ``version`` labels (server-wide gauges) are ignored, and
    ``nv_inference_request_failure`` is summed over its ``reason`` label.
    """
    out: Scrape = {}
    for sample in parse_text(text):
        model, version = sample.labels.get("model"), sample.labels.get("version")
        if model is None or version is None:
            continue
        if sample.name in COUNTERS:
            entry = out.setdefault((model, version), VersionMetrics())
            entry.counters[sample.name] = entry.counters.get(sample.name, 0.0) + sample.value
        elif sample.name in GAUGES:
            entry = out.setdefault((model, version), VersionMetrics())
            entry.gauges[sample.name] = entry.gauges.get(sample.name, 0.0) + sample.value
        elif sample.name in SUMMARIES and "quantile" in sample.labels:
            entry = out.setdefault((model, version), VersionMetrics())
            if not math.isnan(sample.value):
                entry.quantiles_us.setdefault(sample.name, {})[sample.labels["quantile"]] = (
                    sample.value
                )
    return out


def scrape_text(metrics_url: str, timeout_s: float) -> str:
    """Fetch a Triton metrics endpoint (``http://host:port/metrics``) as exposition text.

    One fetch serves both readers: :func:`parse_metrics` (per-version counters) and
    :func:`modelship.triton.gpu.parse_gpu_metrics` (the ``nv_gpu_*`` gauges).

    Raises:
        Unreachable: The endpoint did not answer within ``timeout_s``.
        InfrastructureError: It answered with an error status.
    """
    status, body = get(metrics_url, timeout_s=timeout_s, what="Triton metrics")
    if status != 200:
        raise InfrastructureError(
            f"Triton metrics at {metrics_url} answered HTTP {status}, not 200",
            hint="start tritonserver with --allow-metrics=true and check the metrics port",
            endpoint=metrics_url, status=status,
        )
    return body.decode("utf-8", errors="replace")


def scrape(metrics_url: str, timeout_s: float) -> Scrape:
    """Fetch and parse a Triton metrics endpoint (see :func:`scrape_text`)."""
    return parse_metrics(scrape_text(metrics_url, timeout_s))


# --------------------------------------------------------------------------- differences


def delta(before: Mapping[VersionKey, VersionMetrics],
          after: Mapping[VersionKey, VersionMetrics]) -> dict[VersionKey, VersionDelta | None]:
    """Per-version change between two scrapes (pure).

    Every version in either scrape gets an entry. A version missing after (unloaded,
    swapped away: its series vanished) maps to ``None``, which callers report as "no
    server-side data" rather than as zero. A version new after (loaded in between) counts
    from 0. A counter that went down was reset by a reload, so its after value is the
    change since the reset (what happened before the reset is lost, and said so in
    ``resets``).
    """
    out: dict[VersionKey, VersionDelta | None] = {}
    for key in sorted({*before, *after}):
        now = after.get(key)
        if now is None:
            out[key] = None
            continue
        then = before.get(key)
        counters: dict[str, float] = {}
        resets: list[str] = []
        for name, value in now.counters.items():
            previous = then.counters.get(name) if then is not None else None
            if previous is None:
                counters[name] = value
            elif value < previous:
                counters[name] = value
                resets.append(name)
            else:
                counters[name] = value - previous
        out[key] = VersionDelta(counters=counters, resets=tuple(resets), new=then is None,
                                quantiles_us=now.quantiles_us, gauges=now.gauges)
    return out


def mean_per_request_us(change: VersionDelta | None, counter: str) -> float | None:
    """``counter`` (cumulative µs) per successful request; None without requests or data.

    Triton's duration counters accumulate per request (a batched request carries the
    whole batch's compute time), so the per-request mean divides by the success count.
    """
    if change is None or counter not in change.counters or change.requests <= 0:
        return None
    return change.counters[counter] / change.requests


def mean_queue_us(change: VersionDelta | None) -> float | None:
    """Mean time a request waited in Triton's queue (scheduler, batcher), in µs."""
    return mean_per_request_us(change, QUEUE_US)


def mean_compute_us(change: VersionDelta | None) -> float | None:
    """Mean compute time per request, in µs: input copy + inference + output copy."""
    if change is None or change.requests <= 0:
        return None
    parts = [change.counters.get(n) for n in (COMPUTE_INPUT_US, COMPUTE_INFER_US,
                                              COMPUTE_OUTPUT_US)]
    known = [p for p in parts if p is not None]
    if not known:
        return None
    return sum(known) / change.requests


def mean_batch_size(change: VersionDelta | None) -> float | None:
    """Inferences per model execution: the average batch the dynamic batcher formed."""
    if change is None:
        return None
    executions = change.counters.get(EXEC_COUNT, 0.0)
    if executions <= 0 or INFERENCE_COUNT not in change.counters:
        return None
    return change.counters[INFERENCE_COUNT] / executions


def load_of(change: VersionDelta | None, seconds: float) -> dict[str, float | None]:
    """The load one version carried between two scrapes ``seconds`` apart (pure).

    - ``rate_rps``: requests the server finished (successes and failures) per second;
    - ``inflight``: the time-average number of requests inside the server (queued or
      executing): the request-duration µs it accumulated over the interval's µs (Little's
      law, L = λW; exact for requests that began and ended inside the interval);
    - ``pending``: the ``nv_inference_pending_request_count`` gauge at the later scrape
      (an instant, so noisy; None when the server does not export it).

    Every figure is None without data (the series vanished, or ``seconds`` ≤ 0).
    """
    if change is None or seconds <= 0:
        return {"rate_rps": None, "inflight": None, "pending": None}
    busy_us = change.counters.get(REQUEST_US)
    return {"rate_rps": (change.requests + change.failures) / seconds,
            "inflight": None if busy_us is None else busy_us / (seconds * 1e6),
            "pending": change.gauges.get(PENDING)}
