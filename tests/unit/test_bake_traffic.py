"""Calibration of the bake as tests: seeded simulated bakes (bench/traffic_models.py
``bake_traffic``: AR(1) latency, bursty errors, a surge after the swap) judged by
tasks/bake.py exactly as the bake calls it. Fast versions of ``bench/judge_bake.py``.

Margins are one-sided binomial bounds recomputed for each number of runs
(tests/unit/rates.py): a rule whose false rollbacks are at the goal passes them, one several
times above it does not. The seeds are fixed, so each figure is one number; the bounds say
what it must be.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.judge_bake import (
    BEFORE,
    first_breach,
    first_breach_before,
    policy_for,
    simulate,
    windows_of,
)
from bench.traffic_models import bake_traffic, bursty_errors, queueing_factor
from modelship.policy import BakePolicy
from tasks.bake import judge_windows, load_departure
from tests.unit.rates import most_rejections


def _hits(case: str, reps: int, policy: BakePolicy | None = None,
          **update: float) -> int:
    """How many of ``reps`` seeded bakes of ``case`` rolled back (after issue 17)."""
    chosen = policy_for(case, policy)
    if update:
        chosen = chosen.model_copy(update=update)
    hits = 0
    for rep in range(reps):
        reference, windows = windows_of(simulate(case, rep, chosen), chosen.window_s)
        hits += first_breach(reference, windows, chosen) is not None
    return hits


def _before(case: str, reps: int, **update: float) -> float:
    chosen = policy_for(case, BEFORE).model_copy(update=update)
    return sum(first_breach_before(simulate(case, rep, chosen), chosen) is not None
               for rep in range(reps)) / reps


def test_the_surge_generator_is_the_issues() -> None:
    """Traffic ×2 makes every request ×1.5 slower, and the rate doubles after the swap."""
    assert float(queueing_factor(2.0) / queueing_factor(1.0)) == pytest.approx(1.5)
    traffic = bake_traffic(np.random.default_rng(0), reference=3, windows=4, load_after=2.0)
    assert list(traffic.rate_rps) == [40.0] * 3 + [80.0] * 4
    before, after = np.concatenate(traffic.latency_ms[:3]), np.concatenate(
        traffic.latency_ms[3:])
    assert 1.3 < np.median(after) / np.median(before) < 1.7


def _bursty_errors_loop(rng: np.random.Generator, n: int, rate: float,
                        mean_burst: float) -> np.ndarray:
    """The burst chain request by request, as bench/traffic_models.py first wrote it."""
    stay = 1.0 - 1.0 / mean_burst
    start = rate / (mean_burst * (1.0 - rate))
    u = rng.random(n)
    out = np.zeros(n, dtype=bool)
    state = bool(rng.random() < rate)
    for i in range(n):
        state = bool(u[i] < (stay if state else start))
        out[i] = state
    return out


@pytest.mark.parametrize(("rate", "mean_burst"), [
    (0.001, 8.0), (0.01, 2.0), (0.3, 3.0), (0.2, 50.0), (0.9, 1.5), (0.5, 1.01)])
def test_bursty_errors_is_the_request_by_request_chain(rate: float, mean_burst: float) -> None:
    """The vectorised burst generator draws the same failures as the chain it replaced
    (the last two rows are a rate near 1, where it still walks the chain)."""
    for seed in range(5):
        for n in (1, 9, 4000):
            fast = bursty_errors(np.random.default_rng(seed), n, rate, mean_burst)
            slow = _bursty_errors_loop(np.random.default_rng(seed), n, rate, mean_burst)
            assert fast.dtype == bool and np.array_equal(fast, slow), (seed, n)
    many = bursty_errors(np.random.default_rng(0), 200_000, 0.001, 8.0)
    assert 0.0005 < many.mean() < 0.002  # the stationary share is the rate


def test_first_breach_is_judge_windows_after_every_window() -> None:
    """The simulator's shortcut gives the same first breach as calling the judge after
    every window, as the bake does."""
    for case, reps in (("latency_x1.3_120s", 6), ("surge_x2_10s", 3),
                       ("errors_2x_10min", 2)):
        policy = policy_for(case).model_copy(update={"duration_s": 60.0})
        for rep in range(reps):
            reference, windows = windows_of(simulate(case, rep, policy), policy.window_s)
            slow = None
            for i in range(len(windows)):
                verdict = judge_windows(windows[:i + 1], reference, policy)
                if verdict.outcome == "breach":
                    slow = (i + 1, "errors" if "error rate" in verdict.reason else "latency")
                    break
            assert first_breach(reference, windows, policy) == slow, (case, rep)


def test_a_surge_after_the_swap_never_rolls_back_a_good_model() -> None:
    """Traffic ×2 right after the swap (latency ×1.5 from queueing): the old rule rolled
    back most 10-s bakes; now the latency rules hold and nothing rolls back."""
    reps = 100
    assert _before("surge_x2_10s", 30) > 0.3  # the defect the generator reproduces
    assert _hits("surge_x2_10s", reps) <= most_rejections(0.01, reps)
    assert _hits("surge_x2_10s", 40, duration_s=600.0) <= most_rejections(0.01, 40)


def test_a_surge_inside_the_load_band_is_judged_and_still_not_rolled_back() -> None:
    """A +15% rate (inside ±20%) costs +5% latency here (M/M/1 at 25% busy): judged, and
    far from the +25% tolerance."""
    reps = 60
    policy = BakePolicy()
    hits = 0
    for rep in range(reps):
        chosen = policy_for("surge_x2_10s", policy).model_copy(update={"duration_s": 120.0})
        rng = np.random.default_rng(np.random.SeedSequence([99, rep]))
        traffic = bake_traffic(rng, reference=15, windows=60, probe_rps=80.0,
                               load_after=1.15)
        reference, windows = windows_of(traffic, chosen.window_s)
        found = first_breach(reference, windows, chosen)
        hits += found is not None
    assert hits <= most_rejections(0.01, reps)


def test_ar1_dependence_does_not_make_false_rollbacks() -> None:
    """An unchanged model whose per-request latency is AR(1) with φ = 0.9 (and 0.5)."""
    reps = 80
    assert _hits("ar1_0.9_10s", reps, duration_s=120.0) <= most_rejections(0.01, reps)
    policy = policy_for("ar1_0.9_10s")
    hits = 0
    reps = 60
    for rep in range(reps):
        rng = np.random.default_rng(np.random.SeedSequence([55, rep]))
        traffic = bake_traffic(rng, reference=15, windows=60, probe_rps=80.0, phi=0.5)
        chosen = policy.model_copy(update={"duration_s": 120.0})
        hits += first_breach(*windows_of(traffic, 2.0), chosen) is not None
    assert hits <= most_rejections(0.01, reps)


def test_errors_at_budget_in_bursts_rarely_roll_back() -> None:
    """Errors exactly at the budget, in bursts of mean 8 requests, 10-minute bakes: the
    old per-request e-process rolled back a large share; the per-window bet does not."""
    reps = 60
    update = {"duration_s": 600.0, "latency_quantiles": []}
    assert _before("errors_budget_bursts8_1h", 20, duration_s=600.0) > 0.15
    assert _hits("errors_budget_bursts8_1h", reps, **update) <= most_rejections(0.01, reps)


def test_thirty_percent_slower_is_caught_within_120_s() -> None:
    reps = 60
    assert _before("latency_x1.3_120s", 20) < 0.1  # the old rule's real tolerance
    assert _hits("latency_x1.3_120s", reps) >= 0.9 * reps


def test_errors_at_twice_the_budget_are_caught_within_10_minutes() -> None:
    reps = 40
    assert _hits("errors_2x_10min", reps, latency_quantiles=[]) >= 0.9 * reps


def test_a_much_slower_version_is_caught_in_the_first_looks() -> None:
    policy = policy_for("latency_x1.3_120s")
    found = []
    for rep in range(20):
        rng = np.random.default_rng(np.random.SeedSequence([77, rep]))
        traffic = bake_traffic(rng, reference=15, windows=60, probe_rps=80.0, scale=1.5)
        hit = first_breach(*windows_of(traffic, 2.0), policy)
        assert hit is not None and hit[1] == "latency"
        found.append(hit[0])
    assert max(found) <= 4  # the look at 2 or 4 windows: ≤ 8 s after the swap


def test_a_load_step_the_reference_shares_is_not_blamed_on_the_new_version() -> None:
    """Traffic ×2 from the reference's third window on: the reference mostly saw the new
    load, the bake is judged against it (inside the band) and rolls nothing back."""
    reps = 60
    policy = policy_for("latency_x1.3_120s")
    hits = held = 0
    for rep in range(reps):
        rng = np.random.default_rng(np.random.SeedSequence([88, rep]))
        traffic = bake_traffic(rng, reference=15, windows=60, probe_rps=80.0,
                               load_after=2.0, load_at=-13)
        reference, windows = windows_of(traffic, 2.0)
        hits += first_breach(reference, windows, policy) is not None
        held += sum(load_departure(w, reference, policy) is not None for w in windows)
    assert held == 0  # the reference covers the new load: judged, not held
    assert hits <= most_rejections(0.01, reps)
