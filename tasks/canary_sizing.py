"""How many requests the canary runs, and how the sequential watch shares each rule's α
(pure).

- :func:`plan_rules`: requests per version, the max over the blocking rules of
  :func:`tasks.gates.required_samples` at each rule's own α, grown by
  :func:`watch_plan_factor` for the watched rules when the sequential watch spends
  :data:`SEQUENTIAL_SHARE` of their α (so the fixed test loses no power to the watch).
  ``promote --dry-run`` states the same plan.
- :func:`required_samples`: the same, sized from the records measured so far (the
  baseline's own latencies and error rate replace the lognormal assumption).
- :func:`sequential_config` and :func:`spend_alpha`: the watch's rules and the fixed
  gates' α, so the rule set's family-wise α (:func:`tasks.gates.family_alpha`) is spent
  once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import TYPE_CHECKING, TypeGuard

import numpy as np
from scipy import stats

from modelship.policy import ExactRateRule, GateRule, MannWhitneyRule, QuantileRule
from tasks.agreement import BASELINE
from tasks.gates import required_samples as rule_samples
from tasks.gates import tail_reference_floor
from tasks.sequential import SequentialConfig, WatchRule

if TYPE_CHECKING:  # annotations only: the load generator's package imports its engine
    from modelship.loadgen import RequestRecord

__all__ = ["SEQUENTIAL_SHARE", "plan_rules", "required_samples", "sequential_config",
           "spend_alpha", "watch_plan_factor", "watched"]


SEQUENTIAL_SHARE = 0.2
"""Share of each watched rule's α that the sequential watch spends; the fixed test gets the
rest, so the rule set's family-wise α (:func:`tasks.gates.family_alpha`) is spent once. A
fifth: the watch is for clear regressions, which it stops at any level. The fixed test at
80% of α runs on a plan grown by :func:`watch_plan_factor` (:func:`plan_rules`), so it
alone catches at least as often as the watch-off test wherever that one catches half the
time: a candidate at 2× the error budget is caught at least as often with the watch on
(bench/judge.py, ``errors_2x_*``)."""


_QUANTILES = {"latency_p50_ms": 0.5, "latency_mean_ms": 0.5, "latency_p90_ms": 0.9,
              "latency_p95_ms": 0.95, "latency_p99_ms": 0.99}


def watched(rule: GateRule) -> TypeGuard[MannWhitneyRule | QuantileRule | ExactRateRule]:
    """Whether the sequential watch judges a rule too (blocking latency and error rules)."""
    return not rule.dry_run and rule.test in ("mann_whitney", "quantile", "exact_rate")


def sequential_config(rules: Sequence[GateRule], *,
                      share: float = SEQUENTIAL_SHARE) -> SequentialConfig:
    """The sequential watch's rules from the policy's gates (pure): one per watched rule,
    with its own tolerance, effect and power, and ``share`` of its α.

    Latency rules watch their quantile (0.5 for p50 and mean) within ``max_increase_pct``;
    ``effect`` (default: the tolerance itself) centres the regression prior, and
    ``power`` sets the early pass: a rule is shown within tolerance when its confidence
    sequence at ``power`` excludes everything beyond it, so a candidate exactly at the
    tolerance passes early at most ``1 - power`` of the time. The scalar fields summarise
    (smallest tolerance and budget, total α) for messages and older callers.
    """
    base = SequentialConfig()
    watch: list[WatchRule] = []
    for rule in (r for r in rules if watched(r)):
        if rule.test == "exact_rate":
            budget = float(rule.max_rate or 0.0)
            effect = float(rule.effect if rule.effect is not None else budget or 1e-3)
            watch.append(WatchRule(rule.name, "errors", budget, rule.alpha * share,
                                   rule.power, effect))
        else:
            pct = float(rule.max_increase_pct or base.max_increase_pct)
            watch.append(WatchRule(rule.name, "latency", pct, rule.alpha * share, rule.power,
                                   float(rule.effect if rule.effect is not None else pct),
                                   _QUANTILES.get(rule.metric, 0.5)))
    latency = [w for w in watch if w.kind == "latency"]
    errors = [w for w in watch if w.kind == "errors"]
    return SequentialConfig(
        alpha=sum(w.alpha for w in watch) if watch else base.alpha,
        max_increase_pct=min([w.tolerance for w in latency] or [base.max_increase_pct]),
        max_error_rate=min([w.tolerance for w in errors] or [base.max_error_rate]),
        rules=tuple(watch),
    )


def spend_alpha(rules: Sequence[GateRule], *, share: float = SEQUENTIAL_SHARE
                ) -> list[GateRule]:
    """The fixed gates when the sequential watch runs too (pure): every watched rule keeps
    ``1 - share`` of its α (the watch spends the rest), so the family-wise α is spent once.
    The canary plans its load for them with :func:`plan_rules` (``share``), so the fixed
    tests lose no power to the watch."""
    return [r.model_copy(update={"alpha": r.alpha * (1.0 - share)}) if watched(r) else r
            for r in rules]


def watch_plan_factor(alpha: float, share: float) -> float:
    """Sample-size factor of a watched rule's fixed test when the watch spends ``share`` of
    its α: ``(z_{(1-share)α} / z_α)²`` (1 without a watch).

    Why this and not the plan at the smaller α: under the normal approximation the fixed
    test's power is ``Φ(δ a - z)`` with ``a ∝ √n``. With ``a_on = a_off · z_on / z_α``
    the watch-on margin is the watch-off margin scaled by ``z_on / z_α > 1``:
    ``δ a_on - z_on = (z_on / z_α)(δ a_off - z_α)``, so wherever the watch-off test catches
    a candidate at least half the time, the watch-on fixed test alone catches it at least
    as often, and the watch's own early failures only add. (Sizing at the smaller α for
    the rule's ``effect`` keeps the power there only: below it, e.g. at 2× the error
    budget, the watch-on canary was caught less often.) The factor is ≥ the ratio of the
    plans at the two α, so the rule's stated power at its effect holds too.
    """
    if not 0 < share < 1 or not 0 < alpha < 0.5:
        return 1.0
    z_off = NormalDist().inv_cdf(1.0 - alpha)
    z_on = NormalDist().inv_cdf(1.0 - alpha * (1.0 - share))
    return (z_on / z_off) ** 2


def plan_rules(rules: Sequence[GateRule], *, baseline_latency_ms: np.ndarray | None,
               baseline_error_rate: float, floor: int, share: float = 0.0) -> int:
    """Requests per version the canary runs for (pure): the max over blocking rules of
    :func:`tasks.gates.required_samples` at the rule's own α, times
    :func:`watch_plan_factor` for the watched rules when the sequential watch spends
    ``share`` of their α (``rules`` are the policy's, not :func:`spend_alpha`'s)."""
    sizes = [floor]
    for rule in rules:
        if rule.dry_run:
            continue
        n = rule_samples(rule, baseline_latency_ms=baseline_latency_ms,
                         baseline_error_rate=baseline_error_rate, floors=False)
        if share and watched(rule):  # the power plan grows, not the floors
            grown = math.ceil(n * watch_plan_factor(rule.alpha, share))
            if rule.test == "exact_rate":
                grown = _rate_dominance_n(float(rule.max_rate or 0.0), rule.alpha, share, n,
                                          grown)
            n = grown
        sizes.append(max(n, tail_reference_floor(rule)))
    return int(max(sizes))


@functools.lru_cache(maxsize=256)
def _rate_dominance_n(max_rate: float, alpha: float, share: float, n_off: int,
                      start: int) -> int:
    """The exact binomial test's own version of :func:`watch_plan_factor` (pure).

    Errors are few, so the normal approximation misjudges the exact test's tail: the
    smallest n from ``start`` up (steps of 1%) at which the test at ``(1 - share) α``
    has at least the power of the test at ``α`` with ``n_off`` at every error rate where
    the latter catches half the candidates or more (up to 99.9%)."""
    if not 0 < max_rate < 1:
        return start

    def power(n: int, level: float, rates: np.ndarray) -> np.ndarray:
        # tasks.gates.rate_power's critical count, vectorised over the rates
        c = int(stats.binom.isf(level, n, max_rate))
        c = c if stats.binom.sf(c, n, max_rate) < level else c + 1
        return np.asarray(stats.binom.sf(c, n, rates), dtype=float)

    rates = max_rate * np.exp(np.linspace(0.0, math.log(min(50.0, 0.5 / max_rate)), 400))[1:]
    off = power(n_off, alpha, rates)
    keep = (off >= 0.5) & (off <= 0.999)
    n = start
    for _ in range(60):
        if np.all(power(n, alpha * (1.0 - share), rates[keep]) >= off[keep]):
            return n
        n = math.ceil(n * 1.01)
    return n


def required_samples(rules: Sequence[GateRule], records: Sequence[RequestRecord], *,
                     paired: bool, floor: int, share: float = 0.0) -> int:
    """Answered requests per version the gates need, sized from what was measured so far.

    The latency tests are sized from the baseline's own latencies (the candidate's on a
    first release), the error-rate test from the baseline's error rate; without records
    the gates' lognormal default applies. Never below the policy's ``floor``. With the
    sequential watch on (``share`` > 0), watched rules plan for their fixed test at the α
    the watch leaves (:func:`plan_rules`).
    """
    arm = BASELINE if paired else None
    own = [r for r in records if r.tag == arm]
    latency = np.asarray([r.latency_ms for r in own if r.ok], dtype=float)
    error_rate = sum(1 for r in own if not r.ok) / len(own) if own and paired else 0.0
    return plan_rules(rules, baseline_latency_ms=latency if latency.size >= 2 else None,
                      baseline_error_rate=error_rate, floor=floor, share=share)
