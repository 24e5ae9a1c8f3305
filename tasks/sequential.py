"""Sequential, always-valid canary judgement: look after every batch, stop when it is clear.

A fixed-horizon test (:mod:`tasks.gates`) is valid once, at the sample size it was planned
for; looking at it after every batch and stopping at the first failure inflates false
rollbacks far above α. The tests here are *e-processes*: non-negative supermartingales
under the null, so by Ville's inequality ``P(sup_t E_t ≥ 1/α) ≤ α`` — the canary may look
as often as it likes, stop as soon as a regression is certain, and the false detection
rate over all looks stays ≤ α. This follows Lindon, Sanden and Shirikian, "Rapid
Regression Detection in Software Deployments through Sequential Testing" (KDD 2022,
arXiv:2205.14762): their tests of stochastic order and of counts are mixture likelihood
ratios against a conjugate prior, and so are these.

One primitive does the counting, :func:`log_e_above`: the one-sided Bernoulli mixture

    E_t = ∫_{θ0}^{1} Π_i θ^{x_i} (1 - θ)^{1 - x_i} dπ(θ) / Π_i θ0^{x_i} (1 - θ0)^{1 - x_i}

with π a Beta prior truncated to ``(θ0, 1)``, in closed form in log space (``betaln`` and
the Beta log-survival function).

**Dependence.** The mixture is a supermartingale when the trials are independent; a
version's requests are not (its own queue and batcher), and errors come in bursts. Each
look (one round of paired load, about a second) is a **time block**, and every rule's
counts are divided by a variance-inflation factor measured from the blocks before the
mixture sees them (the variance-inflation route of issue 17; betting on bounded block
means, Waudby-Smith & Ramdas, JRSS-B 2024, is in :mod:`tasks.blocks`, but has little power
for a 1% tail): the larger of

- the leave-one-out Pearson dispersion of the per-look counts, at its upper 80% confidence
  bound (:func:`inflation`: infinite after one look, loose after a few, tight after many),
  and
- the run-length inflation of the events (requests above the quantile, failed requests)
  merged into incidents (Ferro & Segers, JRSS-B 2003; :func:`tasks.blocks.cluster_inflation`),
  measurable within a look.

Calibrated by seeded simulation (``tests/unit/test_sequential.py``, ``bench/judge.py``):
identical arms with per-arm AR(1) φ = 0.9 and errors at the budget in bursts of 8 no longer
fail the watch (17% and 37% before).

**The rules**, one :class:`WatchRule` each (``tasks.canary.sequential_config`` builds them
from the gates, with each gate's tolerance, ``effect``, ``power`` and a fifth of its α):

- **errors**: ``x_i`` = the candidate's request failed, H0 ``p_C ≤ max_rate`` (the same
  hypothesis as the fixed ``exact_rate`` rule). When the baseline is itself certainly
  above the budget, the errors are shared and the verdict is ``inconclusive``.
- **latency at quantile q** (p50 for typical latency, p99 for the tail): a threshold ``τ``
  is fixed from a reference sample of the baseline (the warm-up, then the baseline of the
  first looks until the reference puts :data:`MIN_TAIL_REFERENCE` requests above the
  quantile; those looks are not judged for it). Each (baseline, candidate) pair gives
  ``b > τ`` and ``c / r > τ`` with ``r`` the tolerance ratio; among discordant pairs the
  candidate is the one above with probability ``θ``, and ``θ ≤ ½`` exactly when
  ``P(C / r > τ) ≤ P(B > τ)`` (McNemar). H0 is ``θ ≤ ½``.

**Early pass only when shown within tolerance.** The mirror e-process for H0' "the
candidate is at or beyond the tolerance" (``θ ≥ ½`` at ``r``, rate ≥ budget) is a
confidence sequence: when it rejects at ``1 - power`` for *every* rule, the watch passes
and says what it showed, e.g. "p99 within +10% (upper bound +6.2%)"; the upper bound is
the smallest ratio (or rate) the sequence still excludes beyond. A candidate exactly at a
tolerance passes early at most ``1 - power`` of the time, and one beyond it (2× the error
budget) essentially never, so the watch never lowers the canary's detection.

The API is pure and small, for the canary and for any watch (approval wait)::

    watch = SequentialCanary(sequential_config(gates), reference_ms=warmup_baseline_ms)
    decision = watch.update(baseline_ms, candidate_ms, baseline_errors=0,
                            candidate_errors=3, candidate_failed=failed_in_send_order)
    decision.status   # "continue" | "failed" | "passed" | "inconclusive"
    decision.reason   # one sentence naming the rule, the evidence and the bound
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from scipy import special, stats

from modelship.measurements import MeasurementError, check_latency
from tasks.blocks import cluster_inflation, lag1, run_lengths

__all__ = [
    "MIN_TAIL_REFERENCE",
    "SequentialCanary",
    "SequentialConfig",
    "SequentialDecision",
    "WatchRule",
    "inflation",
    "log_e_above",
    "log_e_below",
    "log_e_over_budget",
    "quantile_bound",
]

Status = Literal["continue", "failed", "passed", "inconclusive"]


def log_e_above(k: float, n: float, theta0: float, a: float = 1.0, b: float = 1.0) -> float:
    """log E for H0 ``θ ≤ θ0`` after ``k`` successes in ``n`` Bernoulli trials.

    The mixture of likelihood ratios over θ ~ Beta(a, b) truncated to ``(θ0, 1)``; 0 at
    ``n = 0``. Computed with ``betaln`` and ``stats.beta.logsf`` (log space). Counts may
    be fractional: the watch divides them by a measured variance inflation.
    """
    if n <= 0:
        return 0.0
    if theta0 <= 0.0:
        return math.inf if k > 0 else 0.0
    log_num = special.betaln(a + k, b + n - k) + _log_beta_sf(theta0, a + k, b + n - k)
    log_prior = special.betaln(a, b) + _log_beta_sf(theta0, a, b)
    log_null = k * math.log(theta0) + (n - k) * math.log1p(-theta0)
    return float(log_num - log_prior - log_null)


def _log_beta_sf(x: float, a: float, b: float) -> float:
    """log P(X > x) for X ~ Beta(a, b): ``betaincc`` directly, the slower log-space
    ``stats.beta.logsf`` only when it underflows."""
    sf = float(special.betaincc(a, b, x))
    if sf > 1e-250:
        return math.log(sf)
    return float(stats.beta.logsf(x, a, b))


def log_e_below(k: float, n: float, theta1: float, a: float = 1.0, b: float = 1.0) -> float:
    """log E for H0' ``θ ≥ θ1``: the mirror of :func:`log_e_above` (prior on ``(0, θ1)``)."""
    return log_e_above(n - k, n, 1.0 - theta1, b, a)


def log_e_over_budget(failed: int, total: int, budget: float) -> float:
    """log E for H0 "the error rate ≤ ``budget``" after ``failed`` of ``total`` requests.

    :func:`log_e_above` with a Beta(1, b) prior of mean 20 × the budget (b ≥ 1), so a few
    errors over a small budget are evidence (3 of 160 at 0.1%) and a 50% failure rate is
    certain at once. The bake's error rule and the approval wait's watch of production
    use it, at ``1 / α``.
    """
    prior_b = max(1.0, 1.0 / (20.0 * budget) - 1.0) if budget > 0 else 1.0
    return log_e_above(failed, total, budget, 1.0, prior_b)


def quantile_bound(reference: np.ndarray, q: float, alpha: float) -> tuple[float, float]:
    """A reference sample's q-quantile ``τ`` and an exact upper bound of ``P(X > τ)``.

    ``τ`` is the ``k``-th order statistic, ``k = ⌈q·n⌉`` (at least 1). For a continuous
    distribution ``P(X > X_(k))`` is Beta(n-k+1, k) whatever the distribution (Wilks'
    distribution-free tolerance limits, 1941), so its ``1 - alpha`` quantile bounds it
    with probability ``1 - alpha``: the Clopper-Pearson upper bound on the ``n - k``
    reference values above ``τ``. Ties only make ``P(X > τ)`` smaller.

    Raises:
        MeasurementError: A latency is non-finite or negative, or there is none.
    """
    values = np.sort(check_latency(reference, "the reference sample"))
    n = int(values.size)
    if n == 0:
        raise MeasurementError("the reference sample has no latencies, so no quantile can "
                               "be fixed from it")
    k = min(max(math.ceil(q * n), 1), n)
    return float(values[k - 1]), float(stats.beta.ppf(1.0 - alpha, n - k + 1, k))


@dataclass(frozen=True)
class WatchRule:
    """One rule of the sequential watch, with its own α, effect and power.

    Attributes:
        name: The gate rule's name (``latency_p50``, ``latency_p99``, ``error_rate``).
        kind: ``latency`` (a quantile ``q`` within ``tolerance`` percent of the baseline's)
            or ``errors`` (the candidate's error rate within the budget ``tolerance``).
        tolerance: Percent for latency, a rate for errors.
        alpha: False-fail rate of this rule over all looks (its share of the rule's α).
        power: Wanted power at ``effect``; ``1 - power`` bounds the chance of an early pass
            for a candidate exactly at the tolerance.
        effect: The violation beyond the tolerance the rule must catch (percentage points,
            or a rate above the budget): it centres the prior of the regression e-process.
        quantile: The latency quantile judged (0.5 for typical latency).
    """

    name: str
    kind: Literal["latency", "errors"]
    tolerance: float
    alpha: float
    power: float
    effect: float
    quantile: float = 0.5


@dataclass(frozen=True)
class SequentialConfig:
    """What the sequential watch tests, and at which levels.

    The scalar fields describe the default watch (p50 and p99 latency within
    ``max_increase_pct``, errors within ``max_error_rate``, ``alpha`` split evenly, early
    passes at ``beta``); ``rules``, when given, replaces it rule by rule
    (:func:`tasks.canary.sequential_config` builds them from the policy's gates, each with
    its own α share, effect and power).

    Attributes:
        alpha: False detection rate over all looks and all default rules (split evenly).
        beta: Chance of passing early a candidate exactly at a default rule's tolerance.
        max_increase_pct: Latency tolerance, percent of the baseline's quantile.
        quantiles: Latency quantiles judged by default: 0.5 (typical) and 0.99 (tail).
        effect_pct: Latency regression beyond the tolerance that must be caught, points.
        max_error_rate: Error budget (H0: the candidate's rate ≤ it).
        error_effect: The error rate above the budget that must be caught.
        rules: Explicit rules; empty means the defaults above.
    """

    alpha: float = 0.01
    beta: float = 0.05
    max_increase_pct: float = 10.0
    quantiles: tuple[float, ...] = (0.5, 0.99)
    effect_pct: float = 40.0
    max_error_rate: float = 0.001
    error_effect: float = 0.004
    rules: tuple[WatchRule, ...] = ()

    def watch_rules(self) -> tuple[WatchRule, ...]:
        """The rules judged: ``rules``, or the defaults from the scalar fields."""
        if self.rules:
            return self.rules
        share = self.alpha / (len(self.quantiles) + 1)
        latency = tuple(WatchRule(f"latency_p{q * 100:g}", "latency", self.max_increase_pct,
                                  share, 1.0 - self.beta, self.effect_pct, q)
                        for q in self.quantiles)
        return (WatchRule("error_rate", "errors", self.max_error_rate, share, 1.0 - self.beta,
                          self.error_effect), *latency)


@dataclass(frozen=True)
class RuleState:
    """One rule's evidence after the last look (JSON-ready through ``to_dict``).

    Attributes:
        name: The rule.
        log_e_regression: log e-value against "within tolerance" (fails at log 1/α).
        log_e_fine: log e-value against "beyond tolerance" (passes early at log 1/(1-power)).
        events: Discordant pairs (latency) or requests (errors), before deflation.
        hits: Pairs with the candidate above (latency) or errors.
        detail: The evidence in words.
        inflation: Variance inflation measured from the looks (≥ 1): the counts are divided
            by it, so correlated requests and bursts of errors count as what they are.
        lag1: Lag-1 autocorrelation of the rule's per-look statistic.
        bound: Upper confidence bound of the statistic (latency: ratio to the baseline's
            quantile; errors: the rate), or NaN when nothing is shown yet.
        shown_within: Whether the confidence sequence puts the statistic inside its
            tolerance.
        calibrated: Whether the rule has its reference (latency) and is being judged.
    """

    name: str
    log_e_regression: float
    log_e_fine: float
    events: int
    hits: int
    detail: str
    inflation: float = 1.0
    lag1: float = math.nan
    bound: float = math.nan
    shown_within: bool = False
    calibrated: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "e_regression": _exp(self.log_e_regression),
                "e_fine": _exp(self.log_e_fine), "events": self.events, "hits": self.hits,
                "detail": self.detail, "inflation": _num(self.inflation),
                "lag1": _num(self.lag1), "upper_bound": _num(self.bound),
                "shown_within": self.shown_within, "calibrated": self.calibrated}


@dataclass(frozen=True)
class SequentialDecision:
    """The verdict after one look.

    Attributes:
        status: ``failed`` (a regression is certain), ``passed`` (every rule is shown within
            its tolerance by its confidence sequence), ``inconclusive`` (both arms fail
            alike: not the candidate's doing), or ``continue`` (keep measuring).
        reason: One sentence naming the deciding rule and its evidence, or what was shown.
        looks: Batches ingested so far.
        samples: ``(candidate, baseline)`` requests ingested so far.
        rules: Each rule's evidence.
    """

    status: Status
    reason: str
    looks: int
    samples: tuple[int, int]
    rules: tuple[RuleState, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "looks": self.looks,
                "samples": {"candidate": self.samples[0], "baseline": self.samples[1]},
                "rules": [r.to_dict() for r in self.rules]}


def _exp(x: float) -> float | None:
    if math.isnan(x):
        return None
    return math.exp(min(x, 700.0))


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


_RATIO_GRID = np.round(np.arange(0.70, 2.505, 0.005), 3)
"""Latency ratios (candidate quantile / baseline's) at which the watch keeps discordance
counts, for the upper confidence bound reported with an early pass."""

MIN_TAIL_REFERENCE = 30
"""Reference requests a latency rule needs above its quantile before it is judged."""


INFLATION_CONFIDENCE = 0.8
"""The watch deflates its counts by an upper confidence bound of the variance inflation at
this level, not by the point estimate: early, with few looks, the spread of the blocks says
little, and a point estimate near 1 would let correlated requests count as independent."""


def inflation(hits: np.ndarray, events: np.ndarray, *,
              confidence: float = INFLATION_CONFIDENCE) -> float:
    """Upper confidence bound of the variance inflation of binomial counts, from blocks.

    ``hits[b]`` of ``events[b]`` in block ``b``: Pearson's χ² of each block's count around
    the rate of the other blocks, over the lower ``1 - confidence`` quantile of χ² on ``B - 1``
    degrees of freedom (the usual interval of a variance ratio), at least 1. Correlated
    requests within a block (or a burst of errors) raise it; independent ones leave it
    near 1 once there are enough blocks. Infinite with fewer than 2 blocks that have
    events (nothing is known yet); 1 without any event at all (there is nothing to deflate).
    """
    k = np.asarray(hits, dtype=float)
    n = np.asarray(events, dtype=float)
    keep = n > 0
    k, n = k[keep], n[keep]
    if not k.sum() > 0:
        return 1.0
    if k.size < 2:
        return math.inf
    # Each block against the rate of the others (leave one out): a burst or a run of
    # correlated requests sets the pooled rate itself, so against it the block looks
    # ordinary; against the other blocks it stands out. (+½ / +1 keep the rate inside
    # (0, 1) when every event of the others is a hit.)
    p = (k.sum() - k + 0.5) / (n.sum() - n + 1.0)
    chi2 = float(np.sum((k - n * p) ** 2 / (n * p * (1.0 - p))))
    low = float(stats.chi2.ppf(1.0 - confidence, k.size - 1))
    return max(chi2 / low, 1.0) if low > 0 else math.inf


class SequentialCanary:
    """Ingests batches of (baseline, candidate) measurements; decides after each one.

    Each batch (one look, about a second of paired load) is a **block**: the evidence is
    counted per block, and the spread of the per-block counts measures how much the
    requests inside a block depend on each other (:func:`inflation`: correlated latencies
    per arm, bursts of errors). Every rule's counts are divided by its inflation, the
    running maximum over looks, before the mixture e-process sees them, so a burst of 8
    errors weighs about one error and 100 correlated requests what they are worth. This is
    the variance-inflation form of block evidence (the issue's alternative to betting on
    bounded block statistics, which has little power for a 1% tail: see
    :mod:`tasks.blocks` for the betting confidence sequence).

    Args:
        config: The rules and levels.
        reference_ms: Baseline latencies measured before the first look (the warm-up):
            they fix each quantile's threshold. A quantile is judged once the reference (the
            warm-up and then the baseline of the first looks, which are then not judged for
            it) puts :data:`MIN_TAIL_REFERENCE` requests above it.
    """

    def __init__(self, config: SequentialConfig | None = None, *,
                 reference_ms: np.ndarray | None = None) -> None:
        self.config = config or SequentialConfig()
        self.rules = self.config.watch_rules()
        self._latency = [r for r in self.rules if r.kind == "latency"]
        self._errors = [r for r in self.rules if r.kind == "errors"]
        self._ref = np.zeros(0)
        self._tau: dict[str, float] = {}
        self._theta1: dict[str, float] = {}
        # Per latency rule, per look: discordant pairs and candidate-above counts at every
        # grid ratio (the tolerance ratio is one of them).
        self._disc: dict[str, list[np.ndarray]] = {r.name: [] for r in self._latency}
        self._up: dict[str, list[np.ndarray]] = {r.name: [] for r in self._latency}
        self._infl: dict[str, float] = {r.name: 1.0 for r in self.rules}
        # Runs of events per rule and arm: [Σ L, Σ L², trials] (incidents: see
        # tasks.blocks.cluster_inflation), measurable within a single look.
        self._runs: dict[tuple[str, str], list[float]] = {}
        self._looks_err: list[tuple[int, int, int, int]] = []  # ke, ne, kb, nb per look
        self.looks = 0
        if reference_ms is not None:
            self._calibrate(check_latency(reference_ms, "the reference sample"))
        self.decision = SequentialDecision("continue", "no data yet", 0, (0, 0))

    @staticmethod
    def _ratio(rule: WatchRule) -> float:
        return 1.0 + rule.tolerance / 100.0

    def _calibrate(self, more: np.ndarray) -> None:
        """Add baseline latencies to the reference; fix τ for every quantile it now covers."""
        pending = [r for r in self._latency if r.name not in self._tau]
        if not pending or more.size == 0:
            return
        self._ref = np.concatenate([self._ref, more])
        ref = self._ref
        for rule in pending:
            tau = float(np.quantile(ref, rule.quantile))
            if int(np.count_nonzero(ref > tau)) < MIN_TAIL_REFERENCE:
                continue
            self._tau[rule.name] = tau
            r_tol = self._ratio(rule)
            r_alt = r_tol + rule.effect / 100.0
            p_b = max(float(np.mean(ref > tau)), 1.0 / ref.size)
            p_c = max(float(np.mean(ref > tau * r_tol / r_alt)), p_b)
            num = p_c * (1 - p_b)
            den = num + p_b * (1 - p_c)
            self._theta1[rule.name] = min(max(num / den if den > 0 else 0.75, 0.5), 0.999)

    def update(self, baseline_ms: np.ndarray, candidate_ms: np.ndarray, *,
               baseline_errors: int = 0, candidate_errors: int = 0,
               baseline_requests: int | None = None,
               candidate_requests: int | None = None,
               baseline_failed: np.ndarray | None = None,
               candidate_failed: np.ndarray | None = None) -> SequentialDecision:
        """Ingest one batch (one block) and decide.

        Args:
            baseline_ms: Latencies of the baseline's answered requests in this batch, ms.
            candidate_ms: The candidate's, ms; paired with ``baseline_ms`` by position
                (the same input rows, as the paired load sends them), the excess dropped.
            baseline_errors: Failed baseline requests in this batch.
            candidate_errors: Failed candidate requests in this batch.
            baseline_requests: Requests sent to the baseline (default: answered + failed).
            candidate_requests: The same for the candidate.
            baseline_failed: Whether each baseline request of the batch failed, in send
                order: failures next to each other are merged into incidents, so a burst
                weighs what it is worth. Without it only the spread across looks shows
                bursts.
            candidate_failed: The same for the candidate.

        Raises:
            MeasurementError: A latency is non-finite or negative.
        """
        b = check_latency(baseline_ms, "the baseline")
        c = check_latency(candidate_ms, "the candidate")
        self.looks += 1
        ne = int(candidate_requests if candidate_requests is not None
                 else c.size + candidate_errors)
        nb = int(baseline_requests if baseline_requests is not None
                 else b.size + baseline_errors)
        self._looks_err.append((int(candidate_errors), ne, int(baseline_errors), nb))
        for arm, failed in (("baseline", baseline_failed), ("candidate", candidate_failed)):
            if failed is not None:
                self._add_runs(("errors", arm), np.asarray(failed, dtype=bool))
        m = min(b.size, c.size)
        for rule in self._latency:
            tau = self._tau.get(rule.name)
            if tau is None:
                continue
            self._add_runs((rule.name, "baseline"), b > tau)
            self._add_runs((rule.name, "candidate"), c / self._ratio(rule) > tau)
            b_up = b[:m] > tau
            c_up = c[:m, None] / _RATIO_GRID[None, :] > tau
            disc = c_up != b_up[:, None]
            self._disc[rule.name].append(disc.sum(axis=0))
            self._up[rule.name].append((c_up & disc).sum(axis=0))
        self._calibrate(b)
        self.decision = self._decide()
        return self.decision

    def _add_runs(self, key: tuple[str, str], events: np.ndarray) -> None:
        total, squares = run_lengths(events)
        acc = self._runs.setdefault(key, [0.0, 0.0, 0.0])
        acc[0] += total
        acc[1] += squares
        acc[2] += events.size

    def _cluster(self, name: str) -> float:
        """The larger of the two arms' run-based inflation for a rule (1 without runs)."""
        return max([cluster_inflation(*self._runs[(name, arm)]) for arm in
                    ("baseline", "candidate") if (name, arm) in self._runs] or [1.0])

    def _latency_state(self, rule: WatchRule) -> RuleState:
        name = rule.name
        tau = self._tau.get(name)
        if tau is not None and not self._disc[name]:
            return RuleState(name, 0.0, 0.0, 0, 0, f"reference fixed at {tau:.3g} ms; no "
                             "look judged yet")
        if tau is None:
            above = int(np.count_nonzero(self._ref > np.quantile(self._ref, rule.quantile))) \
                if self._ref.size else 0
            return RuleState(name, 0.0, 0.0, 0, 0, f"waiting for a reference: {above} "
                             f"baseline requests above its p{rule.quantile * 100:g}, "
                             f"{MIN_TAIL_REFERENCE} needed", calibrated=False)
        disc = np.asarray(self._disc[name])
        up = np.asarray(self._up[name])
        j = int(np.argmin(np.abs(_RATIO_GRID - self._ratio(rule))))
        infl = max(inflation(up[:, j], disc[:, j]), self._cluster(name))
        self._infl[name] = infl
        k, n = float(up[:, j].sum()), float(disc[:, j].sum())
        theta1 = self._theta1.get(name, 0.75)
        a, bb = 4.0 * theta1, 4.0 * (1.0 - theta1)
        log_reg = log_e_above(k / infl, n / infl, 0.5, a, bb) if n else 0.0
        level = math.log(1.0 / (1.0 - rule.power))
        ks, ns = up.sum(axis=0) / infl, disc.sum(axis=0) / infl

        def fine_at(i: int) -> float:
            return log_e_below(float(ks[i]), float(ns[i]), 0.5) if ns[i] > 0 else 0.0

        fine_j = fine_at(j)
        bound = math.nan
        if fine_j >= level:
            # The smallest grid ratio r at which "the candidate's quantile is at least r ×
            # the baseline's" is rejected (the evidence grows with r): bisection.
            lo, hi = -1, j
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fine_at(mid) >= level else (mid, hi)
            bound = float(_RATIO_GRID[hi])
        per_look = (up[:, j] - disc[:, j] / 2.0) / np.maximum(disc[:, j], 1)
        ratio = self._ratio(rule)
        return RuleState(
            name, log_reg, fine_j, int(n), int(k),
            f"{int(k)} of {int(n)} discordant pairs have the candidate (÷{ratio:.2f}) above "
            f"the baseline's p{rule.quantile * 100:g} ({tau:.3g} ms), inflation "
            f"{infl:.2g}", infl, lag1(per_look), bound,
            bool(math.isfinite(bound) and bound <= ratio + 1e-9))

    def _error_state(self, rule: WatchRule) -> tuple[RuleState, float]:
        looks = np.asarray(self._looks_err, dtype=float).reshape(-1, 4)
        infl = max(inflation(looks[:, 0], looks[:, 1]), self._cluster("errors"))
        if looks[:, 2].sum() >= 2:  # the baseline: the concurrent estimate of burstiness
            infl = max(infl, inflation(looks[:, 2], looks[:, 3]))
        self._infl[rule.name] = infl
        ke, ne, kb, nb = (float(x) for x in looks.sum(axis=0))
        budget = rule.tolerance
        prior_mean = min(budget + rule.effect, 0.5)
        a_err, b_err = 1.0, (1.0 - prior_mean) / prior_mean
        log_reg = log_e_above(ke / infl, ne / infl, budget, a_err, b_err)
        fine = log_e_below(ke / infl, ne / infl, budget, a_err, b_err) if budget > 0 else 0.0
        level = math.log(1.0 / (1.0 - rule.power))
        bound = _rate_bound(ke / infl, ne / infl, level, a_err, b_err) if fine >= level \
            else math.nan
        base_log = log_e_above(kb / infl, nb / infl, budget, a_err, b_err)
        rates = looks[:, 0] / np.maximum(looks[:, 1], 1)
        return RuleState(
            rule.name, log_reg, fine, int(ne), int(ke),
            f"{int(ke)}/{int(ne)} candidate errors against a budget of {budget:.3%}, "
            f"overdispersion {infl:.2g}", infl, lag1(rates), bound,
            bool(fine >= level)), base_log

    def _decide(self) -> SequentialDecision:
        looks = self.looks
        arr = np.asarray(self._looks_err, dtype=np.int64).reshape(-1, 4)
        ke, ne, kb, nb = (int(x) for x in arr.sum(axis=0))
        samples = (ne, nb)
        states: list[RuleState] = []
        base_logs: dict[str, float] = {}
        for rule in self.rules:
            if rule.kind == "errors":
                state, base_logs[rule.name] = self._error_state(rule)
            else:
                state = self._latency_state(rule)
            states.append(state)
        by_name = {r.name: r for r in self.rules}
        for state in states:
            rule = by_name[state.name]
            if state.log_e_regression >= math.log(1.0 / rule.alpha):
                if rule.kind == "errors" and base_logs[rule.name] >= math.log(1.0 / rule.alpha):
                    return SequentialDecision(
                        "inconclusive", f"both arms fail alike: candidate {ke}/{ne}, baseline "
                        f"{kb}/{nb}, both certainly above the budget {rule.tolerance:.3%}: "
                        "the canary server or the inputs are failing, not the candidate",
                        looks, samples, tuple(states))
                return SequentialDecision(
                    "failed", f"{state.name}: regression certain after {looks} looks: "
                    f"{state.detail}; e-value {_exp(state.log_e_regression):.3g} ≥ "
                    f"1/α = {1 / rule.alpha:g} (α={rule.alpha:g} over all looks)",
                    looks, samples, tuple(states))
        if states and all(s.calibrated and s.shown_within for s in states):
            shown = "; ".join(_shown(by_name[s.name], s) for s in states)
            return SequentialDecision(
                "passed", f"every rule shown within its tolerance after {looks} looks "
                f"({ne} candidate requests): {shown}", looks, samples, tuple(states))
        return SequentialDecision("continue", f"no decision after {looks} looks ({ne} "
                                  "candidate requests)", looks, samples, tuple(states))


def _shown(rule: WatchRule, state: RuleState) -> str:
    """What an early pass showed for one rule, e.g. "p99 within +10% (upper bound +6.2%)"."""
    conf = f"{rule.power:.0%} confidence sequence"
    if rule.kind == "errors":
        return (f"{rule.name} within {rule.tolerance:.3%} (upper bound {state.bound:.3%}, "
                f"{conf})")
    return (f"p{rule.quantile * 100:g} within +{rule.tolerance:g}% (upper bound "
            f"{(state.bound - 1.0) * 100:+.1f}%, {conf})")


def _rate_bound(k: float, n: float, level: float, a: float, b: float) -> float:
    """The smallest rate ``p`` with ``log_e_below(k, n, p) ≥ level`` (bisection): an upper
    confidence bound of the error rate; NaN when none below 0.5 is shown."""
    if n <= 0 or log_e_below(k, n, 0.5, a, b) < level:
        return math.nan
    lo, hi = 0.0, 0.5
    for _ in range(30):
        mid = (lo + hi) / 2.0
        if log_e_below(k, n, mid, a, b) >= level:
            hi = mid
        else:
            lo = mid
    return hi
