"""Block statistics (tasks.blocks) and the traffic generators (bench.traffic_models)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.traffic_models import ar1, ar1_latency, arm, bursty_errors, tail_stretch
from tasks.blocks import (
    betting_cs,
    betting_log_e,
    block_count,
    block_ids,
    block_sums,
    diagnose,
    lag1,
    long_run_variance,
    mean_test,
    order_ids,
    overdispersion,
    quasi_binomial_sf,
)


@pytest.mark.parametrize(("n", "blocks"), [(0, 0), (1, 1), (30, 2), (100, 5), (800, 40),
                                           (10**6, 40)])
def test_block_count_keeps_blocks_full(n: int, blocks: int) -> None:
    assert block_count(n) == blocks


def test_block_ids_split_time_evenly_and_line_up_arms() -> None:
    ids = block_ids(np.array([0.0, 0.9, 1.0, 5.5, 9.99, 10.0]), 10, start=0.0, stop=10.0)
    assert ids.tolist() == [0, 0, 1, 5, 9, 9]
    assert order_ids(10, 3).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert block_sums(np.ones(6), ids, 10).tolist() == [2, 1, 0, 0, 0, 1, 0, 0, 0, 2]


def test_generators_have_the_asked_dependence_and_rate() -> None:
    rng = np.random.default_rng(3)
    for phi in (0.5, 0.9):
        z = ar1(rng, 50_000, phi)
        assert abs(lag1(z) - phi) < 0.02 and abs(z.std() - 1.0) < 0.05
    lat = ar1_latency(rng, 20_000, 0.9)
    assert lag1(np.log(lat)) > 0.7
    failed = bursty_errors(rng, 400_000, 0.002, 8.0)
    runs = np.diff(np.flatnonzero(np.diff(np.r_[0, failed.astype(int), 0])))[::2]
    assert abs(failed.mean() - 0.002) < 0.0006 and 6.0 < runs.mean() < 10.0
    base = np.sort(rng.lognormal(0.0, 0.5, 20_000))
    slow = tail_stretch(base, base, 0.99, 1.4)
    assert np.quantile(slow, 0.99) == pytest.approx(1.4 * np.quantile(base, 0.99), rel=1e-6)
    assert np.quantile(slow, 0.5) == np.quantile(base, 0.5)
    a = arm(rng, 1000, error_rate=0.5, duration_s=10.0)
    assert a.requests == 1000 and a.ok_s.size == a.latency_ms.size and a.ok_s.max() < 10


def test_overdispersion_sees_bursts_and_not_independent_errors() -> None:
    burst = np.zeros(40)
    burst[7] = 8
    assert overdispersion(burst, np.full(40, 125.0)) == pytest.approx(8.0, rel=0.05)
    spread = np.zeros(40)
    spread[:8] = 1
    assert overdispersion(spread, np.full(40, 125.0)) < 1.0
    assert math.isnan(overdispersion(np.zeros(40), np.full(40, 125.0)))


@pytest.mark.parametrize(("k", "n", "rate", "phi"), [(5, 1000, 0.003, 1.0), (0, 10, 0.1, 1.0),
                                                     (12, 5000, 0.001, 1.0)])
def test_quasi_binomial_is_the_exact_binomial_at_phi_one(k: int, n: int, rate: float,
                                                          phi: float) -> None:
    from scipy import stats
    exact = float(stats.binom.sf(k - 1, n, rate)) if k > 0 else 1.0
    assert quasi_binomial_sf(k, n, rate, phi) == pytest.approx(exact, rel=1e-9)
    assert quasi_binomial_sf(k, n, rate, 8.0) >= exact


def test_mean_test_hac_widens_for_correlated_blocks() -> None:
    rng = np.random.default_rng(5)
    independent = rng.standard_normal(40)
    correlated = ar1(rng, 40, 0.8)
    assert long_run_variance(correlated) > np.var(correlated, ddof=1)
    assert long_run_variance(-np.abs(independent) * (-1) ** np.arange(40)) >= \
        np.var(-np.abs(independent) * (-1) ** np.arange(40), ddof=1)
    t = mean_test(independent + 1.0)
    assert t.p_value < 1e-3 and t.blocks == 40
    lo, hi = t.interval(0.95)
    assert lo < t.mean < hi < t.upper(0.01) + 1.0


def test_mean_test_is_calibrated_on_ar1_blocks() -> None:
    """40 blocks of an AR(1) φ = 0.5 series of block means: false rejections at α = 5%."""
    rng = np.random.default_rng(9)
    rejections = sum(mean_test(ar1(rng, 40, 0.5)).p_value < 0.05 for _ in range(2000))
    assert rejections / 2000 < 0.075


def test_betting_is_valid_and_decides() -> None:
    rng = np.random.default_rng(2)
    crossed = sum(np.max(betting_log_e(rng.random(200) < 0.3, 0.3)) >= math.log(20)
                  for _ in range(300))
    assert crossed / 300 <= 0.05
    assert betting_log_e(np.full(200, 0.6), 0.5)[-1] > math.log(100)
    assert betting_log_e(np.full(200, 0.4), 0.5, side="lower")[-1] > math.log(100)
    x = rng.random(400) * 0.4 + 0.3
    lo, hi = betting_cs(x, 0.05, grid=200)
    assert lo < 0.5 < hi and hi - lo < 0.1


def test_diagnostics_flag_what_is_high() -> None:
    d = diagnose(40, 0.55, 8.2)
    assert d.high == ("lag1", "overdispersion")
    assert "lag-1 autocorrelation +0.55 (high)" in d.text() and "bursts" in d.text()
    assert diagnose(40, 0.05, math.nan).high == ()
    assert diagnose(40, math.nan).to_dict()["lag1"] is None
