"""The always-valid sequential canary: its e-processes and its decisions, seeded."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from modelship.measurements import MeasurementError
from tasks.sequential import SequentialCanary, SequentialConfig, log_e_above, log_e_below


def draw(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    return scale * (2.0 * np.exp(0.3 * rng.standard_normal(n))
                    + (rng.random(n) < 0.05) * rng.exponential(4.0, n))


@pytest.mark.parametrize(("theta0", "theta"), [(0.5, 0.5), (0.5, 0.4), (0.001, 0.001),
                                               (0.001, 0.0005), (0.2, 0.2)])
@pytest.mark.parametrize("n", [1, 10, 200])
def test_the_mixture_is_a_test_martingale_under_the_null(theta0: float, theta: float,
                                                         n: int) -> None:
    """E[E_n] ≤ 1 for every θ ≤ θ0, summed exactly over the binomial (Ville needs it)."""
    ks = np.arange(n + 1)
    terms = stats.binom.logpmf(ks, n, theta) + np.array(
        [log_e_above(int(k), n, theta0) for k in ks])
    expectation = math.exp(float(special.logsumexp(terms)))
    assert expectation <= 1.0 + 1e-9
    if theta == theta0:
        assert expectation == pytest.approx(1.0, rel=1e-6)  # a martingale at the boundary


def test_the_e_values_stay_finite_in_log_space() -> None:
    assert math.isfinite(log_e_above(10**6, 10**7, 0.001))
    assert log_e_above(0, 10**7, 0.001) < 0
    assert log_e_above(0, 0, 0.5) == 0.0
    assert math.isfinite(log_e_below(0, 10**6, 0.005))


def run(seed: int, *, scale: float = 1.0, err: float = 0.0, base_err: float = 0.0,
        batch: int = 100, max_n: int = 2000) -> tuple[str, int]:
    rng = np.random.default_rng(seed)
    watch = SequentialCanary(reference_ms=draw(rng, 400))
    n = 0
    while n < max_n:
        ce, be = int(rng.binomial(batch, err)), int(rng.binomial(batch, base_err))
        decision = watch.update(draw(rng, batch - be), draw(rng, batch - ce, scale),
                                candidate_errors=ce, baseline_errors=be)
        n += batch
        if decision.status != "continue":
            return decision.status, n
    return "continue", n


def test_aa_false_detection_over_all_looks_stays_below_alpha() -> None:
    """Looking after every batch of 50, up to 2000 requests: 40 looks per canary."""
    outcomes = [run(seed, batch=50)[0] for seed in range(100)]
    assert outcomes.count("failed") / len(outcomes) <= 0.01 + 3 * math.sqrt(0.01 / 100)
    assert outcomes.count("passed") > 0  # an A/A canary can stop early as clearly fine


@pytest.mark.parametrize(("kw", "limit"), [({"scale": 1.5}, 400), ({"err": 0.02}, 600)])
def test_clear_regressions_stop_early(kw: dict[str, float], limit: int) -> None:
    results = [run(seed, **kw) for seed in range(30)]
    assert all(status == "failed" for status, _ in results), results
    assert float(np.median([n for _, n in results])) <= limit


def test_both_arms_failing_alike_is_not_the_candidate() -> None:
    status, _ = run(3, err=0.3, base_err=0.3)
    assert status == "inconclusive"


def test_decision_names_the_rule_and_is_json_ready() -> None:
    rng = np.random.default_rng(0)
    watch = SequentialCanary(SequentialConfig(), reference_ms=draw(rng, 400))
    decision = watch.update(draw(rng, 300), draw(rng, 300, 2.0))
    assert decision.status == "failed"
    assert decision.reason.startswith("latency_p50: regression certain after 1 looks")
    document = decision.to_dict()
    assert document["samples"] == {"candidate": 300, "baseline": 300}
    assert {r["name"] for r in document["rules"]} == {"error_rate", "latency_p50",
                                                      "latency_p99"}


def test_without_a_reference_the_first_batch_calibrates_and_is_not_judged() -> None:
    rng = np.random.default_rng(1)
    watch = SequentialCanary()
    first = watch.update(draw(rng, 300), draw(rng, 300, 3.0))
    assert first.status == "continue"
    assert watch.update(draw(rng, 300), draw(rng, 300, 3.0)).status == "failed"


def test_broken_latencies_are_refused() -> None:
    with pytest.raises(MeasurementError, match="negative"):
        SequentialCanary().update(np.array([1.0, -2.0]), np.array([1.0, 1.0]))
