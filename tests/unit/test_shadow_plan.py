"""The shadow canary's pure parts (tasks/shadow_plan.py) and the gateway's sample log
(modelship/nginx.py): the window's stop rules, the rules a shadow judges, Triton's
counters per arm and per interval, the sampled bodies."""

from __future__ import annotations

import pytest

from modelship import nginx
from modelship.errors import UsageError
from modelship.policy import CanaryPolicy, ServerRatioRule, gate_rule
from modelship.split_scope import SplitScope
from modelship.traffic.port import TrafficSplit
from modelship.triton.metrics import parse_metrics
from tasks.shadow_plan import (
    MIN_INTERVALS,
    ArmTotals,
    ShadowPlan,
    arm_totals,
    infer_target,
    parse_samples,
    pick,
    shadow_intervals,
    shadow_rules,
    versioned_uri,
    window_action,
)

PLAN = ShadowPlan(mirror_pct=10.0, min_s=5.0, max_s=30.0, min_samples=100)
MIRRORING = TrafficSplit(mirror_pct=10.0)


def test_the_plan_comes_from_the_policy_and_only_under_shadow() -> None:
    plan = ShadowPlan.from_policy(CanaryPolicy(traffic="shadow", mirror_pct=25.0,
                                               window_s=3.0, max_duration_s=20.0,
                                               min_samples=50))
    assert plan == ShadowPlan(25.0, 3.0, 20.0, 50)
    assert plan.split == TrafficSplit(canary_pct=0.0, mirror_pct=25.0)
    assert ShadowPlan.from_policy(CanaryPolicy(traffic="shadow")).mirror_pct == 10.0
    with pytest.raises(UsageError, match="not shadow"):
        ShadowPlan.from_policy(CanaryPolicy())


@pytest.mark.parametrize(("elapsed", "mirrored", "sampled", "live", "kind", "words"), [
    (1.0, 500, 500, MIRRORING, "hold", "500 mirrored"),          # younger than min_s
    (6.0, 99, 500, MIRRORING, "hold", "99 mirrored"),             # too few answered
    (6.0, 500, 99, MIRRORING, "hold", "99 bodies"),               # too few sampled
    (6.0, 100, 100, MIRRORING, "end", "enough"),                  # exactly enough
    (30.0, 3, 0, MIRRORING, "end", "ceiling"),                    # the ceiling: judge it
    (6.0, 500, 500, None, "abort", "did not answer"),             # a dead router
    (6.0, 500, 500, TrafficSplit(), "abort", "stuck"),            # the mirror went away
    (6.0, 500, 500, TrafficSplit(canary_pct=5.0, mirror_pct=10.0), "abort", "stuck"),
])
def test_the_window_holds_ends_or_aborts(elapsed: float, mirrored: int, sampled: int,
                                         live: TrafficSplit | None, kind: str,
                                         words: str) -> None:
    action = window_action(PLAN, elapsed_s=elapsed, mirrored=mirrored, sampled=sampled,
                           live=live, problem="connection refused" if live is None else None)
    assert action.kind == kind and words in action.reason
    if kind == "abort":
        assert "infrastructure" in action.reason
    if live is None:
        assert "connection refused" in action.reason


def test_the_window_waits_for_enough_metrics_intervals_for_the_server_side_test() -> None:
    from tasks.gates import MIN_SERVER_INTERVALS

    assert MIN_INTERVALS >= MIN_SERVER_INTERVALS
    short = window_action(PLAN, elapsed_s=6.0, mirrored=500, sampled=500, live=MIRRORING,
                          intervals=MIN_INTERVALS - 1)
    assert short.kind == "hold" and f"{MIN_INTERVALS - 1} metrics intervals" in short.reason
    assert window_action(PLAN, elapsed_s=6.0, mirrored=500, sampled=500, live=MIRRORING,
                         intervals=MIN_INTERVALS).kind == "end"


def test_client_latency_rules_become_server_side_and_the_rest_are_skipped() -> None:
    rules = [gate_rule(name="p99", metric="latency_p99_ms", test="quantile",
                       max_increase_pct=20.0, alpha=0.02),
             gate_rule(name="typical", metric="latency_p50_ms", max_increase_pct=10.0),
             gate_rule(name="abs", metric="latency_p99_ms", max=50.0),
             gate_rule(name="tput", metric="throughput_ratio", min=0.9),
             gate_rule(name="errors", metric="error_rate", max_rate=0.01),
             gate_rule(name="agree", metric="agreement", min=0.98)]
    judged, skipped = shadow_rules(rules)
    assert [(r.name, r.metric) for r in judged] == [
        ("p99 (server)", "server_latency_ratio"), ("typical (server)", "server_latency_ratio"),
        ("errors", "error_rate"), ("agree", "agreement")]
    assert isinstance(judged[0], ServerRatioRule)
    assert judged[0].max_increase_pct == 20.0 and judged[0].alpha == 0.02
    assert [s.split(":")[0] for s in skipped] == ["p99", "typical", "abs", "tput"]
    # a policy with its own server-side rule keeps it, and the client ones are skipped
    own = gate_rule(name="server", metric="server_latency_ratio", max_increase_pct=5.0)
    judged, skipped = shadow_rules([rules[0], own])
    assert [r.name for r in judged] == ["server"] and skipped[0].startswith("p99:")


def _scrape(success: float, failure: float, queue: float, infer: float, *,
            version: str = "2", model: str = "m") -> dict:
    labels = f'model="{model}",version="{version}"'
    return parse_metrics(
        f"nv_inference_request_success{{{labels}}} {success}\n"
        f'nv_inference_request_failure{{{labels},reason="BACKEND"}} {failure}\n'
        f"nv_inference_queue_duration_us{{{labels}}} {queue}\n"
        f"nv_inference_compute_infer_duration_us{{{labels}}} {infer}\n")


def _tick(canary: tuple[float, ...] | None, *replicas: tuple[float, ...] | None) -> dict:
    tick = {"canary": None if canary is None else _scrape(*canary, version="2")}
    for i, replica in enumerate(replicas):
        tick[f"triton-{i}"] = None if replica is None else _scrape(*replica, version="1")
    return tick


def test_arm_totals_sum_the_replicas_and_never_turn_missing_data_into_zero() -> None:
    first = _tick((0, 0, 0, 0), (10, 0, 100, 1000), (5, 1, 50, 500))
    last = _tick((40, 2, 400, 8000), (60, 1, 600, 6000), (45, 1, 450, 4500))
    cand, prod = arm_totals(first, last, model="m", candidate=2, baseline=1)
    assert cand == ArmTotals(requests=42, failures=2, us=8400.0, queue_us=400.0)
    assert prod == ArmTotals(requests=91, failures=1, us=9900.0, queue_us=900.0)
    assert cand.mean_us() == 210.0 and cand.mean_us("queue") == 10.0
    assert prod.to_dict()["compute_us_mean"] == 9000.0 / 90
    # a replica not scraped, or a candidate that vanished: no figures for that arm
    assert arm_totals(first, _tick((40, 2, 400, 8000), None, (45, 1, 450, 4500)),
                      model="m", candidate=2, baseline=1)[1] is None
    assert arm_totals(first, last, model="m", candidate=3, baseline=1)[0] is None
    assert ArmTotals(0, 0, 0.0, 0.0).mean_us() is None


def test_intervals_pair_the_same_seconds_and_drop_an_interval_with_a_missed_scrape() -> None:
    ticks = [_tick((0, 0, 0, 0), (0, 0, 0, 0)),
             _tick((10, 0, 0, 1000), (100, 0, 0, 5000)),
             _tick((20, 0, 0, 2000), None),                 # the replica was not read
             _tick((30, 0, 0, 3000), (300, 0, 0, 15000))]
    intervals = shadow_intervals(ticks, model="m", candidate=2, baseline=1)
    assert intervals == [{"candidate": {"us": 1000.0, "n": 10.0},
                          "baseline": {"us": 5000.0, "n": 100.0}}]


def _line(uri: str, body: bytes, header_length: str = "", status: str = "200") -> bytes:
    """A sample log line as nginx writes it with escape=json: bytes >= 0x80 raw, control
    bytes as \\u00XX."""
    escaped = bytearray()
    for byte in body:
        if byte in (0x22, 0x5C):
            escaped += b"\\" + bytes([byte])
        elif byte < 0x20:
            escaped += f"\\u{byte:04x}".encode()
        else:
            escaped.append(byte)
    return (b'{"msec":"1.0","uri":"' + uri.encode() + b'","content_type":'
            b'"application/octet-stream","header_length":"' + header_length.encode()
            + b'","status":"' + status.encode() + b'","body":"' + bytes(escaped) + b'"}')


def test_sampled_bodies_come_back_byte_for_byte_and_others_are_counted() -> None:
    binary = b'{"inputs":[]}' + bytes(range(256))
    lines = [_line("/v2/models/m/infer", binary, "13"),
             _line("/v2/models/m/versions/1/infer", b'{"inputs":[{"data":[1]}]}'),
             _line("/v2/models/other/infer", b"x"),
             _line("/v2/models/m/ready", b""),
             _line("/v2/models/m/infer", b""),
             b"not json", b""]
    found = parse_samples(lines, "m")
    assert [r.body for r in found.requests] == [binary, b'{"inputs":[{"data":[1]}]}']
    assert found.requests[0].header_length == 13 and found.requests[1].header_length is None
    assert found.requests[0].headers() == {"Content-Type": "application/octet-stream",
                                           "Inference-Header-Content-Length": "13"}
    assert dict(found.left_out) == {
        "other model": 1, "not an inference": 1, "unreadable line": 1,
        "body not in memory (larger than the gateway's buffer)": 1}


@pytest.mark.parametrize(("uri", "target"), [
    ("/v2/models/m/infer", ("m", None)), ("/v2/models/m/versions/3/infer", ("m", "3")),
    ("/v2/models/m/infer?x=1", ("m", None)), ("/v2/models/m", None), ("/v2/health/ready", None),
])
def test_inference_paths(uri: str, target: tuple[str, str | None] | None) -> None:
    assert infer_target(uri) == target
    assert infer_target(versioned_uri("m", 7)) == ("m", "7")


def test_pick_spreads_over_the_window() -> None:
    assert pick(list(range(10)), 5) == [0, 2, 4, 6, 8]
    assert pick([1, 2], 5) == [1, 2] and pick([1, 2], 0) == []


LAYOUT = nginx.GatewayLayout(http_port=1, grpc_port=2, admin_port=3,
                             production=(("127.0.0.1:10", "127.0.0.1:11"),),
                             canary=("127.0.0.1:12", "127.0.0.1:13"), prefix="/p",
                             error_log="/p/error.log")


@pytest.mark.parametrize(("mirror", "logged"), [
    (0.0, None), (25.0, " if=$modelship_mirror;"), (100.0, ";")])
def test_the_gateway_logs_the_mirrored_bodies_only_while_it_mirrors(
        mirror: float, logged: str | None) -> None:
    text = nginx.render_config(LAYOUT, 0.0, mirror, "g")
    line = f"access_log /p/{nginx.SAMPLE_LOG} modelship_sample"
    if logged is None:
        assert line not in text
        return
    http, grpc = text.split("KServe gRPC")
    assert line + logged in http and line + logged in grpc  # HTTP and gRPC bodies
    # a scope without gRPC: gRPC is neither mirrored nor logged
    scoped = nginx.render_config(LAYOUT, 0.0, mirror, "g", SplitScope("m"))
    assert line not in scoped.split("KServe gRPC")[1].split("admin")[0]
    # the one chooser decides both the copy and the log: they are the same requests
    assert text.count("split_clients") == (1 if mirror < 100 else 0)
    assert "log_format modelship_sample escape=json" in text
