"""The bake's rules, part by part (tasks/bake.py): block statistics, the look schedule, the
load match, the two-sample batch-means test, the error e-process, the verdicts (held
included), the dry-run plan and the load figures of each window. Pure, table-tested.

The seeded calibration (false rollbacks and power) is in tests/unit/test_bake_traffic.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from modelship.cli.release import render_record
from modelship.policy import BakePolicy
from modelship.triton.metrics import PENDING, REQUEST_US, delta, load_of, parse_metrics
from tasks.bake import (
    ERROR_BETS,
    BakeReport,
    Reference,
    Window,
    as_reference,
    block_stats,
    effective_tolerance_pct,
    error_log_e,
    error_log_e_path,
    fleet_load,
    judge_windows,
    latency_over,
    load_departure,
    look_plan,
    margin_log,
    plan,
    total_windows,
    two_sample,
)

POLICY = BakePolicy(duration_s=60, window_s=2, baseline_s=30, probe_rps=80,
                    max_error_rate=0.01, alpha=0.05, max_latency_increase_pct=25,
                    min_latency_effect_us=0, latency_quantiles=[0.5, 0.9])


def _lat(rng: np.random.Generator, n: int, scale: float = 1.0) -> tuple[float, ...]:
    """Lognormal probe latencies around 2 ms (σ = 0.3, a CPU model's spread), in ms."""
    return tuple(float(x) for x in scale * 2.0 * rng.lognormal(0.0, 0.3, size=n))


def _window(i: int, latencies: tuple[float, ...], *, rate: float | None = 80.0,
            errors: int = 0, requests: int | None = None) -> Window:
    return Window(index=i, seconds=2, requests=len(latencies) if requests is None
                  else requests, errors=errors, server_us=1000.0, latencies_ms=latencies,
                  rate_rps=rate)


def _reference(rng: np.random.Generator, blocks: int = 15, rate: float = 80.0) -> Reference:
    return Reference(tuple(_window(-blocks + i, _lat(rng, 160), rate=rate)
                           for i in range(blocks)))


# ------------------------------------------------------------------------- block stats


@pytest.mark.parametrize(("values", "expected"), [
    ((), [None, None]),
    ((1.0,) * 9, [None, None]),                        # fewer than 10 answered probes
    ((1.0,) * 9 + (float("nan"),), [None, None]),      # NaN is not a latency
    (tuple(float(x) for x in range(1, 11)), [math.log(5.5), math.log(9.1)]),
    ((2.0,) * 10, [math.log(2.0), math.log(2.0)]),
])
def test_block_stats_are_log_quantiles_of_the_window(values: tuple[float, ...],
                                                     expected: list[float | None]) -> None:
    got = block_stats(_window(0, values), [0.5, 0.9])
    assert got == pytest.approx(expected) if expected[0] is not None else got == expected


def test_block_stats_match_numpy_quantiles() -> None:
    values = _lat(np.random.default_rng(0), 37)
    got = block_stats(_window(0, values), [0.5, 0.9, 0.99])
    assert np.exp(got) == pytest.approx(np.quantile(values, [0.5, 0.9, 0.99]))


# ------------------------------------------------------------------------------ looks


@pytest.mark.parametrize(("windows", "points"), [
    (0, []), (1, []), (2, []), (3, [2]), (5, [2, 4]), (60, [2, 4, 8, 16, 32]),
    (1800, [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]),
])
def test_look_plan_spends_alpha_once(windows: int, points: list[int]) -> None:
    looks, final = look_plan(windows, 0.01)
    assert sorted(looks) == points
    assert sum(looks.values()) + final == pytest.approx(0.01)
    assert final == pytest.approx(0.005 if points else 0.01)


@pytest.mark.parametrize(("duration", "window", "count"), [(0, 2, 0), (10, 2, 5), (11, 2, 6),
                                                            (120, 2, 60)])
def test_total_windows(duration: float, window: float, count: int) -> None:
    assert total_windows(BakePolicy(duration_s=duration, window_s=window)) == count


# --------------------------------------------------------------------------- load match


@pytest.mark.parametrize(("rate", "held_says"), [
    (80.0, None), (95.9, None), (66.7, None),           # inside ±20%
    (96.1, "×1.20"), (800.0, "×10.00"), (60.0, "×0.75"),
    (None, "no request rate"),
])
def test_load_departure_holds_outside_the_band(rate: float | None,
                                               held_says: str | None) -> None:
    reference = Reference(tuple(_window(-1, (), rate=80.0, requests=160) for _ in range(2)))
    window = Window(index=3, seconds=2, requests=0, errors=0, server_us=None, rate_rps=rate)
    why = load_departure(window, reference, BakePolicy(load_tolerance_pct=20))
    assert why is None if held_says is None else (why is not None and held_says in why)
    assert load_departure(window, Reference(reference.windows, kind="holdback"),
                          BakePolicy()) is None  # a concurrent control covers any load


def test_rate_falls_back_to_the_windows_own_requests() -> None:
    bare = Window(index=0, seconds=2, requests=150, errors=10, server_us=None)
    assert bare.load_rps == 80.0
    assert Window(index=0, seconds=2, requests=0, errors=0, server_us=None).load_rps is None
    mixed = Reference((_window(-2, (), rate=40.0, requests=1),
                       Window(index=-1, seconds=6, requests=1, errors=0, server_us=None,
                              rate_rps=80.0)))
    assert mixed.rate_rps == pytest.approx(70.0)  # time-weighted


# ------------------------------------------------------------------------ two-sample


def test_two_sample_needs_two_blocks_before_and_one_after() -> None:
    assert two_sample(np.asarray([0.1]), np.asarray([0.2, 0.3])) is None
    assert two_sample(np.asarray([0.1, 0.2]), np.asarray([])) is None
    test = two_sample(np.asarray([0.0, 0.2, 0.1, 0.1]), np.asarray([0.5, 0.7]))
    assert test is not None and test.diff == pytest.approx(0.5) and test.df == 4
    assert test.p_value(0.5) == pytest.approx(0.5)          # at the margin: p = ½
    assert test.p_value(0.0) < 0.05 < test.p_value(0.4)
    assert test.upper(0.05) > test.diff


def test_two_sample_inflates_for_dependent_blocks() -> None:
    """Blocks that drift (dependence outlasting a block) widen the interval: the measured
    variance inflation, not the plain one."""
    rng = np.random.default_rng(4)
    drift = np.cumsum(rng.normal(0, 0.05, 40))
    iid = rng.normal(0, np.std(drift), 40)
    dep = two_sample(drift[:20], drift[20:])
    ind = two_sample(iid[:20], iid[20:])
    assert dep is not None and ind is not None
    assert dep.lag1 > 0.5 and dep.block_sd > 1.5 * np.std(np.concatenate(
        [drift[:20] - drift[:20].mean(), drift[20:] - drift[20:].mean()]))


@pytest.mark.parametrize(("pct", "floor_us", "ref_ms", "ratio"), [
    (25, 0, 2.0, 1.25), (25, 300, 2.0, 1.25), (10, 5000, 10.0, 1.5), (10, 300, 0.0, 1.1),
])
def test_margin_is_the_tolerance_or_the_noise_floor(pct: float, floor_us: float,
                                                    ref_ms: float, ratio: float) -> None:
    policy = BakePolicy(max_latency_increase_pct=pct, min_latency_effect_us=floor_us)
    assert math.exp(margin_log(policy, ref_ms)) == pytest.approx(ratio)


def test_effective_tolerance_shrinks_with_the_reference_and_the_bake() -> None:
    base = BakePolicy(duration_s=120)
    value = effective_tolerance_pct(base)
    assert 25.0 < value < 30.0  # the default reference keeps +30% catchable
    assert effective_tolerance_pct(base.model_copy(update={"baseline_s": 4,
                                                           "probe_rps": 40})) > 40.0
    assert effective_tolerance_pct(base.model_copy(update={"duration_s": 3600})) < value
    assert effective_tolerance_pct(base, block_sd=0.0) == pytest.approx(25.0)


def test_plan_prints_the_effective_tolerance_and_the_looks() -> None:
    shown = plan(BakePolicy(duration_s=120))
    assert shown["windows"] == 60 and shown["latency_looks"]["judged_windows"] == [2, 4, 8,
                                                                                   16, 32]
    assert 25.0 < shown["effective_tolerance_pct"] < 30.0
    assert "caught with probability 0.9" in shown["effective_tolerance"]
    assert plan(BakePolicy(duration_s=0))["effective_tolerance_pct"] is None
    assert plan(BakePolicy(latency_quantiles=[]))["effective_tolerance"] is None


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("fractions", "budget", "crosses"), [
    ([], 0.01, False),
    ([0.0] * 50, 0.01, False),
    ([0.5], 0.001, True),              # one window: proof only far beyond the budget
    ([0.05], 0.01, False),
    ([0.107] * 2, 0.01, False),
    ([0.107] * 3, 0.01, True),
    ([0.01] * 500, 0.01, False),        # exactly at the budget, however long
    ([0.0, 0.0, 1 / 160], 0.0, True),   # no budget: the first failure
])
def test_error_e_process_table(fractions: list[float], budget: float,
                               crosses: bool) -> None:
    log_e = error_log_e(np.asarray(fractions), budget)
    assert (log_e >= math.log(100)) is crosses
    path = error_log_e_path(np.asarray(fractions), budget)
    assert path.size == len(fractions) and (not path.size or path[-1] == log_e)


def test_error_e_process_is_a_mixture_of_bets() -> None:
    x, b = np.asarray([0.02, 0.0, 0.03]), 0.01
    each = [np.prod(1 + (bet / b) * (x - b)) for bet in ERROR_BETS]
    assert math.exp(error_log_e(x, b)) == pytest.approx(np.mean(each))


# --------------------------------------------------------------------------- verdicts


def test_a_regression_at_matched_load_names_the_rule_ratio_and_load() -> None:
    rng = np.random.default_rng(1)
    reference = _reference(rng)
    windows = [_window(i, _lat(rng, 160, 2.0)) for i in range(2)]
    verdict = judge_windows(windows, reference, POLICY)
    assert verdict.outcome == "breach"
    assert "latency_p50" in verdict.reason and "matched load" in verdict.reason
    assert "×1.25" in verdict.reason and "80.0 req/s" in verdict.reason
    assert verdict.latency["rules"][0]["ratio"] == pytest.approx(2.0, rel=0.1)
    assert verdict.latency["rules"][0]["lag1_high"] is False  # independent windows


def test_a_surge_holds_latency_for_the_whole_bake_and_the_release_may_complete() -> None:
    rng = np.random.default_rng(2)
    reference = _reference(rng)
    surge = [_window(i, _lat(rng, 160, 3.0), rate=800.0) for i in range(30)]
    verdict = judge_windows(surge, reference, POLICY)
    assert verdict.outcome == "held"
    assert "latency held in every window" in verdict.reason and "×10.00" in verdict.reason
    assert verdict.latency["status"] == "held" and verdict.latency["judged"] == 0
    assert set(verdict.latency["held"]) == {str(i) for i in range(30)}
    assert latency_over(surge, reference, POLICY) is None


def test_errors_are_judged_while_latency_holds() -> None:
    rng = np.random.default_rng(3)
    reference = _reference(rng)
    bad = [_window(i, _lat(rng, 160), rate=800.0, errors=40) for i in range(3)]
    verdict = judge_windows(bad, reference, POLICY)
    assert verdict.outcome == "breach" and "error rate" in verdict.reason
    assert verdict.errors["failed"] == 120


def test_some_windows_held_the_rest_judged() -> None:
    rng = np.random.default_rng(5)
    reference = _reference(rng)
    windows = [_window(i, _lat(rng, 160), rate=800.0 if i % 3 == 0 else 82.0)
               for i in range(30)]
    verdict = judge_windows(windows, reference, POLICY)
    assert verdict.outcome == "passed" and "held in 10 of 30 windows" in verdict.reason
    assert verdict.latency["status"] == "partly held" and verdict.latency["judged"] == 20
    assert verdict.latency["rules"][0]["looks"] >= 1


def test_a_regression_hidden_in_held_windows_is_found_in_the_judged_ones() -> None:
    rng = np.random.default_rng(6)
    reference = _reference(rng)
    windows = [_window(i, _lat(rng, 160, 2.0), rate=800.0 if i % 2 else 80.0)
               for i in range(8)]
    verdict = judge_windows(windows, reference, POLICY)
    assert verdict.outcome == "breach" and "latency_p" in verdict.reason


@pytest.mark.parametrize("baseline", [
    None,
    Reference(()),
    Window(index=-1, seconds=2, requests=100, errors=0, server_us=1000.0),  # no probe data
])
def test_no_reference_means_no_latency_rule(baseline: Window | Reference | None) -> None:
    slow = [_window(0, (50.0,) * 200)]
    assert latency_over(slow, baseline, POLICY) is None
    assert judge_windows(slow, baseline, POLICY).outcome == "passed"


def test_no_quantiles_turns_the_latency_rules_off() -> None:
    rng = np.random.default_rng(0)
    policy = POLICY.model_copy(update={"latency_quantiles": []})
    windows = [_window(i, _lat(rng, 160, 3.0)) for i in range(5)]
    verdict = judge_windows(windows, _reference(rng), policy)
    assert verdict.outcome == "passed" and verdict.latency["status"] == "off"


def test_older_callers_may_pass_one_window_or_a_list() -> None:
    rng = np.random.default_rng(7)
    blocks = list(_reference(rng).windows)
    assert as_reference(blocks) == Reference(tuple(blocks))
    assert as_reference(blocks[0]) == Reference((blocks[0],))
    assert as_reference([]) is None and as_reference(None) is None
    slow = [_window(i, _lat(rng, 160, 2.0)) for i in range(2)]
    assert judge_windows(slow, blocks, POLICY).outcome == "breach"


def test_unreachable_beats_errors_beats_latency() -> None:
    rng = np.random.default_rng(8)
    reference = _reference(rng)
    bad = [_window(i, _lat(rng, 40, 3.0), errors=40) for i in range(2)]
    assert "error rate" in judge_windows(bad, reference, POLICY).reason
    lost = [Window(index=0, seconds=2, requests=40, errors=40, server_us=None,
                   unreachable={"triton-1": "refused"}, latencies_ms=_lat(rng, 40, 3.0))]
    assert judge_windows(lost, reference, POLICY).outcome == "infrastructure"


# ---------------------------------------------------------------------- load figures

METRICS = """# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="1"} 300
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 2
nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 1
# TYPE nv_inference_request_duration_us counter
nv_inference_request_duration_us{model="m",version="1"} 8000000
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="m",version="1"} 7
"""


def test_load_of_reads_rate_inflight_and_pending() -> None:
    after = parse_metrics(METRICS)
    assert after[("m", "1")].gauges == {PENDING: 7.0}
    before = {("m", "1"): after[("m", "1")].__class__(counters={
        "nv_inference_request_success": 100.0, "nv_inference_request_failure": 0.0,
        REQUEST_US: 0.0})}
    change = delta(before, after)[("m", "1")]
    load = load_of(change, 2.0)
    assert load == {"rate_rps": pytest.approx(101.5), "inflight": pytest.approx(4.0),
                    "pending": 7.0}
    assert load_of(None, 2.0) == {"rate_rps": None, "inflight": None, "pending": None}
    assert load_of(change, 0.0)["rate_rps"] is None


def test_fleet_load_adds_replicas_and_keeps_none_for_missing() -> None:
    got = fleet_load({"a": {"rate_rps": 10.0, "inflight": 1.5, "pending": None},
                      "b": {"rate_rps": 30.0, "inflight": 0.5, "pending": None}})
    assert got == {"rate_rps": 40.0, "inflight": 2.0, "pending": None}


def test_window_and_report_records_carry_the_load() -> None:
    window = Window(index=0, seconds=2, requests=160, errors=0, server_us=900.0,
                    latencies_ms=(1.0, 2.0, 3.0, 4.0) * 3, queue_us=100.0, compute_us=800.0,
                    rate_rps=81.234, inflight=0.2, pending=1.0, probe_requests=160,
                    replicas={"triton-0": {"rate_rps": 40.6}})
    document = window.to_dict()
    assert document["load"] == {"rate_rps": 81.23, "inflight": 0.2, "pending": 1.0,
                                "queue_us": 100.0, "compute_us": 800.0,
                                "probe_requests": 160}
    assert document["probe_ms"]["answered"] == 12 and "latencies_ms" not in document
    assert document["replicas"]["triton-0"]["rate_rps"] == 40.6
    reference = Reference((window, window))
    report = BakeReport(judge_windows([window], reference, POLICY), reference, [window], 2.0)
    shown = report.to_dict()
    assert shown["baseline"]["rate_rps"] == pytest.approx(81.23)
    assert shown["baseline"]["kind"] == "pre-swap" and len(shown["baseline"]["windows"]) == 2
    assert shown["latency"]["reference_rate_rps"] == pytest.approx(81.234)
    assert "errors" in shown and shown["errors"]["failed"] == 0


def test_dry_run_output_prints_the_effective_tolerance() -> None:
    record = {"kind": "promote", "model": "m", "from_version": 1, "to_version": 2,
              "status": "planned", "exit_code": 0, "id": "r1", "stages": [],
              "plan": {"stages": ["resolve"], "gates": [], "canary": {"expected_s": "-"},
                       "replicas": ["triton-0"], "rollback_target": 1,
                       "approval": {"required": False, "approvers": []},
                       "bake": plan(BakePolicy(duration_s=120))}}
    shown = render_record(record)
    assert "bake: 120 s; +29.6% latency at unchanged load is caught" in shown


def test_a_reference_of_one_window_turns_the_latency_rules_off_and_says_so() -> None:
    shown = plan(BakePolicy(duration_s=4, window_s=2, baseline_s=2))
    assert shown["effective_tolerance_pct"] is None
    assert "fewer than 2 windows" in shown["effective_tolerance"]
    rng = np.random.default_rng(9)
    one = Reference((_window(-1, _lat(rng, 160)),))
    verdict = judge_windows([_window(0, _lat(rng, 160, 3.0))], one, POLICY)
    assert verdict.outcome == "passed" and verdict.latency["status"] == "no reference"
