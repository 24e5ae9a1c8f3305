"""Bounds for the seeded calibration tests: how many of ``reps`` simulated runs a rule may
reject (or must catch) and still be what it claims.

A claim "false rejections ≤ α" is tested as the one-sided binomial test of H0 "the rate is
α": the observed count must not exceed the count a rule at exactly α passes with
probability ``1 - risk``. The bound is recomputed for the number of runs, so fewer runs
give a looser (never a vacuous) bound, and a rule whose real rate is several times α fails.
The seeds are fixed, so each test's figure is one number: ``risk`` is the one-time chance
that a correct rule's seeded figure lands above the bound, not a flake rate.
"""

from __future__ import annotations

from scipy import stats

RISK = 0.01
"""The chance a correct rule's seeded count is refused (one-sided binomial test level)."""


def most_rejections(rate: float, reps: int, risk: float = RISK) -> int:
    """The most of ``reps`` runs a rule whose true rejection rate is ``rate`` rejects,
    except with probability ``risk``: the binomial ``1 - risk`` quantile (smaller than
    ``reps``, so a rule that rejects every run fails)."""
    bound = int(stats.binom.ppf(1.0 - risk, reps, rate))
    if bound >= reps:
        raise ValueError(f"{reps} runs cannot show a rate of {rate}: use more runs")
    return bound
