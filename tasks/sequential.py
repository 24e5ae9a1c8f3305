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

One primitive does all the work, :func:`log_e_above`: the one-sided Bernoulli mixture

    E_t = ∫_{θ0}^{1} Π_i θ^{x_i} (1 - θ)^{1 - x_i} dπ(θ) / Π_i θ0^{x_i} (1 - θ0)^{1 - x_i}

with π a Beta prior truncated to ``(θ0, 1)``. Each θ > θ0 gives a likelihood ratio whose
expectation under any θ ≤ θ0 is ≤ 1 (monotone likelihood ratio), so the mixture is a test
supermartingale for the composite H0 ``θ ≤ θ0``. It has a closed form in log space
(``betaln`` and the Beta log-survival function): no overflow at any count.

The rules it judges, each at ``α / (number of rules)`` (a union bound over rules; the
bound over looks is Ville's):

- **errors**: ``x_i`` = the candidate's request failed, H0 ``p_C ≤ max_rate`` (the same
  hypothesis as the fixed-horizon ``exact_rate`` rule). When the baseline is itself
  certainly above the budget, the errors are shared and the verdict is ``inconclusive``.
- **latency at quantile q** (p50 for typical latency, p99 for the tail): a threshold ``τ``
  is fixed from a reference sample of the baseline (the warm-up, or the first batch, which
  is then used for nothing else). Each (baseline, candidate) pair gives ``b > τ`` and
  ``c / r > τ`` with ``r`` the tolerance ratio; among discordant pairs, the candidate is
  the one above with probability ``θ = p_C(1-p_B) / (p_C(1-p_B) + p_B(1-p_C))``, and
  ``θ ≤ ½`` exactly when ``P(C / r > τ) ≤ P(B > τ)`` (McNemar's observation: it holds
  whatever the dependence within a pair). H0 is ``θ ≤ ½``: the candidate, slowed by the
  tolerance, is not above the baseline's q-quantile more often than the baseline.

"Clearly fine" is the mirror image: an e-process for H0' "the candidate is at least as
bad as the regression the rule must catch" (``θ ≥ θ1``), with the prior on ``(0, θ1)``;
when every rule rejects its H0' at ``β``, the canary passes early. Stopping early for a
pass never raises the false detection rate (it only removes chances to fail).

The API is pure and small, for the canary and for any watch (bake, approval wait)::

    watch = SequentialCanary(SequentialConfig(), reference_ms=warmup_baseline_ms)
    decision = watch.update(baseline_ms, candidate_ms, baseline_errors=0,
                            candidate_errors=3)   # a batch; call again with the next one
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

__all__ = [
    "SequentialCanary",
    "SequentialConfig",
    "SequentialDecision",
    "log_e_above",
    "log_e_below",
    "log_e_over_budget",
    "quantile_bound",
]

Status = Literal["continue", "failed", "passed", "inconclusive"]


def log_e_above(k: int, n: int, theta0: float, a: float = 1.0, b: float = 1.0) -> float:
    """log E for H0 ``θ ≤ θ0`` after ``k`` successes in ``n`` Bernoulli trials.

    The mixture of likelihood ratios over θ ~ Beta(a, b) truncated to ``(θ0, 1)``; 0 at
    ``n = 0``. Computed with ``betaln`` and ``stats.beta.logsf`` (log space).
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


def log_e_below(k: int, n: int, theta1: float, a: float = 1.0, b: float = 1.0) -> float:
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
class SequentialConfig:
    """What the sequential canary tests, and at which levels.

    Attributes:
        alpha: False detection rate over all looks and all rules (split evenly).
        beta: Chance of passing early a candidate at the regression it must catch.
        max_increase_pct: Latency tolerance, percent of the baseline's quantile.
        quantiles: Latency quantiles judged: 0.5 (typical) and 0.99 (tail) by default.
        effect_pct: The latency regression beyond the tolerance that must be caught, in
            percentage points (the "clearly fine" bound).
        max_error_rate: Error budget (H0: the candidate's rate ≤ it).
        error_effect: The error rate above the budget that must be caught.
    """

    alpha: float = 0.01
    beta: float = 0.05
    max_increase_pct: float = 10.0
    quantiles: tuple[float, ...] = (0.5, 0.99)
    effect_pct: float = 40.0
    max_error_rate: float = 0.001
    error_effect: float = 0.004

    @property
    def rules(self) -> int:
        return len(self.quantiles) + 1


@dataclass(frozen=True)
class RuleState:
    """One rule's evidence after the last look (JSON-ready through ``to_dict``)."""

    name: str
    log_e_regression: float
    log_e_fine: float
    events: int
    hits: int
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "e_regression": _exp(self.log_e_regression),
                "e_fine": _exp(self.log_e_fine), "events": self.events, "hits": self.hits,
                "detail": self.detail}


@dataclass(frozen=True)
class SequentialDecision:
    """The verdict after one look.

    Attributes:
        status: ``failed`` (a regression is certain), ``passed`` (every rule is clearly
            fine), ``inconclusive`` (both arms fail alike: not the candidate's doing), or
            ``continue`` (keep measuring).
        reason: One sentence naming the deciding rule and its evidence.
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


class SequentialCanary:
    """Ingests batches of (baseline, candidate) measurements; decides after each one.

    Args:
        config: The rules and levels.
        reference_ms: Baseline latencies measured before the first look (the warm-up):
            they fix each quantile's threshold. Without them, the first batch does, and is
            not judged.
    """

    def __init__(self, config: SequentialConfig | None = None, *,
                 reference_ms: np.ndarray | None = None) -> None:
        self.config = config or SequentialConfig()
        self._tau: dict[float, float] | None = None
        self._theta1: dict[float, float] = {}
        if reference_ms is not None:
            self._calibrate(check_latency(reference_ms, "the reference sample"))
        self._disc = dict.fromkeys(self.config.quantiles, 0)
        self._up = dict.fromkeys(self.config.quantiles, 0)
        self._err = [0, 0, 0, 0]  # candidate errors, requests, baseline errors, requests
        self.looks = 0
        self.decision = SequentialDecision("continue", "no data yet", 0, (0, 0))

    def _calibrate(self, ref: np.ndarray) -> None:
        if ref.size < 2:
            return
        cfg = self.config
        r_tol = 1.0 + cfg.max_increase_pct / 100.0
        r_alt = r_tol + cfg.effect_pct / 100.0
        self._tau = {q: float(np.quantile(ref, q)) for q in cfg.quantiles}
        for q, tau in self._tau.items():
            p_b = max(float(np.mean(ref > tau)), 1.0 / ref.size)
            p_c = max(float(np.mean(ref > tau * r_tol / r_alt)), p_b)
            num = p_c * (1 - p_b)
            den = num + p_b * (1 - p_c)
            self._theta1[q] = min(max(num / den if den > 0 else 0.5, 0.5), 0.999)

    def update(self, baseline_ms: np.ndarray, candidate_ms: np.ndarray, *,
               baseline_errors: int = 0, candidate_errors: int = 0,
               baseline_requests: int | None = None,
               candidate_requests: int | None = None) -> SequentialDecision:
        """Ingest one batch and decide.

        Args:
            baseline_ms: Latencies of the baseline's answered requests in this batch, ms.
            candidate_ms: The candidate's, ms; paired with ``baseline_ms`` by position
                (the same input rows, as the paired load sends them), the excess dropped.
            baseline_errors: Failed baseline requests in this batch.
            candidate_errors: Failed candidate requests in this batch.
            baseline_requests: Requests sent to the baseline (default: answered + failed).
            candidate_requests: The same for the candidate.

        Raises:
            MeasurementError: A latency is non-finite or negative.
        """
        cfg = self.config
        b = check_latency(baseline_ms, "the baseline")
        c = check_latency(candidate_ms, "the candidate")
        self.looks += 1
        self._err[0] += int(candidate_errors)
        self._err[1] += int(candidate_requests if candidate_requests is not None
                            else c.size + candidate_errors)
        self._err[2] += int(baseline_errors)
        self._err[3] += int(baseline_requests if baseline_requests is not None
                            else b.size + baseline_errors)
        if self._tau is None:
            self._calibrate(b)
        else:
            r = 1.0 + cfg.max_increase_pct / 100.0
            m = min(b.size, c.size)
            for q, tau in self._tau.items():
                b_up = b[:m] > tau
                c_up = c[:m] / r > tau
                disc = b_up != c_up
                self._disc[q] += int(disc.sum())
                self._up[q] += int((c_up & disc).sum())
        self.decision = self._decide()
        return self.decision

    def _decide(self) -> SequentialDecision:
        cfg = self.config
        level = math.log(cfg.rules / cfg.alpha)
        fine_level = math.log(cfg.rules / cfg.beta)
        ke, ne, kb, nb = self._err
        samples = (ne, nb)
        prior_mean = min(cfg.max_error_rate + cfg.error_effect, 0.5)
        a_err, b_err = 1.0, (1.0 - prior_mean) / prior_mean
        p1 = min(cfg.max_error_rate + cfg.error_effect, 0.999)
        err = RuleState(
            "error_rate", log_e_above(ke, ne, cfg.max_error_rate, a_err, b_err),
            log_e_below(ke, ne, p1, a_err, b_err), ne, ke,
            f"{ke}/{ne} candidate errors against a budget of {cfg.max_error_rate:.3%}")
        states = [err]
        for q in cfg.quantiles:
            n, k = self._disc[q], self._up[q]
            theta1 = self._theta1.get(q, 0.75)
            name = f"latency_p{q * 100:g}"
            ratio = 1 + cfg.max_increase_pct / 100
            states.append(RuleState(
                name, log_e_above(k, n, 0.5), log_e_below(k, n, theta1), n, k,
                f"{k} of {n} discordant pairs have the candidate (÷{ratio:.2f}) "
                f"above the baseline's p{q * 100:g}" + (
                    f" ({self._tau[q]:.3g} ms)" if self._tau else "")))
        looks = self.looks
        for state in states:
            if state.log_e_regression >= level:
                if state.name == "error_rate" and log_e_above(kb, nb, cfg.max_error_rate,
                                                              a_err, b_err) >= level:
                    return SequentialDecision(
                        "inconclusive", f"both arms fail alike: candidate {ke}/{ne}, baseline "
                        f"{kb}/{nb}, both certainly above the budget {cfg.max_error_rate:.3%}: "
                        "the canary server or the inputs are failing, not the candidate",
                        looks, samples, tuple(states))
                return SequentialDecision(
                    "failed", f"{state.name}: regression certain after {looks} looks: "
                    f"{state.detail}; e-value {_exp(state.log_e_regression):.3g} ≥ "
                    f"{cfg.rules / cfg.alpha:g} (α={cfg.alpha:g} over all looks and rules)",
                    looks, samples, tuple(states))
        if self._tau is not None and all(s.log_e_fine >= fine_level for s in states):
            return SequentialDecision(
                "passed", f"every rule is clearly within its bound after {looks} looks "
                f"({ne} candidate requests): no regression of +{cfg.effect_pct:g} points "
                f"beyond the {cfg.max_increase_pct:g}% latency tolerance, nor errors "
                f"{cfg.error_effect:.3%} above the budget (β={cfg.beta:g})",
                looks, samples, tuple(states))
        return SequentialDecision("continue", f"no decision after {looks} looks ({ne} "
                                  "candidate requests)", looks, samples, tuple(states))
