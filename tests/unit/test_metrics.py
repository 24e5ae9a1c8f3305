"""Triton metrics: parsing recorded expositions, differences across resets and vanishing
series, and the per-request means the canary reports (pure; no server)."""

from __future__ import annotations

import math

import pytest

from modelship.triton.metrics import (
    COMPUTE_INFER_US,
    FAILURE,
    INFERENCE_COUNT,
    QUEUE_US,
    SUCCESS,
    VersionDelta,
    VersionMetrics,
    delta,
    mean_batch_size,
    mean_compute_us,
    mean_per_request_us,
    mean_queue_us,
    parse_metrics,
    parse_text,
)

# Recorded from the embedded canary tritonserver 2.51 (summary_latencies=true), model
# "probe" loaded with version_policy specific [1, 2], before any request (trimmed).
BEFORE = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="probe",version="2"} 0
nv_inference_request_success{model="probe",version="1"} 0
nv_inference_request_success{model="_trial_probe_v2_fdd6455b",version="1"} 1
nv_inference_request_failure{model="probe",reason="OTHER",version="2"} 0
nv_inference_request_failure{model="_trial_probe_v2_fdd6455b",reason="OTHER",version="1"} 0
nv_inference_request_failure{model="probe",reason="OTHER",version="1"} 0
nv_inference_count{model="probe",version="2"} 0
nv_inference_count{model="probe",version="1"} 0
nv_inference_count{model="_trial_probe_v2_fdd6455b",version="1"} 16
nv_inference_exec_count{model="probe",version="2"} 0
nv_inference_exec_count{model="probe",version="1"} 0
nv_inference_exec_count{model="_trial_probe_v2_fdd6455b",version="1"} 1
nv_inference_queue_duration_us{model="probe",version="2"} 0
nv_inference_queue_duration_us{model="probe",version="1"} 0
nv_inference_queue_duration_us{model="_trial_probe_v2_fdd6455b",version="1"} 256
nv_inference_compute_input_duration_us{model="probe",version="2"} 0
nv_inference_compute_input_duration_us{model="probe",version="1"} 0
nv_inference_compute_infer_duration_us{model="probe",version="2"} 0
nv_inference_compute_infer_duration_us{model="probe",version="1"} 0
nv_inference_compute_infer_duration_us{model="_trial_probe_v2_fdd6455b",version="1"} 18992
nv_inference_compute_output_duration_us{model="probe",version="2"} 0
nv_inference_compute_output_duration_us{model="probe",version="1"} 0
nv_inference_queue_summary_us{model="probe",version="2",quantile="0.5"} Nan
nv_inference_queue_summary_us{model="probe",version="1",quantile="0.5"} Nan
nv_inference_queue_summary_us{model="_trial_probe_v2_fdd6455b",version="1",quantile="0.5"} 256
nv_cpu_utilization 0.55
"""

# The same server after ~1.8k gRPC requests to each of /versions/1 and /versions/2
# (trimmed; the trial model's other series had vanished, one failure series stayed).
AFTER = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
# TYPE nv_inference_queue_summary_us summary
nv_inference_request_success{model="probe",version="2"} 1861
nv_inference_request_success{model="probe",version="1"} 1832
nv_inference_request_failure{model="probe",reason="OTHER",version="2"} 0
nv_inference_request_failure{model="probe",reason="BACKEND",version="2"} 0
nv_inference_request_failure{model="probe",reason="REJECTED",version="1"} 0
nv_inference_request_failure{model="probe",reason="BACKEND",version="1"} 0
nv_inference_request_failure{model="probe",reason="REJECTED",version="2"} 0
nv_inference_request_failure{model="probe",reason="CANCELED",version="1"} 0
nv_inference_request_failure{model="probe",reason="CANCELED",version="2"} 0
nv_inference_request_failure{model="probe",reason="OTHER",version="1"} 0
nv_inference_count{model="probe",version="2"} 1861
nv_inference_count{model="probe",version="1"} 1832
nv_inference_exec_count{model="probe",version="2"} 1508
nv_inference_exec_count{model="probe",version="1"} 1298
nv_inference_request_duration_us{model="probe",version="2"} 1309932
nv_inference_request_duration_us{model="probe",version="1"} 1128388
nv_inference_queue_duration_us{model="probe",version="2"} 512183
nv_inference_queue_duration_us{model="probe",version="1"} 409998
nv_inference_compute_input_duration_us{model="probe",version="2"} 29465
nv_inference_compute_input_duration_us{model="probe",version="1"} 31237
nv_inference_compute_infer_duration_us{model="probe",version="2"} 367588
nv_inference_compute_infer_duration_us{model="probe",version="1"} 391484
nv_inference_compute_output_duration_us{model="probe",version="2"} 394745
nv_inference_compute_output_duration_us{model="probe",version="1"} 289653
nv_inference_pending_request_count{model="probe",version="2"} 0
nv_inference_pending_request_count{model="probe",version="1"} 0
nv_inference_queue_summary_us_count{model="probe",version="2"} 1861
nv_inference_queue_summary_us_sum{model="probe",version="2"} 512183
nv_inference_queue_summary_us{model="probe",version="2",quantile="0.5"} 197
nv_inference_queue_summary_us{model="probe",version="2",quantile="0.95"} 598
nv_inference_queue_summary_us{model="probe",version="2",quantile="0.99"} 699
nv_inference_queue_summary_us_count{model="probe",version="1"} 1832
nv_inference_queue_summary_us_sum{model="probe",version="1"} 409998
nv_inference_queue_summary_us{model="probe",version="1",quantile="0.5"} 192
nv_inference_queue_summary_us{model="probe",version="1",quantile="0.95"} 386
nv_inference_queue_summary_us{model="probe",version="1",quantile="0.99"} 974
nv_inference_compute_infer_summary_us_count{model="probe",version="2"} 1861
nv_inference_compute_infer_summary_us_sum{model="probe",version="2"} 367588
nv_inference_compute_infer_summary_us{model="probe",version="2",quantile="0.5"} 162
nv_inference_compute_infer_summary_us{model="probe",version="2",quantile="0.95"} 373
nv_inference_compute_infer_summary_us{model="probe",version="2",quantile="0.99"} 454
nv_inference_compute_infer_summary_us_count{model="probe",version="1"} 1832
nv_inference_compute_infer_summary_us_sum{model="probe",version="1"} 391484
nv_inference_compute_infer_summary_us{model="probe",version="1",quantile="0.5"} 164
nv_inference_compute_infer_summary_us{model="probe",version="1",quantile="0.95"} 306
nv_inference_compute_infer_summary_us{model="probe",version="1",quantile="0.99"} 549
nv_inference_request_failure{model="_trial_probe_v1_59335d94",reason="OTHER",version="1"} 0
nv_cpu_utilization 0.8238341968911918
"""

# The exposition's shape after a swap to [2] and a reload: v1's series vanished, v2's
# counters restarted from 0 (values made up, lines in Triton's format).
RELOADED = """\
nv_inference_request_success{model="probe",version="2"} 40
nv_inference_request_failure{model="probe",reason="OTHER",version="2"} 1
nv_inference_request_failure{model="probe",reason="BACKEND",version="2"} 2
nv_inference_count{model="probe",version="2"} 40
nv_inference_exec_count{model="probe",version="2"} 20
nv_inference_queue_duration_us{model="probe",version="2"} 4000
nv_inference_compute_input_duration_us{model="probe",version="2"} 400
nv_inference_compute_infer_duration_us{model="probe",version="2"} 8000
nv_inference_compute_output_duration_us{model="probe",version="2"} 800
"""


def test_parse_keeps_per_version_counters_and_skips_server_gauges() -> None:
    scraped = parse_metrics(AFTER)
    assert set(scraped) == {("probe", "1"), ("probe", "2"), ("_trial_probe_v1_59335d94", "1")}
    v2 = scraped[("probe", "2")]
    assert v2.counters[SUCCESS] == 1861
    assert v2.counters[QUEUE_US] == 512183
    assert v2.counters[FAILURE] == 0  # summed over reason
    assert "nv_inference_pending_request_count" not in v2.counters  # a gauge
    assert v2.quantiles_us["nv_inference_queue_summary_us"] == {"0.5": 197, "0.95": 598,
                                                                "0.99": 699}
    # Only the failure series survived for the unloaded trial model.
    assert scraped[("_trial_probe_v1_59335d94", "1")].counters == {FAILURE: 0}


def test_parse_drops_nan_quantiles_of_empty_summaries() -> None:
    scraped = parse_metrics(BEFORE)
    assert scraped[("probe", "1")].quantiles_us == {}
    assert scraped[("_trial_probe_v2_fdd6455b", "1")].quantiles_us == {
        "nv_inference_queue_summary_us": {"0.5": 256}}


def test_failures_are_summed_over_reasons() -> None:
    scraped = parse_metrics(RELOADED)
    assert scraped[("probe", "2")].counters[FAILURE] == 3


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('m{model="a",version="1"} 5', ("m", {"model": "a", "version": "1"}, 5.0)),
        ('m{model="a\\"b",version="1"} 1e3', ("m", {"model": 'a"b', "version": "1"}, 1000.0)),
        ("m 7 1712345678000", ("m", {}, 7.0)),
        ('m{model="a", version="1",} +Inf', ("m", {"model": "a", "version": "1"}, math.inf)),
    ],
)
def test_parse_text_lines(line: str, expected: tuple[str, dict[str, str], float]) -> None:
    [sample] = list(parse_text(line))
    assert (sample.name, sample.labels, sample.value) == expected


@pytest.mark.parametrize("line", ["# TYPE m counter", "", "garbage", 'm{model="a"} not-a-number'])
def test_parse_text_skips_comments_and_malformed_lines(line: str) -> None:
    assert list(parse_text(line)) == []


def test_delta_between_recorded_scrapes_gives_per_request_means() -> None:
    changes = delta(parse_metrics(BEFORE), parse_metrics(AFTER))
    v1, v2 = changes[("probe", "1")], changes[("probe", "2")]
    assert v1 is not None and v2 is not None
    assert v1.requests == 1832 and v2.requests == 1861
    assert not v1.resets and not v1.new
    assert mean_queue_us(v2) == pytest.approx(512183 / 1861)
    assert mean_compute_us(v2) == pytest.approx((29465 + 367588 + 394745) / 1861)
    assert mean_per_request_us(v1, COMPUTE_INFER_US) == pytest.approx(391484 / 1832)
    assert mean_batch_size(v2) == pytest.approx(1861 / 1508)
    # The trial model v2 vanished between the scrapes: reported as None, never as 0.
    assert changes[("_trial_probe_v2_fdd6455b", "1")] is None
    # A series that appeared between the scrapes counts from 0.
    trial_v1 = changes[("_trial_probe_v1_59335d94", "1")]
    assert trial_v1 is not None and trial_v1.new


def test_delta_handles_a_reset_and_a_vanished_version() -> None:
    changes = delta(parse_metrics(AFTER), parse_metrics(RELOADED))
    assert changes[("probe", "1")] is None
    v2 = changes[("probe", "2")]
    assert v2 is not None
    # Every counter of v2 went down: a restart, so the after value is the delta.
    assert v2.requests == 40
    assert v2.failures == 3
    assert SUCCESS in v2.resets and QUEUE_US in v2.resets
    assert FAILURE not in v2.resets  # 0 -> 3 went up
    assert mean_queue_us(v2) == pytest.approx(100.0)
    assert mean_compute_us(v2) == pytest.approx(230.0)
    assert mean_batch_size(v2) == pytest.approx(2.0)
    assert v2.to_dict()["queue_us_mean"] == pytest.approx(100.0)


@pytest.mark.parametrize(
    "change",
    [
        None,
        VersionDelta(counters={}),
        VersionDelta(counters={SUCCESS: 0.0, QUEUE_US: 10.0}),
        VersionDelta(counters={SUCCESS: 5.0}),
    ],
)
def test_means_are_none_without_data(change: VersionDelta | None) -> None:
    assert mean_queue_us(change) is None
    assert mean_compute_us(change) is None
    assert mean_batch_size(change) is None


def test_delta_of_identical_scrapes_is_zero() -> None:
    scraped = {("m", "1"): VersionMetrics(counters={SUCCESS: 10.0, QUEUE_US: 50.0})}
    change = delta(scraped, scraped)[("m", "1")]
    assert change is not None
    assert change.counters == {SUCCESS: 0.0, QUEUE_US: 0.0}
    assert mean_queue_us(change) is None  # zero requests is no data


TYPED = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="3"} 42
# HELP nv_inference_queue_duration_us Cumulative inference queuing duration
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="m",version="3"} 840
# TYPE nv_inference_request_duration_us counter
nv_inference_request_duration_us{model="m",version="3"} 4200
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="m",version="3"} 0
"""


def test_counters_keep_tritons_names_through_the_reference_parser() -> None:
    """prometheus_client names a counter's samples ``x_total``; Triton's are ``x``."""
    names = {s.name for s in parse_text(TYPED)}
    assert "nv_inference_request_success" in names
    assert not any(n.endswith("_total") for n in names)
    scraped = parse_metrics(TYPED)[("m", "3")]
    assert scraped.counters[SUCCESS] == 42 and scraped.counters[QUEUE_US] == 840


def test_one_malformed_line_does_not_hide_the_others() -> None:
    text = TYPED + 'nv_inference_count{model="m",version="3"} not-a-number\n'
    scraped = parse_metrics(text)[("m", "3")]
    assert scraped.counters[SUCCESS] == 42  # still a counter, still without _total
    assert INFERENCE_COUNT not in scraped.counters


def test_request_duration_mean_is_reported_for_the_client_overhead() -> None:
    before = parse_metrics(TYPED)
    after = parse_metrics(TYPED.replace("} 42", "} 52").replace("} 4200", "} 5200"))
    change = delta(before, after)[("m", "3")]
    assert change is not None
    assert change.to_dict()["request_us_mean"] == pytest.approx(100.0)
