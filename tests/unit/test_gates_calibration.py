"""Calibration of the default gates by seeded simulation: error rates, not single cases.

Each test draws seeded canaries and checks a rate against a bound with a binomial margin
(three standard errors), so a correct rule never flakes and a wrong one (the old judge's
p99 rule, its error rule) fails. The seeds are fixed, so each rate is one number; where a
test's docstring gives a probability, it is the one-time chance that a rule of the stated
rate lands on the other side of the bound. The number of canaries is sized per test from
the bound it asserts (the latency judge costs ~25-80 ms of CPU per canary): the large
runs, with 95% intervals, are in ``bench/judge.py``; these stay under ~15 s of CPU in all.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import GateRule, default_gates, gate_rule
from tasks.gates import Verdict, judge, rate_power, required_samples

REPS = 200
AA_REPS = 100
"""Identical arms: at most 4 of 100 may fail (:func:`upper` of α = 0.01). A rule at α fails
more than 4 of 100 with probability 0.3 %; one at 10 × α passes with probability 2.4 %.
(200 drew 0 false failures for every default rule.)"""


def draw(rng: np.random.Generator, n: int, *, scale: float = 1.0, tail_scale: float = 1.0,
         body_scale: float = 1.0) -> np.ndarray:
    """Lognormal body (median 2 ms) plus a 5% exponential tail (mean 4 ms), in ms."""
    body = body_scale * 2.0 * np.exp(0.3 * rng.standard_normal(n))
    tail = (rng.random(n) < 0.05) * rng.exponential(4.0 * tail_scale, n)
    return scale * (body + tail)


def server_intervals(rng: np.random.Generator, ratio: float, k: int = 30,
                     sd: float = 0.08) -> list[dict[str, dict[str, float]]]:
    """Per-second Triton figures: baseline ~500 µs, candidate ``ratio`` × it, noisy."""
    base = 500.0 * np.exp(rng.normal(0.0, sd, k))
    cand = ratio * 500.0 * np.exp(rng.normal(0.0, sd, k))
    return [{"candidate": {"us": 100 * c, "n": 100.0}, "baseline": {"us": 100 * b, "n": 100.0}}
            for c, b in zip(cand, base, strict=True)]


def canary(c: np.ndarray, b: np.ndarray, *, c_err: int = 0, b_err: int = 0,
           server: tuple[float, float] = (500.0, 500.0),
           requests: int | None = None,
           intervals: list[dict[str, dict[str, float]]] | None = None) -> CanarySnapshot:
    """A snapshot; ``requests`` overrides the counts (error-rate cases skip the latencies)."""
    cand = ArmMeasurements(7, c, requests or c.size + c_err, c_err, 100.0, 20.0, server[0])
    base = ArmMeasurements(6, b, requests or b.size + b_err, b_err, 100.0, 20.0, server[1])
    return CanarySnapshot("fraud", cand, base, agreement=1.0, agreement_samples=c.size,
                          window_s=30.0, extra={"server_intervals": intervals or []})


def fail_rate(rule: GateRule, make: object, reps: int = REPS) -> float:
    failed = 0
    for rep in range(reps):
        rng = np.random.default_rng(np.random.SeedSequence([zlib.crc32(rule.name.encode()), rep]))
        snapshot = make(rng)  # type: ignore[operator]
        failed += judge(snapshot, rule, min_samples=1).verdict is Verdict.FAILED
    return failed / reps


def upper(rate: float, reps: int = REPS) -> float:
    """``rate`` plus three binomial standard errors (and one count)."""
    return rate + 3 * math.sqrt(rate * (1 - rate) / reps) + 1 / reps


GATES = {g.name: g for g in default_gates()}


@pytest.mark.parametrize("name", list(GATES))
def test_aa_false_rollbacks_stay_below_alpha(name: str) -> None:
    """Bound and its error probabilities: :data:`AA_REPS`."""
    rule = GATES[name]
    n = 3200  # the p99 rule needs 30 baseline requests above the p99

    def aa(rng: np.random.Generator) -> CanarySnapshot:
        c_err, b_err = rng.binomial(n, 0.0005, 2)
        return canary(draw(rng, n - c_err), draw(rng, n - b_err), c_err=int(c_err),
                      b_err=int(b_err), server=tuple(rng.normal(500.0, 10.0, 2)),
                      intervals=server_intervals(rng, 1.0))

    # A threshold rule has no α: deterministic, an identical candidate never fails it.
    alpha = 0.0 if rule.test == "threshold" else min(rule.alpha, 0.01)
    assert fail_rate(rule, aa, AA_REPS) <= upper(alpha, AA_REPS)
    # Every default rule reached a verdict (no vacuous pass through "inconclusive").
    rng = np.random.default_rng(0)
    assert judge(aa(rng), rule, min_samples=1).verdict is Verdict.PASSED


@pytest.mark.parametrize("metric", ["latency_p50_ms", "latency_p99_ms", "latency_p95_ms"])
def test_exactly_at_the_tolerance_fails_about_alpha(metric: str) -> None:
    """C is P scaled by exactly the tolerance (1.1): the boundary of H0.

    150 canaries: at most 16 may fail (:func:`upper` of 0.05), at least 1. A rule at α =
    0.05 fails more than 16 with probability 0.1 %; one that fails 2.7 % of them, as these
    rules do (250 drew 7, 6 and 6 for p50, p99 and p95), fails none with probability 1.6 %.
    A rule that never fails at the boundary fails this test, and one at 3 × α (0.15) passes
    the bound with probability 8 %."""
    rule = gate_rule(name=f"at-{metric}", metric=metric, max_increase_pct=10.0, alpha=0.05)
    n = 3200 if metric == "latency_p99_ms" else 1000

    def at_tolerance(rng: np.random.Generator) -> CanarySnapshot:
        return canary(draw(rng, n, scale=1.1), draw(rng, n))

    rate = fail_rate(rule, at_tolerance, reps=150)
    assert rate <= upper(0.05, 150)
    # Not a test that never fails: at the boundary it fails close to α of the time (a
    # little under it at p99, where ~10 exceedances per arm make Fisher's test discrete).
    assert rate >= 0.005, rate


def test_server_rule_at_the_tolerance_fails_about_alpha() -> None:
    rule = GATES["server_latency"].model_copy(update={"alpha": 0.05})

    def at_tolerance(rng: np.random.Generator) -> CanarySnapshot:
        return canary(draw(rng, 50), draw(rng, 50), requests=2000,
                      intervals=server_intervals(rng, 1.1))

    rate = fail_rate(rule, at_tolerance, reps=300)
    assert 0.015 <= rate <= upper(0.05, 300), rate

    def regression(rng: np.random.Generator) -> CanarySnapshot:
        return canary(draw(rng, 50), draw(rng, 50), requests=2000,
                      intervals=server_intervals(rng, 1.3))

    assert fail_rate(GATES["server_latency"], regression) >= 0.95 - 3 * math.sqrt(
        0.05 * 0.95 / REPS)


def test_error_rule_never_exceeds_alpha_within_budget_at_any_n() -> None:
    """Exact: the size at the budget, for every n from 1 to 20,000 (the old rule: 0.49)."""
    ns = np.arange(1, 20_001)
    for budget in (0.001, 0.01):
        size = rate_power(ns, budget, budget, 0.05)
        assert float(size.max()) <= 0.05
        inside = rate_power(ns, budget, 0.8 * budget, 0.05)
        assert float(inside.max()) <= 0.05


def test_error_rule_size_by_simulation_with_a_perfect_baseline() -> None:
    rule = GATES["error_rate"]
    n = 13_541

    def at_budget(rng: np.random.Generator) -> CanarySnapshot:
        k = int(rng.binomial(n, 0.001))
        return canary(draw(rng, 50), draw(rng, 50), c_err=k, b_err=0, requests=n)

    assert fail_rate(rule.model_copy(update={"name": "budget"}), at_budget) <= upper(0.05)


def test_error_rule_power_for_half_a_percent_against_a_clean_baseline() -> None:
    assert float(rate_power(2600, 0.001, 0.005, 0.05)[0]) >= 0.95
    plan = required_samples(GATES["error_rate"].model_copy(update={"effect": 0.004}))
    assert plan <= 2600
    rule = GATES["error_rate"]

    def regression(rng: np.random.Generator) -> CanarySnapshot:
        k = int(rng.binomial(plan, 0.005))
        return canary(draw(rng, 50), draw(rng, 50), c_err=k, requests=plan)

    assert fail_rate(rule, regression) >= 0.95 - 3 * math.sqrt(0.05 * 0.95 / REPS)


@pytest.mark.parametrize("pb", [0.0, 0.01, 0.1, 0.5])
def test_error_plan_reaches_its_power_for_any_baseline_rate(pb: float) -> None:
    rule = gate_rule(name="e", metric="error_rate", max_rate=0.001, power=0.9, effect=0.04)
    n = required_samples(rule, baseline_error_rate=pb)
    p1 = max(0.001, pb) + 0.04

    def worse(rng: np.random.Generator) -> CanarySnapshot:
        k, k0 = int(rng.binomial(n, p1)), int(rng.binomial(n, pb))
        return canary(draw(rng, 20), draw(rng, 20), c_err=k, b_err=k0, requests=n)

    assert fail_rate(rule, worse) >= 0.9 - 3 * math.sqrt(0.1 * 0.9 / REPS), n


@pytest.mark.parametrize(
    ("kind", "fails_typical", "fails_tail"),
    [("tail-only", False, True), ("body-only", True, False), ("mixed", True, True)],
)
def test_power_follows_the_statistic_each_rule_names(kind: str, fails_typical: bool,
                                                     fails_tail: bool) -> None:
    """Tail-only: p99 ×1.75, p50 the same. Body-only: body +30%, tail shorter (p99 ≤ P's).
    Mixed: both. Each rule at the sample size the planner asks for on this baseline.

    20 canaries per rule: "fails" is at least 18 of 20, "does not" at most 1 of 20 (60 drew
    60 of 60 and 0 of 60 in every case). A rule with power 0.99 is refused with probability
    0.1 %, one with power 0.5 passes with probability 0.02 % (0.8: 21 %); a rule that
    fails 1 % of them when it should not is refused with probability 1.7 %, one that fails
    30 % passes with probability 0.8 %."""
    p50, p99 = GATES["latency_p50"], GATES["latency_p99"]
    ref = draw(np.random.default_rng(99), 4000)
    n = max(required_samples(p99, baseline_latency_ms=ref), 1000)
    shapes = {"tail-only": {"tail_scale": 2.2}, "body-only": {"body_scale": 1.3,
                                                              "tail_scale": 0.6},
              "mixed": {"body_scale": 1.3, "tail_scale": 2.2}}

    def regression(rng: np.random.Generator) -> CanarySnapshot:
        return canary(draw(rng, n, **shapes[kind]), draw(rng, n))

    typical = fail_rate(p50, regression, reps=20)
    tail = fail_rate(p99, regression, reps=20)
    assert (typical >= 0.9) if fails_typical else (typical <= 0.05), typical
    assert (tail >= 0.9) if fails_tail else (tail <= 0.05), tail
