"""The gates are pure: tables of snapshots and rules in, verdicts out, no servers."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import GateRule, default_gates, gate_rule
from tasks.gates import (
    GateReport,
    RuleResult,
    Verdict,
    combine,
    evaluate,
    hodges_lehmann,
    judge,
    markdown_table,
    plan_samples,
    required_samples,
)

P, F, INC, E = Verdict.PASSED, Verdict.FAILED, Verdict.INCONCLUSIVE, Verdict.ERROR
N = 2000


def lat(n: int = N, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """Lognormal body (median 2 ms) with a 5% exponential tail, like the judge benchmark."""
    rng = np.random.default_rng(seed)
    return scale * (2.0 * np.exp(0.3 * rng.standard_normal(n))
                    + (rng.random(n) < 0.05) * rng.exponential(4.0, n))


BASE_LAT = lat(seed=1)


def arm(version: int, latency: np.ndarray | None = None, *, requests: int | None = None,
        errors: int = 0, rps: float | None = 100.0, queue: float | None = None,
        compute: float | None = None) -> ArmMeasurements:
    latency = lat() if latency is None else latency
    return ArmMeasurements(version, latency, latency.size + errors if requests is None
                           else requests, errors, rps, queue, compute)


def intervals(ratio: float, k: int = 30, sd: float = 0.05, seed: int = 0
              ) -> list[dict[str, dict[str, float]]]:
    """Per-second server figures: the baseline at 500 µs, the candidate ``ratio`` × it."""
    rng = np.random.default_rng(seed)
    return [{"candidate": {"us": 100 * 500.0 * ratio * float(np.exp(e)), "n": 100.0},
             "baseline": {"us": 100 * 500.0, "n": 100.0}}
            for e in rng.normal(0.0, sd, k)]


def snap(candidate: ArmMeasurements | None = None, baseline: ArmMeasurements | None = None, *,
         agreement: float | None = 0.995, agreement_samples: int = N,
         no_baseline: bool = False,
         server: list[dict[str, dict[str, float]]] | None = None) -> CanarySnapshot:
    cand = candidate or arm(7)
    base = None if no_baseline else (baseline or arm(6, BASE_LAT))
    return CanarySnapshot("fraud", cand, base, agreement=agreement,
                          agreement_samples=agreement_samples, window_s=30.0,
                          extra={"server_intervals": server or []})


NT = 3200
"""Samples per arm of the tail tests: the baseline must put 30 requests above its p99."""


def tsnap(candidate: ArmMeasurements, baseline: ArmMeasurements | None = None
          ) -> CanarySnapshot:
    """A snapshot for the tail rules: :data:`NT` samples per arm."""
    return snap(candidate, baseline or arm(6, lat(NT, seed=1)), agreement_samples=NT)


def rule(**kw: Any) -> GateRule:
    return gate_rule(name=kw.pop("name", "r"), **kw)


# --------------------------------------------------------------------------------------
# threshold

AGREE = {"metric": "agreement", "min": 0.98}
QUEUE_MAX = {"metric": "queue_us_mean", "max": 500.0}
TPUT = {"metric": "throughput_ratio", "min": 0.9, "max": 1.5}


@pytest.mark.parametrize(
    ("bounds", "snapshot", "min_samples", "expected"),
    [
        # min-only
        pytest.param(AGREE, snap(agreement=0.995), 100, P, id="min-only-above"),
        pytest.param(AGREE, snap(agreement=0.98), 100, P, id="min-only-exactly-at-min"),
        pytest.param(AGREE, snap(agreement=0.9799), 100, F, id="min-only-below"),
        pytest.param(AGREE, snap(agreement=1e9), 100, P, id="min-only-no-upper-bound"),
        pytest.param(AGREE, snap(agreement=None), 100, INC, id="min-only-None"),
        pytest.param(AGREE, snap(agreement=math.nan), 100, INC, id="min-only-NaN"),
        pytest.param(AGREE, snap(agreement=0.995, agreement_samples=10), 100, INC,
                     id="min-only-too-few-pairs"),
        pytest.param(AGREE, snap(no_baseline=True, agreement=None), 100, INC,
                     id="min-only-first-release"),
        # max-only
        pytest.param(QUEUE_MAX, snap(arm(7, queue=120.0)), 100, P, id="max-only-below"),
        pytest.param(QUEUE_MAX, snap(arm(7, queue=500.0)), 100, P, id="max-only-exactly-at-max"),
        pytest.param(QUEUE_MAX, snap(arm(7, queue=500.01)), 100, F, id="max-only-above"),
        pytest.param(QUEUE_MAX, snap(arm(7, queue=-1e9)), 100, P, id="max-only-no-lower-bound"),
        pytest.param(QUEUE_MAX, snap(arm(7, queue=None)), 100, INC, id="max-only-None"),
        pytest.param(QUEUE_MAX, snap(arm(7, queue=math.nan)), 100, INC, id="max-only-NaN"),
        pytest.param(QUEUE_MAX, snap(arm(7, np.array([]), requests=0, queue=10.0)), 1, INC,
                     id="max-only-zero-requests"),
        pytest.param(QUEUE_MAX, snap(arm(7, queue=120.0)), N + 1, INC, id="max-only-too-few"),
        # min and max
        pytest.param(TPUT, snap(arm(7, rps=90.0)), 100, P, id="range-exactly-at-min"),
        pytest.param(TPUT, snap(arm(7, rps=150.0)), 100, P, id="range-exactly-at-max"),
        pytest.param(TPUT, snap(arm(7, rps=89.0)), 100, F, id="range-below"),
        pytest.param(TPUT, snap(arm(7, rps=151.0)), 100, F, id="range-above"),
        pytest.param(TPUT, snap(arm(7, rps=None)), 100, INC, id="range-None"),
        pytest.param(TPUT, snap(arm(7, rps=math.nan)), 100, INC, id="range-NaN"),
        pytest.param(TPUT, snap(arm(7), arm(6, BASE_LAT, rps=0.0)), 100, INC,
                     id="range-baseline-zero-throughput"),
        pytest.param(TPUT, snap(no_baseline=True), 100, INC, id="range-no-baseline"),
        # latency and error-rate point values
        pytest.param({"metric": "latency_p99_ms", "max": 5.0}, snap(arm(7, np.full(N, 5.0))),
                     100, P, id="p99-exactly-at-max"),
        pytest.param({"metric": "latency_p99_ms", "max": 5.0}, snap(arm(7, np.full(N, 5.1))),
                     100, F, id="p99-above-max"),
        pytest.param({"metric": "latency_p99_ms", "max": 5.0},
                     snap(arm(7, np.array([1.0, math.nan] * 100))), 1, E, id="p99-NaN-latency"),
        pytest.param({"metric": "error_rate", "max": 0.01},
                     snap(arm(7, np.array([]), requests=0)), 1, INC, id="rate-zero-requests"),
        pytest.param({"metric": "error_rate", "max": 0.01}, snap(arm(7, errors=20)), 100, P,
                     id="rate-under-max"),
    ],
)
def test_threshold(bounds: dict[str, Any], snapshot: CanarySnapshot, min_samples: int,
                   expected: Verdict) -> None:
    result = judge(snapshot, rule(test="threshold", **bounds), min_samples=min_samples)
    assert result.verdict is expected, result.message
    assert result.test == "threshold"
    assert result.message.startswith("r: ")
    if expected is not P:
        assert result.verdict is not P


def test_threshold_message_names_the_value_the_bound_and_the_cause() -> None:
    failed = judge(snap(agreement=0.95), rule(**AGREE), min_samples=1)
    assert "95%" in failed.message and "98%" in failed.message and "fraud/7" in failed.message
    # how the rows were compared, and the policy keys to change for an intended difference
    assert "compared as a classifier: same top-1 label" in failed.message
    assert "canary.agreement" in failed.message
    empty = judge(snap(arm(7, np.array([]), requests=0, queue=1.0)), rule(**QUEUE_MAX),
                  min_samples=1)
    assert "no requests reached fraud/7 in the last 30 s" in empty.message


# --------------------------------------------------------------------------------------
# exact_rate

ERR = {"metric": "error_rate", "max_rate": 0.001}


def counts(errors: int, requests: int, version: int = 7) -> ArmMeasurements:
    return arm(version, lat(requests - errors), requests=requests, errors=errors)


@pytest.mark.parametrize(
    ("bounds", "candidate", "baseline", "min_samples", "expected"),
    [
        # kayenta#377: the baseline has no errors, the candidate 0.5%.
        pytest.param(ERR, counts(10, N), counts(0, N, 6), 1000, F, id="zero-baseline-0.5pct"),
        pytest.param(ERR, counts(0, N), counts(0, N, 6), 1000, P, id="zero-baseline-zero"),
        pytest.param(ERR, counts(2, N), counts(0, N, 6), 1000, P, id="exactly-at-max-rate"),
        pytest.param(ERR, counts(10, N), None, 1000, F, id="no-baseline-absolute-route"),
        pytest.param(ERR, counts(0, N), None, 1000, P, id="no-baseline-zero-errors"),
        pytest.param(ERR, counts(0, 200), counts(0, 200, 6), 1000, INC, id="too-few-samples"),
        # Below the plan a rule cannot pass, but a candidate already shown over budget fails.
        pytest.param(ERR, counts(5, 200), counts(0, 200, 6), 1000, F,
                     id="too-few-samples-already-over-budget"),
        pytest.param(ERR, counts(5, 60), counts(0, 60, 6), 1000, INC,
                     id="below-the-evidence-floor-never-judged"),
        pytest.param(ERR, counts(0, 0), counts(0, N, 6), 1, INC, id="zero-requests"),
        pytest.param(ERR, arm(7, lat(10), requests=10, errors=11), None, 1, E,
                     id="more-errors-than-requests"),
        # 6% against a 5% budget is not significant at n = 1000 (binomial p = 0.08): a
        # clean baseline is no reason to fail a candidate that may be within its budget.
        pytest.param({"metric": "error_rate", "max_rate": 0.05}, counts(60, 1000),
                     counts(0, 1000, 6), 100, P, id="over-budget-not-significant"),
        pytest.param({"metric": "error_rate", "max_rate": 0.05}, counts(90, 1000),
                     counts(0, 1000, 6), 100, F, id="significantly-over-budget"),
        # Both arms fail alike: the canary is broken, not the candidate.
        pytest.param(ERR, counts(N, N), counts(N, N, 6), 100, INC, id="both-arms-all-failing"),
        pytest.param(ERR, counts(40, N), counts(38, N, 6), 100, INC,
                     id="both-arms-failing-alike"),
        pytest.param(ERR, counts(200, N), counts(40, N, 6), 100, F,
                     id="failing-baseline-candidate-much-worse"),
        pytest.param({"metric": "error_rate", "max_rate": 0.05}, counts(30, 1000),
                     counts(0, 1000, 6), 100, P, id="worse-than-baseline-within-budget"),
        pytest.param({"metric": "error_rate", "max_rate": 0.0}, counts(1, N), None, 100, F,
                     id="zero-budget-one-error"),
        pytest.param({"metric": "error_rate", "max_rate": 0.0}, counts(0, N), None, 100, P,
                     id="zero-budget-no-error"),
        pytest.param({"metric": "error_rate", "max_rate": 1.0}, counts(N, N), None, 100, P,
                     id="everything-allowed"),
    ],
)
def test_exact_rate(bounds: dict[str, Any], candidate: ArmMeasurements,
                    baseline: ArmMeasurements | None, min_samples: int,
                    expected: Verdict) -> None:
    snapshot = CanarySnapshot("fraud", candidate, baseline, window_s=30.0)
    result = judge(snapshot, rule(**bounds), min_samples=min_samples)
    assert result.test == "exact_rate"
    assert result.verdict is expected, result.message


def test_exact_rate_kayenta_377_figures() -> None:
    result = judge(CanarySnapshot("fraud", counts(10, N), counts(0, N, 6)), rule(**ERR),
                   min_samples=1000)
    assert result.verdict is F
    assert result.value == pytest.approx(0.005)
    assert result.baseline == 0.0
    assert result.details["p_absolute"] == pytest.approx(4.58e-5, rel=1e-2)
    assert result.details["p_vs_baseline"] == pytest.approx(9.66e-4, rel=1e-2)
    assert "0.5% (10/2000, 90% CI 0.272%–0.847%)" in result.message and "0.1%" in result.message
    assert result.details["hypothesis"] == "H0: error rate ≤ 0.001"


# --------------------------------------------------------------------------------------
# latency: mann_whitney (typical) and quantile (tail)

P99 = {"metric": "latency_p99_ms", "max_increase_pct": 10.0, "min_effect_ms": 0.5}
P50 = {"metric": "latency_p50_ms", "max_increase_pct": 10.0}


def tail_only(n: int = N, *, tail_scale: float, seed: int) -> np.ndarray:
    """The same body as :func:`lat`, its 5% exponential tail ``tail_scale`` times longer."""
    rng = np.random.default_rng(seed)
    return 2.0 * np.exp(0.3 * rng.standard_normal(n)) \
        + (rng.random(n) < 0.05) * rng.exponential(4.0 * tail_scale, n)


def body_only(n: int = N, *, body_scale: float, seed: int) -> np.ndarray:
    """The body ``body_scale`` times slower, the tail shortened so the p99 does not grow."""
    rng = np.random.default_rng(seed)
    return body_scale * 2.0 * np.exp(0.3 * rng.standard_normal(n)) \
        + (rng.random(n) < 0.05) * rng.exponential(3.0, n)


COMMON = [
    pytest.param(snap(arm(7, lat(seed=2)), no_baseline=True), 1, INC, id="no-baseline"),
    pytest.param(snap(arm(7, np.array([]), requests=0)), 1, INC, id="zero-requests"),
    pytest.param(snap(arm(7, np.array([]), requests=50, errors=50)), 1, INC,
                 id="all-requests-failed"),
    pytest.param(snap(arm(7), arm(6, np.array([]), requests=0)), 1, INC,
                 id="baseline-zero-requests"),
    pytest.param(snap(arm(7, np.array([2.0, math.nan, 3.0] * 500))), 1, E, id="NaN-latency"),
    pytest.param(snap(arm(7, lat(500, seed=5))), 1000, INC, id="too-few-samples"),
    # Below the plan a rule cannot pass, but a candidate already shown beyond it fails.
    pytest.param(snap(arm(7, lat(500, scale=2.0))), 1000, F,
                 id="too-few-samples-already-beyond-tolerance"),
    pytest.param(snap(arm(7, lat(), requests=N), arm(6, lat(500, seed=3))), 1000, INC,
                 id="baseline-too-few-samples"),
    pytest.param(snap(arm(7, np.full(N, 2.0)), arm(6, np.full(N, 2.0))), 1000, P,
                 id="constant-equal-latency"),
]


@pytest.mark.parametrize(
    ("bounds", "snapshot", "min_samples", "expected"),
    [
        pytest.param(P50, snap(arm(7, lat(seed=2))), 1000, P, id="equal-latency"),
        pytest.param(P50, snap(arm(7, lat(seed=2, scale=1.3))), 1000, F, id="+30pct"),
        pytest.param(P50, snap(arm(7, lat(seed=2, scale=1.2))), 1000, F, id="+20pct"),
        pytest.param(P50, snap(arm(7, lat(seed=2, scale=0.7))), 1000, P, id="faster"),
        pytest.param(P50, snap(arm(7, body_only(body_scale=1.25, seed=2))), 1000, F,
                     id="body-slower-tail-better"),
        pytest.param(P50, snap(arm(7, tail_only(tail_scale=3.0, seed=2))), 1000, P,
                     id="tail-only-is-not-typical"),
        # +20% is significant, but the p50 moves by ~0.4 ms, under the 5 ms floor.
        pytest.param({**P50, "max_increase_pct": 1.0, "min_effect_ms": 5.0},
                     snap(arm(7, lat(seed=2, scale=1.2))), 1000, P, id="below-effect-floor"),
        pytest.param({"metric": "latency_mean_ms", "max_increase_pct": 10.0},
                     snap(arm(7, lat(seed=2, scale=1.3))), 1000, F, id="mean-regression"),
        *[pytest.param(P50, *c.values, id=f"p50-{c.id}") for c in COMMON],
    ],
)
def test_typical_latency(bounds: dict[str, Any], snapshot: CanarySnapshot, min_samples: int,
                         expected: Verdict) -> None:
    result = judge(snapshot, rule(**bounds), min_samples=min_samples)
    assert result.test == "mann_whitney"
    assert result.verdict is expected, result.message


@pytest.mark.parametrize(
    ("bounds", "snapshot", "min_samples", "expected"),
    [
        pytest.param(P99, tsnap(arm(7, lat(NT, seed=2))), 1000, P, id="equal-latency"),
        pytest.param(P99, tsnap(arm(7, lat(NT, seed=2, scale=1.5))), 1000, F,
                     id="+50pct-everywhere"),
        pytest.param(P99, snap(arm(7, tail_only(NT, tail_scale=2.5, seed=2)),
                               arm(6, lat(NT, seed=1))), 1000, F, id="tail-only-p99"),
        pytest.param(P99, tsnap(arm(7, body_only(NT, body_scale=1.25, seed=2))), 1000, P,
                     id="body-slower-tail-better"),
        pytest.param(P99, tsnap(arm(7, lat(NT, seed=2, scale=0.7))), 1000, P, id="faster"),
        pytest.param({**P99, "max_increase_pct": 1.0, "min_effect_ms": 50.0},
                     tsnap(arm(7, lat(NT, seed=2, scale=1.5))), 1000, P, id="below-effect-floor"),
        pytest.param({"metric": "latency_p95_ms", "max_increase_pct": 10.0},
                     tsnap(arm(7, lat(NT, seed=2, scale=1.5))), 1000, F, id="p95-regression"),
        *[pytest.param(P99, *c.values, id=f"p99-{c.id}") for c in COMMON],
    ],
)
def test_tail_latency(bounds: dict[str, Any], snapshot: CanarySnapshot, min_samples: int,
                      expected: Verdict) -> None:
    result = judge(snapshot, rule(**bounds), min_samples=min_samples)
    assert result.test == "quantile"
    assert result.verdict is expected, result.message


def test_rules_on_different_percentiles_give_different_answers() -> None:
    """The old judge gave p50, p95, p99 and mean rules the same p-value on the same data."""
    snapshot = tsnap(arm(7, tail_only(NT, tail_scale=2.0, seed=4)))
    ps = {m: judge(snapshot, rule(metric=m, max_increase_pct=10.0), min_samples=1).p_value
          for m in ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "latency_mean_ms")}
    assert ps["latency_p99_ms"] is not None and ps["latency_p99_ms"] < 0.01, ps
    assert ps["latency_p50_ms"] is not None and ps["latency_p50_ms"] > 0.5, ps
    assert len({ps["latency_p50_ms"], ps["latency_p95_ms"], ps["latency_p99_ms"]}) == 3, ps


def test_tail_rule_message_is_truthful() -> None:
    candidate = tail_only(3000, tail_scale=2.5, seed=2)
    result = judge(snap(arm(7, candidate), arm(6, lat(3000, seed=1))), rule(**P99),
                   min_samples=1000)
    assert result.verdict is F
    c99 = float(np.percentile(candidate, 99))
    assert result.value == pytest.approx(c99)
    assert result.baseline is not None
    assert result.threshold_value == pytest.approx(result.baseline * 1.1)
    low, high = result.details["ratio_ci"]
    assert result.details["ratio"] == pytest.approx(c99 / result.baseline)
    assert low <= result.details["ratio"] <= high
    assert result.p_value is not None and result.p_value < 0.05
    for part in (f"latency_p99_ms {c99:.3g} ms", f"baseline {result.baseline:.3g} ms",
                 "tolerance max(10%, 0.5 ms)", "95% CI ×", "Fisher p=", "beyond"):
        assert part in result.message, (part, result.message)


def test_typical_rule_reports_the_shift_and_the_bound() -> None:
    result = judge(snap(arm(7, lat(seed=2, scale=1.3))), rule(**P50), min_samples=1000)
    assert result.verdict is F
    assert result.value == pytest.approx(np.percentile(lat(seed=2, scale=1.3), 50))
    assert result.baseline == pytest.approx(np.percentile(BASE_LAT, 50))
    assert result.baseline is not None
    assert result.threshold_value == pytest.approx(result.baseline * 1.1)
    assert result.p_value is not None and result.p_value < 0.05
    low, high = result.details["hodges_lehmann_ratio_ci"]
    assert 1.1 < low <= result.details["hodges_lehmann_ratio"] <= high
    assert result.details["hodges_lehmann_ratio"] == pytest.approx(1.3, abs=0.03)
    assert result.samples == (N, N)
    for part in ("fraud/7", "Mann-Whitney p=", "tolerance 10% = ×1.100", "90% CI ×",
                 "typical latency"):
        assert part in result.message, (part, result.message)


def test_mann_whitney_on_p99_is_refused_naming_quantile_never_rewritten() -> None:
    with pytest.raises(ValidationError, match="test: quantile"):
        rule(test="mann_whitney", **P99)
    assert rule(**P99).test == "quantile" and rule(**P50).test == "mann_whitney"


def test_no_baseline_message() -> None:
    result = judge(snap(no_baseline=True), rule(**P99), min_samples=1)
    assert "no baseline to compare against" in result.message


def test_a_broken_measurement_is_an_error_not_a_crash() -> None:
    broken = ArmMeasurements(7, np.array(["fast", "slow"]), 2, 0)
    result = judge(snap(broken), rule(**P99), min_samples=1)
    assert result.verdict is E
    assert "latencies of fraud/7 are not numbers" in result.message


@pytest.mark.parametrize(
    ("values", "says"),
    [
        pytest.param([1.0, math.inf] * 1000, "1000 NaN or infinite of 2000", id="inf"),
        pytest.param([1.0, -math.inf] * 1000, "1000 NaN or infinite", id="minus-inf"),
        pytest.param([1.0, -0.5] * 1000, "1000 negative of 2000", id="negative"),
        pytest.param([math.nan, -0.5] * 1000, "1000 NaN or infinite and 1000 negative",
                     id="both"),
    ],
)
@pytest.mark.parametrize("bounds", [P99, P50, {"metric": "latency_p99_ms", "max": 5.0}])
@pytest.mark.parametrize("side", ["candidate", "baseline"])
def test_non_finite_or_negative_latency_is_rejected(values: list[float], says: str,
                                                    bounds: dict[str, Any], side: str) -> None:
    bad = np.array(values)
    snapshot = snap(arm(7, bad)) if side == "candidate" else snap(arm(7), arm(6, bad))
    result = judge(snapshot, rule(**bounds), min_samples=1)
    assert result.verdict is E, result.message
    assert says in result.message and "must be finite and ≥ 0 ms" in result.message
    assert f"fraud/{7 if side == 'candidate' else 6}" in result.message


def test_planning_rejects_a_broken_baseline_sample() -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        required_samples(rule(**P99), baseline_latency_ms=np.array([1.0, math.inf, 2.0]))


@pytest.mark.parametrize("offset", [0.0, 1e6])
def test_hodges_lehmann_is_exact_at_the_extremes(offset: float) -> None:
    """Every rank, the smallest and the largest included, even far from zero."""
    from tasks.gates import _pair_quantile

    rng = np.random.default_rng(11)
    for _ in range(50):
        x = np.sort(offset + rng.random(int(rng.integers(1, 40))) * 1e-3)
        y = np.sort(offset + rng.random(int(rng.integers(1, 40))) * 1e-3)
        diffs = np.sort(np.subtract.outer(x, y).ravel())
        for k in {0, 1, diffs.size // 2, diffs.size - 2, diffs.size - 1}:
            k = min(max(k, 0), diffs.size - 1)
            assert _pair_quantile(x, y, k) == diffs[k]


@pytest.mark.parametrize(("n", "m"), [(1, 1), (7, 5), (40, 40), (301, 177)])
def test_hodges_lehmann_matches_brute_force(n: int, m: int) -> None:
    rng = np.random.default_rng(n * 1000 + m)
    x = np.round(rng.normal(size=n), 1)  # rounded: ties included
    y = np.round(rng.normal(0.3, size=m), 1)
    diffs = np.sort(np.subtract.outer(x, y).ravel())
    est, low, high = hodges_lehmann(x, y, alpha=0.05)
    assert est == pytest.approx(np.median(diffs))
    assert diffs[0] <= low <= est <= high <= diffs[-1]
    assert low in diffs and high in diffs


# --------------------------------------------------------------------------------------
# dry run and combining


def result_of(verdict: Verdict, dry_run: bool = False) -> RuleResult:
    return RuleResult("r", "agreement", "threshold", verdict, None, None, "", None, None,
                      (0, None), dry_run, "")


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        pytest.param([], INC, id="empty-is-never-a-pass"),
        pytest.param([result_of(P)], P, id="one-pass"),
        pytest.param([result_of(P), result_of(P)], P, id="all-pass"),
        pytest.param([result_of(P), result_of(INC)], INC, id="inconclusive-beats-passed"),
        pytest.param([result_of(INC), result_of(E)], E, id="error-beats-inconclusive"),
        pytest.param([result_of(E), result_of(F), result_of(P)], F, id="failed-beats-all"),
        pytest.param([result_of(P), result_of(F, dry_run=True)], P, id="dry-run-fail-ignored"),
        pytest.param([result_of(F, dry_run=True)], INC, id="only-dry-run-is-inconclusive"),
        pytest.param([P, E, INC], E, id="bare-verdicts"),
    ],
)
def test_combine(results: list[RuleResult | Verdict], expected: Verdict) -> None:
    assert combine(results) is expected


def test_severity_order_is_argos() -> None:
    assert sorted(Verdict, key=lambda v: v.severity) == [P, INC, E, F]
    assert P.worse(F) is F and F.worse(E) is F and INC.worse(P) is INC


def test_dry_run_failure_is_reported_but_does_not_block() -> None:
    rules = [rule(name="agreement", **AGREE),
             rule(name="p99_canary", dry_run=True, **P99)]
    report = evaluate(tsnap(arm(7, lat(NT, seed=2, scale=1.5))), rules, min_samples=1000)
    by_name = {r.rule: r for r in report.results}
    assert by_name["p99_canary"].verdict is F and by_name["p99_canary"].dry_run
    assert report.verdict is P
    assert "p99_canary (dry run)" in markdown_table(report)


# --------------------------------------------------------------------------------------
# evaluate and reports


def test_evaluate_default_gates_on_a_regression() -> None:
    candidate = arm(7, lat(NT - 16, seed=2, scale=1.8), requests=NT, errors=16, queue=50.0,
                    compute=700.0)
    baseline = arm(6, lat(NT, seed=1), requests=NT, errors=0, queue=50.0, compute=500.0)
    report = evaluate(snap(candidate, baseline, server=intervals(1.4)), default_gates(),
                      min_samples=1000)
    assert isinstance(report, GateReport)
    assert [(r.rule, r.verdict) for r in report.results] == [
        ("latency_p50", F), ("latency_p99", F), ("error_rate", F), ("agreement", P),
        ("server_latency", F)]
    assert report.verdict is F
    assert report.required_samples >= 1000
    document = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert document["verdict"] == "failed"
    assert document["results"][2]["samples"] == {"candidate": NT, "baseline": NT}
    assert document["family_alpha"] == pytest.approx(0.05)
    assert document["results"][4]["value"] == pytest.approx(750 / 550)  # the whole run
    assert document["results"][4]["details"]["geometric_mean_ratio"] == pytest.approx(1.4,
                                                                                     rel=0.03)
    table = markdown_table(report)
    assert table.count("\n|") == 7  # header, rule line, five rules
    assert "| rule | value | baseline | threshold | p-value | dependence | verdict |" in table
    assert "family-wise false-fail rate ≤ 0.05" in table and "40 blocks, lag-1" in table


def test_evaluate_without_data_is_inconclusive() -> None:
    empty = snap(arm(7, np.array([]), requests=0), agreement=None)
    report = evaluate(empty, default_gates(), min_samples=1000)
    assert report.verdict is INC
    assert all(r.verdict is INC for r in report.results)
    json.dumps(report.to_dict(), allow_nan=False)


def test_nan_becomes_null_in_json() -> None:
    report = evaluate(snap(agreement=math.nan), [rule(**AGREE)], min_samples=1)
    assert report.verdict is INC
    assert json.loads(json.dumps(report.to_dict(), allow_nan=False))["results"][0]["value"] \
        is None


# --------------------------------------------------------------------------------------
# sample size


@pytest.mark.parametrize("bounds", [P99, ERR, {"metric": "error_rate", "max_rate": 0.0}])
@pytest.mark.parametrize("with_sample", [False, True])
def test_required_samples_grows_with_power(bounds: dict[str, Any], with_sample: bool) -> None:
    sample = BASE_LAT if with_sample else None
    sizes = [required_samples(rule(power=p, effect=_effect(bounds), **bounds),
                              baseline_latency_ms=sample) for p in (0.5, 0.8, 0.9, 0.95, 0.99)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


@pytest.mark.parametrize("bounds", [P99, ERR])
def test_required_samples_shrinks_with_effect(bounds: dict[str, Any]) -> None:
    base = _effect(bounds)
    sizes = [required_samples(rule(effect=base * k, **bounds)) for k in (0.5, 1, 2, 4)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_required_samples_zero_budget_is_the_classic_formula() -> None:
    # 1 - (1 - 0.01)^n >= 0.95  <=>  n >= 298.07
    r = rule(metric="error_rate", max_rate=0.0, effect=0.01, power=0.95)
    assert required_samples(r) == 299


def test_required_samples_floor_and_threshold() -> None:
    assert required_samples(rule(**AGREE), min_samples=1000) == 1000
    assert required_samples(rule(**P99), min_samples=10**6) == 10**6


def test_plan_samples_ignores_dry_run_rules() -> None:
    strict = rule(name="tiny_effect", dry_run=True, effect=0.5, power=0.99, **P99)
    assert plan_samples([rule(**AGREE), strict], min_samples=1000) == 1000
    assert plan_samples([], min_samples=7) == 7
    assert plan_samples(default_gates(), min_samples=1000) == max(
        required_samples(g, min_samples=1000) for g in default_gates())


def _effect(bounds: dict[str, Any]) -> float:
    if "max_increase_pct" in bounds:
        return 5.0
    return 0.002


def test_evaluate_survives_a_broken_baseline() -> None:
    broken = ArmMeasurements(6, np.array(["fast", "slow"]), 2, 0)
    report = evaluate(snap(arm(7), broken), default_gates(), min_samples=1)
    assert report.results[0].verdict is E
    assert report.verdict in (E, F)


@pytest.mark.parametrize(("ones_x", "ones_y"), [(0, 0), (10, 0), (60, 0), (50, 50), (100, 3)])
def test_hodges_lehmann_on_indicators(ones_x: int, ones_y: int) -> None:
    x = np.zeros(100)
    x[:ones_x] = 1
    y = np.zeros(100)
    y[:ones_y] = 1
    est, low, high = hodges_lehmann(x, y, alpha=0.05)
    assert est == np.median(np.subtract.outer(x, y))
    assert low <= est <= high


@pytest.mark.parametrize("pb", [0.0, 0.001, 0.05, 0.5, 0.999, 1.0])
@pytest.mark.parametrize(("max_rate", "effect"), [(0.001, None), (0.0, 1e-7), (0.3, 0.01)])
def test_rate_planning_is_finite_and_fast_at_any_baseline_rate(pb: float, max_rate: float,
                                                               effect: float | None) -> None:
    """The old planner overflowed (binom(n, k)·p^k) and took 1.2 s at a 100% baseline."""
    import time

    r = rule(metric="error_rate", max_rate=max_rate, effect=effect)
    started = time.perf_counter()
    n = required_samples(r, baseline_error_rate=pb)
    assert isinstance(n, int) and 1 <= n <= 10_000_000
    assert time.perf_counter() - started < 2.0


def test_rate_plan_reaches_its_power_exactly() -> None:
    """The exact binomial step finds the first n with the power; the rule's plan adds what
    the overdispersion deflation costs on independent errors (a few percent)."""
    from tasks.gates import _rate_plan, rate_power

    n = _rate_plan(0.001, 0.005, 0.05, 0.95)
    assert float(rate_power(n, 0.001, 0.005, 0.05)[0]) >= 0.95
    assert float(rate_power(n - 1, 0.001, 0.005, 0.05)[0]) < 0.95
    r = rule(metric="error_rate", max_rate=0.001, effect=0.004, power=0.95)
    assert n <= required_samples(r) <= 1.25 * n


# --------------------------------------------------------------------------------------
# server_ratio

SERVER = {"metric": "server_latency_ratio", "max_increase_pct": 10.0}


@pytest.mark.parametrize(
    ("snapshot", "min_samples", "expected"),
    [
        pytest.param(snap(server=intervals(1.0)), 100, P, id="same-server-time"),
        pytest.param(snap(server=intervals(0.8)), 100, P, id="faster"),
        pytest.param(snap(server=intervals(1.3)), 100, F, id="+30pct-inside-triton"),
        pytest.param(snap(server=intervals(1.3, k=2)), 100, INC, id="too-few-intervals"),
        pytest.param(snap(server=[]), 100, INC, id="no-metrics"),
        pytest.param(snap(no_baseline=True, server=intervals(1.0)), 1, INC, id="no-baseline"),
        pytest.param(snap(server=intervals(1.0)), N + 1, INC, id="too-few-requests"),
        pytest.param(snap(server=[{"candidate": {"us": 1.0, "n": 0.0},
                                   "baseline": {"us": 1.0, "n": 1.0}}] * 5), 1, INC,
                     id="candidate-answered-nothing"),
        pytest.param(snap(server=intervals(1.2, sd=0.0)), 1, F, id="no-noise-above"),
        pytest.param(snap(server=intervals(1.05, sd=0.0)), 1, P, id="no-noise-below"),
    ],
)
def test_server_ratio(snapshot: CanarySnapshot, min_samples: int, expected: Verdict) -> None:
    result = judge(snapshot, rule(**SERVER), min_samples=min_samples)
    assert result.test == "server_ratio"
    assert result.verdict is expected, result.message


def test_server_ratio_message_is_truthful() -> None:
    result = judge(snap(arm(7, queue=50.0, compute=700.0), arm(6, BASE_LAT, queue=50.0,
                                                             compute=500.0),
                        server=intervals(1.3)), rule(**SERVER), min_samples=1)
    assert result.verdict is F
    low, high = result.details["ratio_ci"]
    assert low < result.details["geometric_mean_ratio"] < high
    for part in ("Triton queue + compute per request ×1.", "over 30 intervals", "90% CI ×",
                 "whole run ×1.364", "tolerance ×1.100", "t-test p="):
        assert part in result.message, (part, result.message)


# --------------------------------------------------------------------------------------
# time blocks: dependence and bursts (issue 17)


def timed_snapshot(seed: int, n: int, *, phi: float = 0.0, scale: float = 1.0,
                   c_err: float = 0.0, burst: float = 1.0) -> CanarySnapshot:
    """A paired canary from the shared generators, with every request's send time."""
    from bench.traffic_models import arm as simulate

    rng = np.random.default_rng(seed)
    arms = [simulate(rng, n, phi=phi, error_rate=e, mean_burst=burst,
                     transform=(lambda x, s=s: s * x)) for e, s in ((c_err, scale), (0.0, 1.0))]
    measured = [ArmMeasurements(v, a.latency_ms, a.requests, int(a.error_s.size), 100.0,
                                latency_s=a.ok_s, error_s=a.error_s)
                for v, a in zip((7, 6), arms, strict=True)]
    return CanarySnapshot("fraud", measured[0], measured[1], agreement=1.0,
                          agreement_samples=n, window_s=30.0)


def test_a_burst_of_errors_counts_as_an_incident_not_as_independent_failures() -> None:
    """12 failures in one burst in 5000 requests against a 0.1% budget: the exact binomial
    test calls it significant (p ≈ 0.005); the block test sees φ ≈ 12, one incident."""
    errors_at = np.arange(2000, 2012) * (30.0 / 5000)  # 12 consecutive sends
    ok_s = np.setdiff1d(np.arange(5000) * (30.0 / 5000), errors_at)
    cand = ArmMeasurements(7, lat(ok_s.size, seed=2), 5000, 12, 100.0, latency_s=ok_s,
                           error_s=errors_at)
    base = ArmMeasurements(6, lat(5000, seed=1), 5000, 0, 100.0,
                           latency_s=np.arange(5000) * (30.0 / 5000), error_s=np.zeros(0))
    result = judge(CanarySnapshot("fraud", cand, base), rule(**ERR), min_samples=1)
    assert result.verdict is P, result.message
    assert result.details["overdispersion_used"] > 5
    assert "errors come in bursts" in result.message
    # Without the send times the same counts fail: the exact test on independent requests.
    untimed = CanarySnapshot("fraud", replace_arm(cand), replace_arm(base))
    assert judge(untimed, rule(**ERR), min_samples=1).verdict is F


def replace_arm(a: ArmMeasurements) -> ArmMeasurements:
    return ArmMeasurements(a.version, a.latency_ms, a.requests, a.errors, a.throughput_rps)


@pytest.mark.parametrize(("kw", "name"), [({"phi": 0.5, "scale": 1.1}, "latency_p50"),
                                           ({"phi": 0.9}, "latency_p99"),
                                           ({"c_err": 0.001, "burst": 8.0}, "error_rate")])
def test_dependent_traffic_at_the_boundary_fails_about_alpha(kw: dict[str, float],
                                                              name: str) -> None:
    """Per-arm AR(1) latency at the tolerance, identical tails at φ = 0.9, errors at the
    budget in bursts of 8: 60 seeded canaries of 3200 per arm fail ≤ α plus 3 s.e."""
    gate = next(g for g in default_gates() if g.name == name)
    failed = sum(judge(timed_snapshot(seed, 3200, **kw), gate, min_samples=1).verdict is F
                 for seed in range(60))
    assert failed / 60 <= gate.alpha + 3 * math.sqrt(gate.alpha / 60) + 1 / 60, failed


def test_the_report_names_high_dependence() -> None:
    report = evaluate(timed_snapshot(3, 3200, phi=0.99), default_gates()[:2], min_samples=1)
    table = markdown_table(report)
    assert "High dependence" in table and "(high)" in table
    assert report.results[0].details["dependence"]["lag1"] > 0.3
