"""Stage 6, gates: judge a canary snapshot against the policy's rules. Pure: no I/O.

Each rule gives one of four verdicts (argo-rollouts' phases, best to worst)::

    passed < inconclusive < error < failed

and the rules combine worst-wins (:func:`combine`). No data is never a pass: None, NaN,
zero requests, an empty latency array or fewer samples than required give
``inconclusive``, with a message that names the likely cause. An exception inside a test
gives ``error``. ``dry_run`` rules are judged and reported, but never block.

The candidate C is judged against the production version P measured at the same time on
the same inputs (the snapshot's ``baseline``), never alone, except by ``threshold`` rules
and the absolute half of ``exact_rate``:

- ``mann_whitney`` (:func:`judge`): one-sided Mann-Whitney U, C against P *scaled by the
  tolerance*, so only a slowdown beyond the tolerance can fail (Kayenta's design, with the
  Hodges-Lehmann estimate reported). Why a scale and not an additive shift: see
  :func:`_judge_latency`.
- ``exact_rate``: an exact binomial test against ``max_rate`` plus Fisher's exact test
  against P; both stay exact with zero errors (kayenta#377). See :func:`_judge_rate`.
- ``threshold``: the point value must lie within ``[min, max]``, bounds inclusive.

The canary sizes its load with :func:`plan_samples` (per rule: effect, α, power) and
passes ``max(plan, policy floor)`` as ``min_samples`` to :func:`evaluate`.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
from scipy import special, stats

from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import LATENCY_METRICS, GateRule, _infer_test

__all__ = [
    "DEFAULT_LOG_SD",
    "GateReport",
    "RuleResult",
    "Verdict",
    "combine",
    "evaluate",
    "hodges_lehmann",
    "judge",
    "markdown_table",
    "metric_value",
    "plan_samples",
    "required_samples",
]

DEFAULT_LOG_SD = 0.5
"""Assumed standard deviation of log latency when no baseline sample is at hand for sizing.

0.5 is a lognormal whose p99 is 3.2 × its median: typical of a CPU model server under load.
"""

_MAX_PLAN = 10_000_000
"""Cap on a computed sample size: beyond it the effect is too small to be worth a canary."""

_PERCENTILES = {"latency_p50_ms": 50.0, "latency_p90_ms": 90.0, "latency_p95_ms": 95.0,
                "latency_p99_ms": 99.0}


class Verdict(StrEnum):
    """Outcome of one rule or of the whole gate stage (argo-rollouts' analysis phases)."""

    PASSED = "passed"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"
    FAILED = "failed"

    @property
    def severity(self) -> int:
        """Rank for worst-wins: failed (3) beats error (2) beats inconclusive (1) beats passed."""
        return _SEVERITY[self]

    def worse(self, other: Verdict) -> Verdict:
        """The worse of two verdicts."""
        return other if other.severity > self.severity else self


_SEVERITY = {Verdict.PASSED: 0, Verdict.INCONCLUSIVE: 1, Verdict.ERROR: 2, Verdict.FAILED: 3}


@dataclass(frozen=True)
class RuleResult:
    """The verdict of one rule, with what it was based on.

    Attributes:
        rule: Rule name from the policy.
        metric: The metric judged (see ``modelship.policy.KNOWN_METRICS``).
        test: ``mann_whitney``, ``exact_rate`` or ``threshold``.
        verdict: The rule's verdict.
        value: The candidate's measured value of the metric (None when unmeasured).
        baseline: The baseline's value of the metric, or None.
        threshold: The bound, for humans (``"≥ 0.98"``, ``"≤ 7.04 ms (…)"``).
        threshold_value: The bound as a number in the metric's unit, when it is one number.
        p_value: p-value of the deciding test (None for threshold rules).
        samples: Samples behind the verdict: (candidate, baseline or None).
        dry_run: Reported but never blocking.
        message: One sentence naming the rule, the measured value and the bound; for an
            inconclusive verdict, the likely cause.
        details: Test-specific figures (Hodges-Lehmann shift and its interval, per-route
            p-values), JSON-ready.
    """

    rule: str
    metric: str
    test: str
    verdict: Verdict
    value: float | None
    baseline: float | None
    threshold: str
    threshold_value: float | None
    p_value: float | None
    samples: tuple[int, int | None]
    dry_run: bool
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def blocking(self) -> bool:
        """Whether this result counts in :func:`combine` (dry-run rules never do)."""
        return not self.dry_run

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (NaN becomes None, so the document stays valid JSON)."""
        return {
            "rule": self.rule, "metric": self.metric, "test": self.test,
            "verdict": str(self.verdict), "value": _finite(self.value),
            "baseline": _finite(self.baseline), "threshold": self.threshold,
            "threshold_value": _finite(self.threshold_value), "p_value": _finite(self.p_value),
            "samples": {"candidate": self.samples[0], "baseline": self.samples[1]},
            "dry_run": self.dry_run, "message": self.message,
            "details": {k: _jsonable(v) for k, v in self.details.items()},
        }


@dataclass(frozen=True)
class GateReport:
    """The gate stage's outcome: the combined verdict and every rule's result.

    Attributes:
        verdict: Worst-wins over the blocking results (see :func:`combine`).
        results: One result per rule, in policy order, dry-run ones included.
        required_samples: Samples per version the rules need (:func:`plan_samples`, sized
            from the measured baseline), so a report can say when a canary ran too short.
    """

    verdict: Verdict
    results: tuple[RuleResult, ...]
    required_samples: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"verdict": str(self.verdict), "required_samples": self.required_samples,
                "results": [r.to_dict() for r in self.results]}


# --------------------------------------------------------------------------------------
# combining


def combine(results: Iterable[RuleResult | Verdict]) -> Verdict:
    """Worst-wins over the blocking results; nothing blocking means inconclusive.

    Dry-run results are skipped (they are reported, never block). An empty set, or one of
    dry-run rules only, is ``inconclusive``: no evidence is never a pass.
    """
    worst: Verdict | None = None
    for item in results:
        if isinstance(item, RuleResult):
            if item.dry_run:
                continue
            item = item.verdict
        worst = item if worst is None else worst.worse(item)
    return Verdict.INCONCLUSIVE if worst is None else worst


def evaluate(snapshot: CanarySnapshot, rules: Sequence[GateRule], *,
             min_samples: int) -> GateReport:
    """Judge every rule and combine the verdicts.

    Args:
        snapshot: What the canary measured.
        rules: The policy's gates, in order.
        min_samples: Samples per version below which a rule is inconclusive; the canary
            passes ``max(policy.canary.min_samples, plan_samples(rules, ...))``.
    """
    results = tuple(judge(snapshot, rule, min_samples=min_samples) for rule in rules)
    base = snapshot.baseline
    try:
        base_lat = _clean_latency(base.latency_ms) if base is not None else None
        if base_lat is not None:
            base_lat = base_lat[np.isfinite(base_lat)]
        base_rate = (base.errors / base.requests if base is not None and base.requests > 0
                     and 0 <= base.errors <= base.requests else 0.0)
        required = plan_samples(rules, baseline_latency_ms=base_lat,
                                baseline_error_rate=base_rate, min_samples=min_samples)
    except (ValueError, TypeError, ArithmeticError):
        # Broken baseline data is already an inconclusive/error verdict; size from the rules.
        required = plan_samples(rules, min_samples=min_samples)
    return GateReport(combine(results), results, required)


# --------------------------------------------------------------------------------------
# judging one rule


def judge(snapshot: CanarySnapshot, rule: GateRule, *, min_samples: int) -> RuleResult:
    """The verdict of one rule on one snapshot; never raises.

    Args:
        snapshot: What the canary measured.
        rule: One gate of the policy.
        min_samples: Samples per version below which the verdict is inconclusive.
    """
    test = rule.test or _infer_test(rule.model_dump())
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            # Degenerate input (empty, constant) is handled explicitly below; a stray
            # RuntimeWarning from numpy/scipy must not turn into an exception under -W error.
            warnings.simplefilter("ignore", RuntimeWarning)
            if test == "mann_whitney":
                return _judge_latency(snapshot, rule, min_samples)
            if test == "exact_rate":
                return _judge_rate(snapshot, rule, min_samples)
            return _judge_threshold(snapshot, rule, min_samples)
    except Exception as exc:  # noqa: BLE001 - a broken test is an `error` verdict, not a crash
        return _result(rule, test, Verdict.ERROR, None, None, "", None, None, (0, None),
                       f"{rule.name}: the {test} test failed on {_arm_name(snapshot)}: "
                       f"{type(exc).__name__}: {exc}")


def metric_value(snapshot: CanarySnapshot, metric: str, *,
                 arm: str = "candidate") -> tuple[float | None, int]:
    """A metric's point value for one arm, and the number of samples behind it.

    Returns ``(None, 0)`` when the metric is not measured; NaN stays NaN (the caller turns
    it into inconclusive). ``agreement`` and ``throughput_ratio`` compare the two arms, so
    they exist only for ``arm="candidate"``.
    """
    measured = snapshot.candidate if arm == "candidate" else snapshot.baseline
    if measured is None:
        return None, 0
    if metric in LATENCY_METRICS:
        lat = np.asarray(measured.latency_ms, dtype=float).ravel()
        if lat.size == 0:
            return None, 0
        if metric == "latency_mean_ms":
            return float(np.mean(lat)), int(lat.size)
        return float(np.percentile(lat, _PERCENTILES[metric])), int(lat.size)
    if metric == "error_rate":
        if measured.requests <= 0:
            return None, 0
        return measured.errors / measured.requests, measured.requests
    if metric == "agreement":
        if arm != "candidate" or snapshot.agreement is None:
            return None, 0
        return float(snapshot.agreement), snapshot.agreement_samples
    if metric == "throughput_ratio":
        base = snapshot.baseline
        cand = snapshot.candidate
        if arm != "candidate" or base is None or cand.throughput_rps is None \
                or base.throughput_rps is None or not base.throughput_rps > 0:
            return None, 0
        return cand.throughput_rps / base.throughput_rps, min(cand.requests, base.requests)
    if metric == "queue_us_mean":
        return measured.queue_us_mean, measured.requests
    if metric == "compute_us_mean":
        return measured.compute_us_mean, measured.requests
    raise ValueError(f"unknown metric {metric!r}")


def _judge_threshold(snapshot: CanarySnapshot, rule: GateRule, min_samples: int) -> RuleResult:
    """Point value within ``[min, max]``, both inclusive: exactly at a bound passes."""
    parts = ([f"≥ {_fmt(rule.metric, rule.min)}"] if rule.min is not None else []) + \
        ([f"≤ {_fmt(rule.metric, rule.max)}"] if rule.max is not None else [])
    bound = " and ".join(parts)
    bound_value = rule.min if rule.max is None else rule.max if rule.min is None else None
    value, n = metric_value(snapshot, rule.metric)
    base_value = (metric_value(snapshot, rule.metric, arm="baseline")[0]
                  if rule.metric not in ("agreement", "throughput_ratio") else None)
    base_n = snapshot.baseline.requests if snapshot.baseline is not None else None

    def result(verdict: Verdict, message: str) -> RuleResult:
        return _result(rule, "threshold", verdict, value, base_value, bound, bound_value,
                       None, (n, base_n), message)

    missing = _missing_reason(snapshot, rule.metric, value, n)
    if missing:
        return result(Verdict.INCONCLUSIVE, f"{rule.name}: {missing}")
    assert value is not None
    if n < min_samples:
        return result(Verdict.INCONCLUSIVE, f"{rule.name}: {_too_few(snapshot, n, min_samples)}")
    shown = _fmt(rule.metric, value)
    if rule.min is not None and value < rule.min:
        return result(Verdict.FAILED, f"{rule.name}: {rule.metric} of {_arm_name(snapshot)} "
                      f"is {shown}, below the minimum {_fmt(rule.metric, rule.min)}")
    if rule.max is not None and value > rule.max:
        return result(Verdict.FAILED, f"{rule.name}: {rule.metric} of {_arm_name(snapshot)} "
                      f"is {shown}, above the maximum {_fmt(rule.metric, rule.max)}")
    return result(Verdict.PASSED, f"{rule.name}: {rule.metric} of {_arm_name(snapshot)} is "
                  f"{shown}, within {bound}")


def _judge_latency(snapshot: CanarySnapshot, rule: GateRule, min_samples: int) -> RuleResult:
    """Mann-Whitney U beyond a tolerance; the Hodges-Lehmann estimate says by how much.

    The tolerance is set where the rule looks: ``tol = max(max_increase_pct % of P's
    metric, min_effect_ms)`` in ms at P's percentile (p99 for ``latency_p99_ms``). It is
    applied as a *scale*: ``r = 1 + tol / P_metric``, and C fails when it is significantly
    slower than ``r × P`` (one-sided U, ``alternative="greater"``, at ``rule.alpha``). So:

    - Exactly ``r × P`` (every percentile, including the judged one, up by exactly the
      tolerance) is at the boundary and passes; a slowdown below ``min_effect_ms`` at the
      judged percentile can never fail, however many samples.
    - The whole distribution carries the evidence, not the ~1% of samples in the tail: a
      +15% slowdown of every request is detected with a few thousand samples, where a test
      on the p99 alone would need a hundred times more. An additive shift of the p99's
      tolerance would instead hide such a slowdown entirely (10% of p99 is ~40% of the
      median for a tailed distribution).
    - A regression confined to the tail (median unchanged, p99 +50%) is diluted; guard the
      tail with an additional ``threshold`` rule on ``latency_p99_ms`` when it matters.

    Kayenta tests against the baseline *shifted* by its tolerance in the same way. The
    reported Hodges-Lehmann estimates are the median pairwise ratio C/P (with its
    distribution-free interval at confidence ``1 - 2·alpha``, whose lower end matches the
    one-sided test) and the median pairwise difference in ms.
    """
    metric = rule.metric
    cand = snapshot.candidate
    base = snapshot.baseline
    pct = float(rule.max_increase_pct or 0.0)
    floor = float(rule.min_effect_ms or 0.0)
    value, n = metric_value(snapshot, metric)
    base_value, m = metric_value(snapshot, metric, arm="baseline")
    tol_text = f"max({pct:g}%, {floor:g} ms)" if floor else f"{pct:g}%"

    def result(verdict: Verdict, message: str, *, threshold: str = f"+{tol_text} vs baseline",
               threshold_value: float | None = None, p: float | None = None,
               details: Mapping[str, Any] | None = None) -> RuleResult:
        return _result(rule, "mann_whitney", verdict, value, base_value, threshold,
                       threshold_value, p, (n, m if base is not None else None), message,
                       details)

    missing = _missing_reason(snapshot, metric, value, n)
    if missing:
        return result(Verdict.INCONCLUSIVE, f"{rule.name}: {missing}")
    if base is None:
        return result(Verdict.INCONCLUSIVE, f"{rule.name}: no baseline to compare against "
                      f"(first release of {snapshot.model}); add a threshold rule on {metric} "
                      "for an absolute bound")
    if base_value is None or math.isnan(base_value):
        return result(Verdict.INCONCLUSIVE, f"{rule.name}: "
                      + _missing_reason(snapshot, metric, base_value, m, arm="baseline"))
    if min(n, m) < min_samples:
        short, have = ("baseline", m) if m < n else ("candidate", n)
        return result(Verdict.INCONCLUSIVE,
                      f"{rule.name}: {_too_few(snapshot, have, min_samples, arm=short)}")
    c = _clean_latency(cand.latency_ms)
    b = _clean_latency(base.latency_ms)
    if not base_value > 0:
        return result(Verdict.INCONCLUSIVE, f"{rule.name}: the baseline's {metric} is "
                      f"{base_value:g} ms; a relative tolerance needs a positive latency")
    tol_ms = max(pct / 100.0 * base_value, floor)
    ratio = 1.0 + tol_ms / base_value
    bound_ms = base_value + tol_ms
    threshold = (f"≤ {bound_ms:.3g} ms: baseline {base_value:.3g} ms + {tol_text} "
                 f"= {tol_ms:.3g} ms (scale ×{ratio:.3f})")
    p = float(stats.mannwhitneyu(c, b * ratio, alternative="greater").pvalue)
    if math.isnan(p):
        return result(Verdict.ERROR, f"{rule.name}: the Mann-Whitney test is undefined on "
                      f"these samples (n={n}, m={m})", threshold=threshold,
                      threshold_value=bound_ms)
    hl_ratio, lo, hi = hodges_lehmann(np.log(c), np.log(b), alpha=rule.alpha)
    hl_ms, _, _ = hodges_lehmann(c, b, alpha=None)
    details = {"tolerance_ms": tol_ms, "tolerance_ratio": ratio,
               "hodges_lehmann_ratio": math.exp(hl_ratio),
               "hodges_lehmann_ratio_ci": [math.exp(lo), math.exp(hi)],
               "ci_confidence": 1 - 2 * rule.alpha, "hodges_lehmann_shift_ms": hl_ms,
               "alpha": rule.alpha}
    how = (f"{metric} {value:.3g} ms vs baseline {base_value:.3g} ms; Hodges-Lehmann "
           f"×{math.exp(hl_ratio):.3f} ({(1 - 2 * rule.alpha):.0%} CI ×{math.exp(lo):.3f}–"
           f"×{math.exp(hi):.3f}, {hl_ms:+.3g} ms)")
    if p < rule.alpha:
        return result(Verdict.FAILED, f"{rule.name}: {_arm_name(snapshot)} is slower than "
                      f"the baseline by more than {tol_text} = {tol_ms:.3g} ms: {how}; "
                      f"Mann-Whitney p={p:.2g} < α={rule.alpha:g}", threshold=threshold,
                      threshold_value=bound_ms, p=p, details=details)
    return result(Verdict.PASSED, f"{rule.name}: {_arm_name(snapshot)} is within {tol_text} "
                  f"= {tol_ms:.3g} ms of the baseline: {how}; Mann-Whitney p={p:.2g} ≥ "
                  f"α={rule.alpha:g}", threshold=threshold, threshold_value=bound_ms, p=p,
                  details=details)


def _judge_rate(snapshot: CanarySnapshot, rule: GateRule, min_samples: int) -> RuleResult:
    """Error rate: exact, so it stays correct with zero errors on either side.

    With C's ``k`` errors in ``n`` requests, P's ``k0`` in ``n0`` and ``max_rate``:

    - **absolute**: exact one-sided binomial test of H0 ``rate ≤ max_rate``; fails when
      ``p < alpha``. It alone controls false rollbacks at ``alpha`` for a candidate at
      ``max_rate``.
    - **against P**: one-sided Fisher exact test that C's rate exceeds P's; fails when
      ``p < alpha`` *and* C's observed rate is above ``max_rate`` (a candidate worse than a
      perfect baseline but still within its budget passes). Fisher conditions on the total
      number of errors, so ``k0 = 0`` is an ordinary table, not a degenerate one.

    Either route fails the rule. Kayenta's Mann-Whitney passes kayenta#377's case (P with
    no errors, C with 0.5%) because the median pairwise difference of 0/1 indicators is 0;
    here, with ``n = n0 = 2000`` and ``max_rate = 0.001``, C's 10 errors give a binomial
    p = 4.6e-5 and a Fisher p = 9.7e-4: failed. Zero errors give p = 1: passed. Exactly
    ``max_rate`` (2/2000) gives p = 0.59: passed.

    Fisher rather than Boschloo: Boschloo is more powerful but maximises over a nuisance
    parameter on every (n+1)×(n0+1) table, far too slow at canary sizes; the binomial
    route makes up the power against a zero baseline.
    """
    cand = snapshot.candidate
    base = snapshot.baseline
    max_rate = float(rule.max_rate if rule.max_rate is not None else 0.0)
    n, k = int(cand.requests), int(cand.errors)
    value = k / n if n > 0 else None
    base_ok = base is not None and base.requests > 0 and 0 <= base.errors <= base.requests
    base_value = base.errors / base.requests if base is not None and base_ok else None
    base_n = base.requests if base is not None else None
    bound = f"≤ {_fmt('error_rate', max_rate)}"

    def result(verdict: Verdict, message: str, p: float | None = None,
               details: Mapping[str, Any] | None = None) -> RuleResult:
        return _result(rule, "exact_rate", verdict, value, base_value, bound, max_rate, p,
                       (n, base_n), message, details)

    if n < 0 or k < 0 or k > n:
        return result(Verdict.ERROR, f"{rule.name}: inconsistent counts for "
                      f"{_arm_name(snapshot)}: {k} errors in {n} requests")
    missing = _missing_reason(snapshot, "error_rate", value, n)
    if missing:
        return result(Verdict.INCONCLUSIVE, f"{rule.name}: {missing}")
    assert value is not None
    if n < min_samples:
        return result(Verdict.INCONCLUSIVE, f"{rule.name}: {_too_few(snapshot, n, min_samples)}")
    p_abs = _binom_greater(k, n, max_rate)
    p_cmp: float | None = None
    if base is not None and base_ok:
        k0, n0 = int(base.errors), int(base.requests)
        p_cmp = float(stats.fisher_exact([[k, n - k], [k0, n0 - k0]],
                                         alternative="greater").pvalue)
    details: dict[str, Any] = {"p_absolute": p_abs, "p_vs_baseline": p_cmp,
                               "alpha": rule.alpha, "errors": k, "requests": n}
    shown = f"{_fmt('error_rate', value)} ({k}/{n})"
    vs = (f"; baseline {_fmt('error_rate', base_value)} ({base.errors}/{base.requests}), "
          f"Fisher p={p_cmp:.2g}" if base is not None and base_value is not None
          and p_cmp is not None else "; no baseline to compare against")
    if p_abs < rule.alpha:
        return result(Verdict.FAILED, f"{rule.name}: error rate of {_arm_name(snapshot)} is "
                      f"{shown}, significantly above {_fmt('error_rate', max_rate)} (exact "
                      f"binomial p={p_abs:.2g} < α={rule.alpha:g}){vs}", p_abs, details)
    if p_cmp is not None and p_cmp < rule.alpha and value > max_rate:
        return result(Verdict.FAILED, f"{rule.name}: error rate of {_arm_name(snapshot)} is "
                      f"{shown}, above {_fmt('error_rate', max_rate)} and significantly worse "
                      f"than the baseline{vs} < α={rule.alpha:g}", p_cmp, details)
    p_shown = min(p_abs, p_cmp) if p_cmp is not None and value > max_rate else p_abs
    return result(Verdict.PASSED, f"{rule.name}: error rate of {_arm_name(snapshot)} is "
                  f"{shown}, not significantly above {_fmt('error_rate', max_rate)} "
                  f"(exact binomial p={p_abs:.2g}){vs}", p_shown, details)


def _binom_greater(k: int, n: int, rate: float) -> float:
    """P(X ≥ k) for X ~ Binomial(n, rate); exact, also at rate 0 and 1."""
    if rate <= 0.0:
        return 1.0 if k == 0 else 0.0
    if rate >= 1.0:
        return 1.0
    return float(stats.binomtest(k, n, rate, alternative="greater").pvalue)


# --------------------------------------------------------------------------------------
# Hodges-Lehmann


def hodges_lehmann(x: np.ndarray, y: np.ndarray, *,
                   alpha: float | None = 0.05) -> tuple[float, float, float]:
    """Median of the pairwise differences ``x_i - y_j`` and its distribution-free interval.

    Exact, without forming the ``n·m`` differences: the k-th smallest difference is found
    by bisection on its value, counting the differences below a value with a binary search
    (``O((n + m) log m)`` per step), so 4000 × 4000 samples cost milliseconds.

    Args:
        x: Candidate sample.
        y: Baseline sample.
        alpha: One-sided level of the interval's ends (Moses' order statistics with the
            normal approximation, no tie correction): the interval has confidence
            ``1 - 2·alpha``. None skips it (the ends are then NaN).

    Returns:
        ``(estimate, low, high)``.
    """
    xs = np.sort(np.asarray(x, dtype=float))
    ys = np.sort(np.asarray(y, dtype=float))
    n, m = xs.size, ys.size
    if n == 0 or m == 0:
        return math.nan, math.nan, math.nan
    total = n * m
    mid = total // 2
    est = _pair_quantile(xs, ys, mid) if total % 2 else \
        0.5 * (_pair_quantile(xs, ys, mid - 1) + _pair_quantile(xs, ys, mid))
    if alpha is None:
        return est, math.nan, math.nan
    z = float(stats.norm.ppf(1 - alpha))
    k = int(math.floor(total / 2 - z * math.sqrt(total * (n + m + 1) / 12.0)))
    k = min(max(k, 0), total - 1)
    return est, _pair_quantile(xs, ys, k), _pair_quantile(xs, ys, total - 1 - k)


def _pair_quantile(xs: np.ndarray, ys: np.ndarray, k: int) -> float:
    """The k-th smallest (0-based) of ``xs[i] - ys[j]``, for sorted ``xs`` and ``ys``."""
    total = xs.size * ys.size

    def count_le(t: float) -> int:
        # x - y <= t  <=>  y >= x - t
        return int(total - np.searchsorted(ys, xs - t, side="left").sum())

    lo, hi = float(xs[0] - ys[-1]), float(xs[-1] - ys[0])
    if lo == hi:
        return lo
    scale = max(abs(lo), abs(hi), 1e-300)
    lo -= 1e-9 * scale
    c_lo, c_hi = 0, total
    # Invariant: c_lo = count_le(lo) < k + 1 <= c_hi = count_le(hi). Steps alternate between
    # interpolating the count (fast on smooth data) and bisecting (a guaranteed halving),
    # until few enough differences lie in (lo, hi] to select among them exactly.
    small = max(4096, 2 * (xs.size + ys.size))
    for step in range(200):
        if c_hi - c_lo <= small or hi - lo <= 1e-12 * scale:
            break
        if step % 2 == 0:
            frac = (k + 1 - c_lo) / (c_hi - c_lo)
            mid = lo + min(max(frac, 0.02), 0.98) * (hi - lo)
        else:
            mid = 0.5 * (lo + hi)
        count = count_le(mid)
        if count >= k + 1:
            hi, c_hi = mid, count
        else:
            lo, c_lo = mid, count
    start = np.searchsorted(ys, xs - hi, side="left")
    if c_hi - c_lo > small:
        # Too many tied differences to separate: they all lie within 1e-12 of hi; return
        # the largest actual difference <= hi (for 0/1 data, say, that is exact).
        valid = start < ys.size
        return float(np.max(xs[valid] - ys[start[valid]])) if valid.any() else hi
    # The differences in (lo, hi]: for each x, the ys in [x - hi, x - lo).
    stop = np.searchsorted(ys, xs - lo, side="left")
    lengths = stop - start
    if lengths.sum() == 0:
        return hi
    rows = np.repeat(np.arange(xs.size), lengths)
    offsets = np.cumsum(lengths) - lengths
    cols = start[rows] + np.arange(rows.size) - offsets[rows]
    inside = xs[rows] - ys[cols]
    rank = min(max(k - (total - int(stop.sum())), 0), inside.size - 1)
    return float(np.partition(inside, rank)[rank])


# --------------------------------------------------------------------------------------
# sample size


def required_samples(rule: GateRule, *, baseline_latency_ms: np.ndarray | None = None,
                     baseline_error_rate: float = 0.0, min_samples: int = 1) -> int:
    """Samples per version for ``rule`` to catch a violation of size ``effect`` with ``power``.

    A *violation of size effect* is measured beyond the rule's bound (``effect`` defaults to
    the bound itself):

    - ``mann_whitney``: C slower by ``max_increase_pct + effect`` percent (a +20% slowdown
      for the default 10%) against a tolerance of ``max_increase_pct``. Noether's formula
      ``n = (z_{1-α} + z_power)² / (6 (p - ½)²)`` per arm, with ``p = P(C > r·P)`` computed
      exactly from the baseline sample's pairs when given, else from a lognormal with
      log-sd :data:`DEFAULT_LOG_SD` (the normal approximation with efficiency 3/π).
    - ``exact_rate``: C at ``max_rate + effect`` (``effect`` defaults to ``max_rate``, or
      0.001 when ``max_rate`` is 0). The smallest n at which either route of
      :func:`_judge_rate` fails with ``power``: the binomial test against ``max_rate``, or
      Fisher's test against a baseline at ``baseline_error_rate`` with as many requests
      (approximated by the conditional binomial test, exact for ``n0 = n``). With
      ``max_rate = 0`` this is the classic ``1 - (1 - effect)^n ≥ power``.
    - ``threshold``: no test, so ``min_samples``.

    The result is at least ``min_samples`` and at most 10 million.
    """
    test = rule.test or _infer_test(rule.model_dump())
    z = float(stats.norm.ppf(1 - rule.alpha) + stats.norm.ppf(rule.power))
    if test == "mann_whitney":
        pct = float(rule.max_increase_pct or 0.0)
        effect = float(rule.effect if rule.effect is not None else pct)
        r_tol = 1.0 + pct / 100.0
        lat = _clean_latency(baseline_latency_ms) if baseline_latency_ms is not None else None
        if lat is not None and lat.size >= 2:
            ref = float(np.mean(lat)) if rule.metric == "latency_mean_ms" else \
                float(np.percentile(lat, _PERCENTILES.get(rule.metric, 99.0)))
            if ref > 0:
                r_tol = 1.0 + max(pct / 100.0 * ref, float(rule.min_effect_ms or 0.0)) / ref
            r_alt = r_tol + effect / 100.0
            p = _prob_greater(np.log(lat), math.log(r_alt / r_tol))
        else:
            r_alt = r_tol + effect / 100.0
            delta = math.log(r_alt / r_tol)
            p = float(stats.norm.cdf(delta / (DEFAULT_LOG_SD * math.sqrt(2.0))))
        if not p > 0.5:
            return _MAX_PLAN
        n = math.ceil(z * z / (6.0 * (p - 0.5) ** 2))
        return int(min(max(n, min_samples), _MAX_PLAN))
    if test == "exact_rate":
        max_rate = float(rule.max_rate or 0.0)
        effect = float(rule.effect if rule.effect is not None else max_rate or 1e-3)
        p1 = min(max_rate + effect, 1.0)
        n = _rate_plan(max_rate, p1, max(baseline_error_rate, 0.0), rule.alpha, rule.power)
        return int(min(max(n, min_samples), _MAX_PLAN))
    return max(min_samples, 1)


def plan_samples(rules: Iterable[GateRule], *, baseline_latency_ms: np.ndarray | None = None,
                 baseline_error_rate: float = 0.0, min_samples: int = 1) -> int:
    """Samples per version the canary must reach: the max over blocking rules.

    Dry-run rules do not size the canary (they never block). At least ``min_samples``.
    """
    sizes = [required_samples(rule, baseline_latency_ms=baseline_latency_ms,
                              baseline_error_rate=baseline_error_rate, min_samples=min_samples)
             for rule in rules if not rule.dry_run]
    return max([min_samples, *sizes])


def _prob_greater(logs: np.ndarray, delta: float) -> float:
    """P(X1 + delta > X2) + ½·P(tie) for two independent draws from the sample ``logs``."""
    s = np.sort(logs)
    below = np.searchsorted(s, s + delta, side="left").sum()
    at_or_below = np.searchsorted(s, s + delta, side="right").sum()
    return float(0.5 * (below + at_or_below) / (s.size * s.size))


def _rate_plan(p0: float, p1: float, pb: float, alpha: float, power: float) -> int:
    """Smallest n (on a fine geometric grid, then refined) where C at p1 fails with power."""
    if p1 <= p0:
        return _MAX_PLAN

    def achieved(n: int) -> float:
        return _rate_power(n, p0, p1, pb, alpha)

    n = 1
    while n < _MAX_PLAN and achieved(n) < power:
        n = max(n + 1, int(n * 1.25))
    if n >= _MAX_PLAN:
        return _MAX_PLAN
    lo, hi = max(1, int(n / 1.25)), n
    # Power is sawtoothed in n (discrete critical values): scan the last step for the first
    # n that reaches it, in at most ~60 evaluations.
    step = max(1, (hi - lo) // 60)
    for cand in range(lo, hi + 1, step):
        if achieved(cand) >= power:
            return cand
    return hi


def _rate_power(n: int, p0: float, p1: float, pb: float, alpha: float) -> float:
    """Probability that :func:`_judge_rate` fails C at rate p1 with n requests per arm."""
    k_abs = _binom_critical(n, p0, alpha)
    over = math.floor(p0 * n) + 1  # smallest k with k/n > p0
    kb_hi = 0
    if pb > 0:
        while kb_hi < n and _binom_sf(kb_hi + 1, n, pb) > 1e-4:
            kb_hi += 1
    total = 0.0
    for kb in range(kb_hi + 1):
        weight = float(special.binom(n, kb) * pb**kb * (1 - pb) ** (n - kb)) if pb > 0 else 1.0
        k_cmp = max(_conditional_critical(kb, alpha), over)
        total += weight * _binom_sf(min(k_abs, k_cmp), n, p1)
    return total


def _binom_sf(k: int, n: int, p: float) -> float:
    """P(X ≥ k) for X ~ Binomial(n, p), through scipy.special (no per-call overhead)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return float(special.bdtrc(k - 1, n, p))


def _binom_critical(n: int, p0: float, alpha: float) -> int:
    """Smallest k with P(X ≥ k | n, p0) < alpha (n + 1 when none)."""
    if p0 <= 0:
        return 1
    k = max(1, math.floor(n * p0))
    while k > 1 and _binom_sf(k - 1, n, p0) < alpha:
        k -= 1
    while k <= n and not _binom_sf(k, n, p0) < alpha:
        k += 1
    return k


@functools.lru_cache(maxsize=4096)
def _conditional_critical(kb: int, alpha: float) -> int:
    """Smallest k with the conditional (Fisher, equal arms) p-value below alpha given kb."""
    k = 1
    while k < 100_000 and not _binom_sf(k, k + kb, 0.5) < alpha:
        k += 1
    return k


# --------------------------------------------------------------------------------------
# reporting


def markdown_table(report: GateReport) -> str:
    """The gate report as a Markdown table (for Slack, the release record and the CLI)."""
    lines = [f"**Gates: {report.verdict}** (needed {report.required_samples} samples "
             "per version)", "",
             "| rule | value | baseline | threshold | p-value | verdict |",
             "|---|---|---|---|---|---|"]
    for r in report.results:
        name = f"{r.rule} (dry run)" if r.dry_run else r.rule
        verdict = f"{r.verdict} (dry run, not blocking)" if r.dry_run else str(r.verdict)
        p = "" if r.p_value is None or math.isnan(r.p_value) else f"{r.p_value:.2g}"
        cells = [name, _fmt(r.metric, r.value), _fmt(r.metric, r.baseline), r.threshold, p,
                 verdict]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# helpers


def _result(rule: GateRule, test: str, verdict: Verdict, value: float | None,
            baseline: float | None, threshold: str, threshold_value: float | None,
            p_value: float | None, samples: tuple[int, int | None], message: str,
            details: Mapping[str, Any] | None = None) -> RuleResult:
    return RuleResult(rule=rule.name, metric=rule.metric, test=test, verdict=verdict,
                      value=value, baseline=baseline, threshold=threshold,
                      threshold_value=threshold_value, p_value=p_value, samples=samples,
                      dry_run=rule.dry_run, message=message, details=dict(details or {}))


def _clean_latency(latency: np.ndarray) -> np.ndarray:
    """Latencies as a flat float array, floored at 1 ns so ratios and logs stay defined."""
    return np.maximum(np.asarray(latency, dtype=float).ravel(), 1e-6)


def _arm_name(snapshot: CanarySnapshot, arm: str = "candidate") -> str:
    measured: ArmMeasurements | None = (snapshot.candidate if arm == "candidate"
                                        else snapshot.baseline)
    return f"{snapshot.model}/{measured.version}" if measured is not None else snapshot.model


def _window(snapshot: CanarySnapshot) -> str:
    return f"in the last {snapshot.window_s:g} s" if snapshot.window_s > 0 \
        else "in the measurement window"


def _missing_reason(snapshot: CanarySnapshot, metric: str, value: float | None, n: int, *,
                    arm: str = "candidate") -> str:
    """Why a value is missing or unusable ("" when it is fine): never a pass."""
    measured = snapshot.candidate if arm == "candidate" else snapshot.baseline
    who = _arm_name(snapshot, arm)
    if measured is None:
        return f"no {arm} measurements"
    if metric in LATENCY_METRICS:
        lat = np.asarray(measured.latency_ms, dtype=float).ravel()
        if lat.size == 0 and measured.requests <= 0:
            return f"no requests reached {who} {_window(snapshot)}"
        if lat.size == 0:
            return (f"no successful requests to {who} {_window(snapshot)}: all "
                    f"{measured.requests} failed")
        bad = int(np.count_nonzero(~np.isfinite(lat)))
        if bad:
            return f"{bad} of {lat.size} latencies of {who} are NaN or infinite: the " \
                   "measurement is broken"
    elif metric != "agreement" and measured.requests <= 0:
        return f"no requests reached {who} {_window(snapshot)}"
    if metric == "agreement" and value is None:
        return (f"no outputs of {who} were compared with the baseline's "
                f"({'no baseline' if snapshot.baseline is None else 'no input pairs'})")
    if metric == "throughput_ratio" and value is None:
        return (f"no throughput to compare: {who} or the baseline reported none"
                if snapshot.baseline is not None else "no baseline to compare throughput with")
    if value is None:
        return f"{metric} of {who} was not measured {_window(snapshot)}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{metric} of {who} is {value}: the measurement is broken"
    return ""


def _too_few(snapshot: CanarySnapshot, n: int, need: int, *, arm: str = "candidate") -> str:
    return (f"only {n} samples of {_arm_name(snapshot, arm)} {_window(snapshot)}, "
            f"{need} needed to decide; run the canary longer or raise its load")


def _fmt(metric: str, value: float | None) -> str:
    """A value in the metric's unit, for messages and tables."""
    if value is None:
        return "—"
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if metric in LATENCY_METRICS:
        return f"{value:.3g} ms"
    if metric == "error_rate":
        return f"{value * 100:.3g}%"
    if metric == "agreement":
        return f"{value * 100:.4g}%"
    if metric == "throughput_ratio":
        return f"{value:.3g}×"
    return f"{value:.4g} µs"


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float | np.floating):
        return _finite(float(value))
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    return value
