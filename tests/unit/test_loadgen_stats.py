"""The pure pieces of the load generator: percentiles, windows, the stability rule, summary."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest

from modelship.errors import UsageError
from modelship.loadgen import (
    LoadSpec,
    RequestRecord,
    WindowStats,
    arrival_gaps_s,
    check_payload,
    distinct_requests,
    is_stable,
    percentiles_ms,
    request_rows,
    short_error,
    summarize,
    window_stats,
)
from modelship.loadgen.transports.http1 import HttpConnection, header_value
from modelship.loadgen.transports.kserve_http import http_address, model_version

NONE_PERCENTILES = {"p50": None, "p90": None, "p95": None, "p99": None}


def _record(
    start_s: float,
    latency_ms: float = 10.0,
    *,
    ok: bool = True,
    server: int = 0,
    version: str = "1",
    tag: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        start_s=start_s,
        latency_ms=latency_ms,
        ok=ok,
        error=None if ok else "UNAVAILABLE: down",
        server=server,
        model_version=version if ok else "",
        row=0,
        tag=tag,
    )


def _window(throughput_rps: float, p95_ms: float | None) -> WindowStats:
    return WindowStats(0.0, 1.0, int(throughput_rps), 0, throughput_rps, p95_ms)


# --------------------------------------------------------------------------- percentiles


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], NONE_PERCENTILES),
        ([math.nan, math.inf], NONE_PERCENTILES),
        ([7.0], {"p50": 7.0, "p90": 7.0, "p95": 7.0, "p99": 7.0}),
        (list(range(1, 102)), {"p50": 51.0, "p90": 91.0, "p95": 96.0, "p99": 100.0}),
        ([1.0, math.nan, 3.0], {"p50": 2.0, "p90": 2.8, "p95": 2.9, "p99": 2.98}),
    ],
)
def test_percentiles_ms(values: list[float], expected: dict[str, float | None]) -> None:
    got = percentiles_ms(values)
    assert list(got) == ["p50", "p90", "p95", "p99"]
    for key, value in expected.items():
        assert got[key] == (None if value is None else pytest.approx(value))


def test_percentiles_accept_numpy_arrays() -> None:
    assert percentiles_ms(np.array([2.0, 4.0]))["p50"] == pytest.approx(3.0)


# --------------------------------------------------------------------------- windows


def test_window_stats_assigns_by_completion_and_counts_only_ok_throughput() -> None:
    records = [
        _record(0.10, 50.0),  # ends 0.15: before the window
        _record(0.90, 200.0),  # started before, ends 1.10: inside
        _record(1.20, 10.0),
        _record(1.30, 5.0, ok=False),
        _record(1.95, 100.0),  # ends 2.05: after
    ]
    window = window_stats(records, 1.0, 2.0)
    assert (window.requests, window.errors) == (3, 1)
    assert window.throughput_rps == pytest.approx(2.0)
    assert window.p95_ms == pytest.approx(percentiles_ms([200.0, 10.0])["p95"])


def test_window_with_only_errors_has_no_latency() -> None:
    window = window_stats([_record(0.1, ok=False)], 0.0, 1.0)
    assert window.throughput_rps == 0.0 and window.p95_ms is None
    assert window.to_dict()["p95_ms"] is None


# --------------------------------------------------------------------------- stability


@pytest.mark.parametrize(
    ("windows", "pct", "expected"),
    [
        ([], 10.0, False),
        ([_window(100, 5), _window(100, 5)], 10.0, False),  # fewer than 3
        ([_window(100, 5)] * 3, 10.0, True),
        ([_window(100, 5)] * 3, 0.0, True),  # identical windows pass even at 0 %
        ([_window(90, 5), _window(100, 5), _window(110, 5)], 10.0, True),  # exactly 10 %
        ([_window(89, 5), _window(100, 5), _window(111, 5)], 10.0, False),
        ([_window(100, 4), _window(100, 5), _window(100, 6)], 10.0, False),  # latency
        ([_window(100, 4), _window(100, 5), _window(100, 6)], 25.0, True),
        ([_window(10, 50), _window(100, 5), _window(100, 5), _window(100, 5)], 10.0, True),
        ([_window(100, 5), _window(100, 5), _window(10, 50)], 10.0, False),  # last counts
        ([_window(0, None)] * 3, 10.0, False),  # no data is never stable
        ([_window(100, 5), _window(100, None), _window(100, 5)], 50.0, False),
    ],
)
def test_is_stable(windows: list[WindowStats], pct: float, expected: bool) -> None:
    assert is_stable(windows, pct) is expected


def test_is_stable_with_another_window_count() -> None:
    windows = [_window(100, 5)] * 2
    assert is_stable(windows, 10.0, count=2) and not is_stable(windows, 10.0, count=3)
    assert not is_stable(windows, 10.0, count=0)


# --------------------------------------------------------------------------- summary


def test_summary_counts_only_the_measured_interval() -> None:
    records = [
        _record(0.1, version="1"),  # warm-up
        *(_record(1.0 + i / 10, 10.0 + i, version="1", server=i % 2) for i in range(10)),
        _record(1.5, 30.0, ok=False, server=1),
        *(_record(2.0 + i / 10, 20.0, version="2") for i in range(5)),
        _record(3.5, version="2"),  # drained after the end
    ]
    spec = LoadSpec(concurrency=4)
    report = summarize(
        records,
        measured_from_s=1.0,
        measured_to_s=3.0,
        spec=spec,
        server_names=["a:1", "b:2"],
        windows=[window_stats(records, 1.0, 2.0), window_stats(records, 2.0, 3.0)],
        stable=False,
    )
    assert (report.requests, report.errors) == (16, 1)
    assert report.throughput_rps == pytest.approx(15 / 2.0)
    assert report.duration_s == pytest.approx(2.0)
    assert report.latency_ms["p50"] == pytest.approx(
        float(np.percentile([10.0 + i for i in range(10)] + [20.0] * 5, 50))
    )
    assert set(report.by_version) == {"1", "2"}  # errors carry no version
    assert report.by_version["1"]["requests"] == 10 and report.by_version["2"]["errors"] == 0
    assert report.by_server["b:2"]["errors"] == 1
    assert report.by_server["a:1"]["requests"] + report.by_server["b:2"]["requests"] == 16
    assert report.error_texts == {"UNAVAILABLE: down": 1}
    assert len(report.records) == 18 and len(report.measured_records()) == 16
    assert report.by_arm == {}

    document = report.to_dict()
    assert list(document)[:4] == ["requests", "errors", "throughput_rps", "latency_ms"]
    assert set(document["latency_ms"]) == {"p50", "p90", "p95", "p99"}
    assert document["stable"] is False and document["mode"] == "concurrency"
    assert document["concurrency"] == 4 and document["rate_rps"] is None
    assert "records" not in document and "by_arm" not in document
    assert len(document["windows"]) == 2


def test_summary_of_nothing_is_no_data_not_zero() -> None:
    report = summarize(
        [],
        measured_from_s=1.0,
        measured_to_s=1.0,
        spec=LoadSpec(rate_rps=10.0),
        server_names=["a"],
    )
    assert (report.requests, report.errors, report.throughput_rps) == (0, 0, 0.0)
    assert report.latency_ms == NONE_PERCENTILES
    assert report.to_dict()["mode"] == "rate" and report.to_dict()["rate_rps"] == 10.0


def test_summary_by_arm_in_paired_mode() -> None:
    records = [
        _record(1.0 + i / 10, 10.0, tag="baseline" if i % 2 else "candidate", server=i % 2)
        for i in range(10)
    ]
    report = summarize(
        records,
        measured_from_s=0.0,
        measured_to_s=5.0,
        spec=LoadSpec(concurrency=1),
        server_names=["base", "cand"],
    )
    assert set(report.by_arm) == {"baseline", "candidate"}
    assert report.to_dict()["by_arm"]["baseline"]["requests"] == 5


# --------------------------------------------------------------------------- rows, specs


@pytest.mark.parametrize(
    ("index", "batch", "n_rows", "rows"),
    [(0, 1, 5, [0]), (6, 1, 5, [1]), (1, 3, 5, [3, 4, 0]), (2, 4, 4, [0, 1, 2, 3])],
)
def test_request_rows_cycle_through_the_payload(
    index: int, batch: int, n_rows: int, rows: list[int]
) -> None:
    assert request_rows(index, batch, n_rows) == rows


def test_distinct_requests_is_the_cycle_length() -> None:
    assert distinct_requests(1, 10) == 10
    assert distinct_requests(4, 10) == 5
    assert distinct_requests(3, 10) == 10
    seen = {tuple(request_rows(i, 4, 10)) for i in range(100)}
    assert len(seen) == distinct_requests(4, 10)


def test_check_payload() -> None:
    assert check_payload({"a": np.zeros((3, 2)), "b": np.zeros(3)}) == 3
    for bad in (
        {},
        {"a": np.zeros((3, 2)), "b": np.zeros(4)},
        {"a": np.float32(1.0)},
        {"a": np.zeros((0, 2))},
    ):
        with pytest.raises(UsageError):
            check_payload(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec",
    [
        LoadSpec(),
        LoadSpec(concurrency=1, rate_rps=1.0),
        LoadSpec(concurrency=0),
        LoadSpec(rate_rps=0.0),
        LoadSpec(rate_rps=math.inf),
        LoadSpec(concurrency=1, window_s=0),
        LoadSpec(concurrency=1, duration_s=0),
        LoadSpec(concurrency=1, timeout_s=-1),
        LoadSpec(concurrency=1, protocol="udp"),  # type: ignore[arg-type]
    ],
)
def test_invalid_specs_are_usage_errors(spec: LoadSpec) -> None:
    with pytest.raises(UsageError):
        spec.validate()


@pytest.mark.parametrize(
    ("accepted", "refused", "named"),
    [  # each valid spec at the edge of what validate accepts, and its neighbour over the edge
        (LoadSpec(concurrency=1), LoadSpec(concurrency=0), "concurrency"),
        (LoadSpec(rate_rps=1e-9), LoadSpec(rate_rps=-1e-9), "rate_rps"),
        (LoadSpec(concurrency=16, warmup_s=0.0), LoadSpec(concurrency=16, warmup_s=-1e-9),
         "warmup_s"),
        (LoadSpec(concurrency=16, stability_pct=0.0),
         LoadSpec(concurrency=16, stability_pct=-1e-9), "stability_pct"),
        (LoadSpec(rate_rps=50.0, arrival="poisson", duration_s=1e-9),
         LoadSpec(rate_rps=50.0, arrival="poisson", duration_s=0.0), "duration_s"),
        (LoadSpec(concurrency=1, protocol="http", batch_size=1),
         LoadSpec(concurrency=1, protocol="http", batch_size=0), "batch_size"),
    ],
)
def test_valid_specs(accepted: LoadSpec, refused: LoadSpec, named: str) -> None:
    def refusal(spec: LoadSpec) -> str | None:
        try:
            spec.validate()
        except UsageError as exc:
            return exc.message
        return None

    assert refusal(accepted) is None
    message = refusal(refused)
    assert message is not None and named in message


def test_arrival_gaps() -> None:
    constant = arrival_gaps_s(LoadSpec(rate_rps=200.0), random.Random(0))
    assert constant() == pytest.approx(0.005)
    poisson = arrival_gaps_s(LoadSpec(rate_rps=200.0, arrival="poisson"), random.Random(0))
    gaps = [poisson() for _ in range(20_000)]
    assert np.mean(gaps) == pytest.approx(0.005, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.005, rel=0.05)  # exponential: sd == mean


def test_short_error_is_one_bounded_line() -> None:
    assert short_error("a\n  b\tc") == "a b c"
    long = short_error("x" * 1000)
    assert len(long) == 200 and long.endswith("…")


# --------------------------------------------------------------------------- raw HTTP parsing


def test_http_connection_cuts_answers_at_content_length_and_decodes_chunks() -> None:
    async def scenario() -> list[tuple[int, bytes]]:
        conn = HttpConnection()
        got = []
        loop = asyncio.get_running_loop()
        for wire in (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nInference-Header-Content-Length: 2\r\n"
            b"\r\nab", b"cde",  # split across reads
            b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
            b"2\r\nde\r\n0\r\n\r\n",
        ):
            if conn._waiter is None:
                conn._waiter = loop.create_future()
                conn._need = -1
            waiter = conn._waiter
            conn.data_received(wire)
            if waiter.done():
                status, _, body = waiter.result()
                got.append((status, body))
        return got

    assert asyncio.run(scenario()) == [(200, b"abcde"), (400, b"abcde")]


def test_http_helpers() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close"
    assert header_value(head, b"content-length") == b"12"
    assert header_value(head, b"connection") == b"close"
    assert header_value(head, b"missing") is None
    assert model_version(b'{"model_name":"m","model_version":"7","outputs":[]}') == "7"
    assert model_version(b'{"model_name":"m"}') == ""
    assert http_address("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert http_address("http://localhost:9/") == ("localhost", 9)
