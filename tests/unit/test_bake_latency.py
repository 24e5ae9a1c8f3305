"""The bake's latency rules: always-valid quantile-exceedance e-processes against the
pre-swap window (tasks/bake.py), with seeded calibration and power checks.

The A/A and power figures here are small, fast versions of the calibration; the margins
are binomial: with R runs at a true rate α the observed rate exceeds α + 3·sqrt(α/R) rarely.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from modelship.measurements import MeasurementError
from modelship.policy import BakePolicy
from tasks.bake import Window, judge_windows, latency_over, latency_references
from tasks.sequential import quantile_bound

POLICY = BakePolicy(duration_s=60, window_s=2, max_error_rate=0.01, alpha=0.05,
                    max_latency_increase_pct=25, min_latency_effect_us=0,
                    latency_quantiles=[0.5, 0.9])


def _lat(rng: np.random.Generator, n: int, scale: float = 1.0) -> tuple[float, ...]:
    """Lognormal probe latencies around 2 ms (σ = 0.3, a CPU model's spread), in ms."""
    return tuple(float(x) for x in scale * 2.0 * rng.lognormal(0.0, 0.3, size=n))


def _window(i: int, latencies: tuple[float, ...], server_us: float | None = 1000.0) -> Window:
    return Window(index=i, seconds=2, requests=len(latencies), errors=0,
                  server_us=server_us, latencies_ms=latencies)


def _watch(rng: np.random.Generator, policy: BakePolicy, *, scale: float, windows: int,
           per_window: int = 80, reference: int = 160) -> int | None:
    """Windows until the first latency breach (1-based), or None over the whole watch."""
    baseline = _window(-1, _lat(rng, reference))
    seen: list[Window] = []
    for i in range(windows):
        seen.append(_window(i, _lat(rng, per_window, scale)))
        verdict = judge_windows(seen, baseline, policy)
        if verdict.outcome == "breach":
            return i + 1
    return None


def test_quantile_bound_covers_at_its_level_whatever_the_distribution() -> None:
    """P(X > τ) ≤ θ0 in ≥ 1 - α of reference samples (Wilks' tolerance limit, exact)."""
    rng = np.random.default_rng(3)
    alpha, misses, runs = 0.1, 0, 2000
    for _ in range(runs):
        ref = rng.exponential(1.0, size=60)
        tau, theta0 = quantile_bound(ref, 0.9, alpha)
        misses += math.exp(-tau) > theta0  # the true P(X > τ) of Exp(1)
    assert misses / runs <= alpha + 3 * math.sqrt(alpha / runs)
    assert misses / runs >= alpha - 3 * math.sqrt(alpha / runs)  # exact, not conservative


@pytest.mark.parametrize(("values", "q", "tau", "theta0"), [
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0, stats.beta.ppf(0.95, 3, 2)),
    ([5.0], 0.99, 5.0, 0.95),                       # one value: Beta(1, 1)
    ([4.0, 3.0, 2.0, 1.0], 0.99, 4.0, 1 - 0.05 ** (1 / 4)),  # the maximum: Beta(1, n)
    ([1.0, 1.0, 1.0, 2.0], 0.1, 1.0, stats.beta.ppf(0.95, 4, 1)),
])
def test_quantile_bound_table(values: list[float], q: float, tau: float,
                              theta0: float) -> None:
    got_tau, got_theta0 = quantile_bound(np.asarray(values), q, 0.05)
    assert got_tau == tau and got_theta0 == pytest.approx(theta0)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, -2.0], [float("inf")]])
def test_quantile_bound_refuses_what_cannot_be_latencies(bad: list[float]) -> None:
    with pytest.raises(MeasurementError):
        quantile_bound(np.asarray(bad), 0.5, 0.05)


def test_references_split_alpha_and_apply_tolerance_and_floor() -> None:
    baseline = _window(-1, tuple(float(x) for x in range(1, 101)))
    refs = latency_references(baseline, BakePolicy(alpha=0.02, max_latency_increase_pct=10,
                                                   min_latency_effect_us=3000,
                                                   latency_quantiles=[0.9, 0.5]))
    assert [r.quantile for r in refs] == [0.5, 0.9]
    assert [r.tau_ms for r in refs] == [50.0, 90.0]
    assert [r.alpha for r in refs] == [0.01, 0.01]
    assert refs[0].limit_ms == pytest.approx(55.0)  # τ·1.1 beats τ + 3 ms
    assert refs[1].limit_ms == pytest.approx(99.0)
    floor = latency_references(baseline, BakePolicy(max_latency_increase_pct=1,
                                                    min_latency_effect_us=5000))
    assert floor[0].limit_ms == pytest.approx(55.0)  # τ + 5 ms beats τ·1.01
    assert 0.5 < refs[0].theta0 < 0.7 and 0.1 < refs[1].theta0 < 0.25


@pytest.mark.parametrize("baseline", [
    None,
    Window(index=-1, seconds=2, requests=100, errors=0, server_us=1000.0),  # no probe data
    Window(index=-1, seconds=2, requests=1, errors=0, server_us=1000.0, latencies_ms=(1.0,)),
])
def test_no_reference_means_no_latency_rule(baseline: Window | None) -> None:
    slow = [_window(0, (50.0,) * 200)]
    assert latency_over(slow, baseline, POLICY) is None
    assert judge_windows(slow, baseline, POLICY).outcome == "passed"


def test_no_quantiles_turns_the_latency_rules_off() -> None:
    rng = np.random.default_rng(0)
    policy = POLICY.model_copy(update={"latency_quantiles": []})
    assert _watch(rng, policy, scale=3.0, windows=5) is None


def test_a_certain_regression_names_the_rule_numbers_and_server_side_evidence() -> None:
    rng = np.random.default_rng(1)
    baseline = _window(-1, _lat(rng, 160), server_us=900.0)
    windows = [_window(0, _lat(rng, 80, 3.0), server_us=2700.0)]
    verdict = judge_windows(windows, baseline, POLICY)
    assert verdict.outcome == "breach"
    assert "latency_p50" in verdict.reason and "probe requests since the swap" in verdict.reason
    assert "+25%" in verdict.reason and "e-value" in verdict.reason
    assert "2700 µs per request in the last window against 900 µs" in verdict.reason


def test_errors_still_win_over_latency_and_unreachable_over_both() -> None:
    rng = np.random.default_rng(2)
    baseline = _window(-1, _lat(rng, 160))
    bad = Window(index=0, seconds=2, requests=40, errors=40, server_us=None,
                 latencies_ms=_lat(rng, 40, 3.0))
    assert "error rate" in judge_windows([bad], baseline, POLICY).reason
    lost = Window(index=0, seconds=2, requests=40, errors=40, server_us=None,
                  unreachable={"triton-1": "refused"}, latencies_ms=_lat(rng, 40, 3.0))
    assert judge_windows([lost], baseline, POLICY).outcome == "infrastructure"


def test_window_record_summarizes_the_probe_latencies() -> None:
    document = _window(3, (1.0, 2.0, 3.0, 4.0)).to_dict()
    assert document["probe_ms"]["answered"] == 4 and document["probe_ms"]["p50"] == 2.5
    assert "latencies_ms" not in document
    assert "probe_ms" not in _window(3, ()).to_dict()


def test_a_a_bake_watched_for_many_windows_rarely_rolls_back() -> None:
    """A/A: 200 bakes of 30 windows (2400 requests after the swap), every window looked
    at: false rollbacks ≤ α + margin. A per-window threshold on the p50 (+25%) would
    not even be the right test; this one holds its level over every look."""
    rng = np.random.default_rng(7)
    runs = 200
    breaches = sum(_watch(rng, POLICY, scale=1.0, windows=30) is not None
                   for _ in range(runs))
    assert breaches / runs <= POLICY.alpha + 3 * math.sqrt(POLICY.alpha / runs)


def test_at_the_tolerance_it_stays_within_alpha() -> None:
    """×1.25 with a 25% tolerance is exactly H0's boundary: still ≤ α + margin."""
    rng = np.random.default_rng(8)
    runs = 150
    breaches = sum(_watch(rng, POLICY, scale=1.25, windows=20) is not None
                   for _ in range(runs))
    assert breaches / runs <= POLICY.alpha + 3 * math.sqrt(POLICY.alpha / runs)


def test_x1_5_latency_is_caught_within_a_few_windows() -> None:
    rng = np.random.default_rng(9)
    found = [_watch(rng, POLICY, scale=1.5, windows=15) for _ in range(100)]
    caught = [f for f in found if f is not None]
    assert len(caught) >= 95
    assert float(np.median(caught)) <= 4  # windows of 80 probe requests (2 s at 40 rps)


def test_a_tail_only_regression_is_caught_by_the_tail_rule() -> None:
    """Every 5th request 3× slower after the swap, the median unchanged: p90 catches it."""
    rng = np.random.default_rng(10)
    baseline = _window(-1, _lat(rng, 160))
    seen: list[Window] = []
    reason = ""
    for i in range(15):
        values = np.asarray(_lat(rng, 80))
        values[::5] *= 3.0
        seen.append(_window(i, tuple(float(x) for x in values)))
        verdict = judge_windows(seen, baseline, POLICY)
        if verdict.outcome == "breach":
            reason = verdict.reason
            break
    assert "latency_p90" in reason
