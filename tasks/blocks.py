"""Block statistics: the time block, not the request, as the unit of evidence. Pure.

Requests of one version are serially correlated (its own queue, batcher and instances in
Triton; a slow neighbour lasts seconds), and errors come in bursts (a bad batch, a restart,
a timeout storm). A test that counts requests as independent then sees far more evidence
than there is. Blocks of time are much closer to independent, so the rules judge block
statistics:

- **Batch means** (Schmeiser, "Batch size effects in the analysis of simulation output",
  Operations Research 30(3), 1982; Glynn & Whitt, 1991): split the run into ``B`` = 30-50
  blocks of equal time, take one statistic per block, and use the spread of the block
  statistics as the variance of their mean, with Student's t on ``B - 1`` degrees of freedom.
  :func:`block_ids`, :func:`block_count`, :func:`block_sums`, :func:`mean_test`.
- **HAC variance** (Newey & West, Econometrica 55(3), 1987): the block means may still be
  correlated when the dependence outlasts a block; the Bartlett-weighted long-run variance
  of the block series (:func:`long_run_variance`) covers that, never below the plain one.
- **Overdispersion** of counts (McCullagh & Nelder, *Generalized Linear Models*, 2nd ed.,
  1989, §4.5.2, the quasi-binomial model): Pearson's χ² of the per-block error counts over
  its degrees of freedom (:func:`overdispersion`). A burst of 8 errors in one block gives
  φ ≈ 8; independent errors give φ ≈ 1. The exact binomial test on counts deflated by φ
  (``k/φ`` of ``n/φ``, :func:`quasi_binomial_sf`) is the exact test when φ = 1.
- **Incidents** (the clusters of a point process, e.g. Ferro & Segers, "Inference for
  clusters of extreme values", JRSS-B 65(2), 2003): events next to each other in time
  (failed requests, requests above a quantile) merged into runs; the variance of a count
  of clustered events is ``E[L²]/E[L]`` times the count's Poisson variance, with ``L`` the
  run length (:func:`run_lengths`, :func:`cluster_inflation`, normalised by what runs of
  independent events give). Measurable within one block, where a spread across blocks is
  not.
- **Betting confidence sequences** for bounded block means (Waudby-Smith & Ramdas,
  "Estimating means of bounded random variables by betting", JRSS-B 86(1), 2024,
  arXiv:2010.09686): the hedged capital process with predictable plug-in bets
  (:func:`betting_log_e`, :func:`betting_cs`): valid at every look for statistics in
  ``[0, 1]`` whose conditional mean given the past is at most ``m``.
- **Design effect** of a block rule (after Kish, *Survey Sampling*, 1965, §8.2: the
  variance, here the sample size, relative to simple random sampling): the n a rule
  needs when its batch-means test and its whole-run test must both reject, over the n
  of the whole-run z-test alone, by seeded simulation of the normal approximation
  (:func:`design_effect`, :func:`long_run_variances`); ``tasks.gates`` plans with it.
- **Diagnostics** for the report: the lag-1 autocorrelation of the block statistics
  (:func:`lag1`) and the overdispersion, with a flag when either is high
  (:func:`diagnose`).

Typical use::

    ids = block_ids(times_s, block_count(n))          # one block per request
    errors = block_sums(failed.astype(float), ids, b)  # errors per block
    phi = overdispersion(errors, block_sums(np.ones(n), ids, b))
    test = mean_test(per_block_differences)           # batch means + HAC, one-sided
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import special, stats

__all__ = [
    "DESIGN_REPS",
    "HIGH_LAG1",
    "HIGH_OVERDISPERSION",
    "MAX_BLOCKS",
    "MIN_BLOCKS",
    "TARGET_BLOCKS",
    "BlockDiagnostics",
    "MeanTest",
    "betting_cs",
    "betting_log_e",
    "block_count",
    "block_ids",
    "block_sums",
    "cluster_inflation",
    "design_effect",
    "diagnose",
    "lag1",
    "long_run_variance",
    "long_run_variances",
    "mean_test",
    "order_ids",
    "overdispersion",
    "quasi_binomial_sf",
    "run_lengths",
]

TARGET_BLOCKS = 40
"""Blocks per run when there are enough requests: batch means work best with 30-50."""

MIN_BLOCKS = 8
"""Fewest blocks a block test runs on (below it the variance of the block spread is too
noisy to be worth a t-test)."""

MAX_BLOCKS = 50

MIN_PER_BLOCK = 20
"""Fewest requests per arm in a block when there are few requests in all."""

HIGH_LAG1 = 0.3
"""Lag-1 autocorrelation of block statistics above which the report calls it high: the
dependence outlasts a block and the HAC correction is doing real work."""

HIGH_OVERDISPERSION = 2.0
"""Overdispersion (variance / binomial variance) above which the report calls errors bursty."""


def block_count(n: int, *, target: int = TARGET_BLOCKS, min_per_block: int = MIN_PER_BLOCK
                ) -> int:
    """Blocks for ``n`` requests per arm: ``target``, fewer when blocks would hold fewer
    than ``min_per_block`` requests, never below 2 (0 when ``n`` is 0)."""
    if n <= 0:
        return 0
    return int(max(min(target, n // max(min_per_block, 1)), min(2, n)))


def block_ids(times_s: np.ndarray, n_blocks: int, *, start: float | None = None,
              stop: float | None = None) -> np.ndarray:
    """Which of ``n_blocks`` equal-time blocks over ``[start, stop]`` each time falls in.

    ``start``/``stop`` default to the earliest and latest time (give the same span to both
    arms so that their blocks line up). Returns integers in ``[0, n_blocks)``.
    """
    t = np.asarray(times_s, dtype=float).ravel()
    if t.size == 0 or n_blocks <= 0:
        return np.zeros(t.size, dtype=np.int64)
    lo = float(np.min(t)) if start is None else float(start)
    hi = float(np.max(t)) if stop is None else float(stop)
    if not hi > lo:
        return np.zeros(t.size, dtype=np.int64)
    ids = np.floor((t - lo) / (hi - lo) * n_blocks).astype(np.int64)
    return np.clip(ids, 0, n_blocks - 1)


def order_ids(n: int, n_blocks: int) -> np.ndarray:
    """Equal-count blocks by position: for samples known only in time order."""
    if n <= 0 or n_blocks <= 0:
        return np.zeros(max(n, 0), dtype=np.int64)
    return np.minimum(np.arange(n) * n_blocks // n, n_blocks - 1).astype(np.int64)


def block_sums(values: np.ndarray, ids: np.ndarray, n_blocks: int) -> np.ndarray:
    """Sum of ``values`` per block (zeros for empty blocks)."""
    return np.bincount(np.asarray(ids, dtype=np.int64), weights=np.asarray(values, dtype=float),
                       minlength=n_blocks)[:n_blocks].astype(float)


def lag1(series: np.ndarray) -> float:
    """Lag-1 autocorrelation of a series (NaN with fewer than 3 values or none varying)."""
    x = np.asarray(series, dtype=float).ravel()
    if x.size < 3:
        return math.nan
    d = x - x.mean()
    den = float(np.dot(d, d))
    if not den > 0:
        return math.nan
    return float(np.dot(d[:-1], d[1:]) / den)


def long_run_variance(series: np.ndarray, lags: int | None = None) -> float:
    """Long-run variance of a series: the larger of Newey-West's and an AR(1) correction's,
    never below the plain variance.

    - Newey-West (Bartlett kernel), ``lags`` defaulting to ``⌊4 (B/100)^{2/9}⌋`` (at least
      1), the usual rule.
    - AR(1): the plain variance × ``(1 + ρ)/(1 - ρ)`` with ρ the lag-1 autocorrelation after
      Kendall's bias correction (``ρ̂ + (1 + 3ρ̂)/B``, Kendall 1954), capped at 0.95. With 40
      blocks Newey-West alone is biased low when the dependence outlasts a block (10.8%
      false rejections at 5% for block-level φ = 0.5); the AR(1) factor is not.

    Divide by ``B`` for the variance of the series' mean. The floor keeps the test at least
    as strict as the independent one (negative autocorrelation never buys evidence).
    """
    x = np.asarray(series, dtype=float).ravel()
    if x.size < 2:
        return math.nan
    return float(long_run_variances(x[None, :], lags)[0])


def long_run_variances(rows: np.ndarray, lags: int | None = None) -> np.ndarray:
    """:func:`long_run_variance` of every row of a 2-D array at once (rows of ≥ 2 values)."""
    x = np.asarray(rows, dtype=float)
    b = x.shape[1]
    d = x - x.mean(axis=1, keepdims=True)
    ss = np.einsum("ij,ij->i", d, d)
    plain = ss / (b - 1)
    if lags is None:
        lags = max(1, int(4.0 * (b / 100.0) ** (2.0 / 9.0)))
    nw = ss / b
    for lag in range(1, min(lags, b - 1) + 1):
        nw = nw + 2.0 * (1.0 - lag / (lags + 1.0)) * np.einsum(
            "ij,ij->i", d[:, :-lag], d[:, lag:]) / b
    factor = np.ones(x.shape[0])
    if b >= 4:
        with np.errstate(invalid="ignore", divide="ignore"):
            rho = np.einsum("ij,ij->i", d[:, :-1], d[:, 1:]) / ss
        rho_c = np.minimum(rho + (1.0 + 3.0 * rho) / b, 0.95)
        factor = np.where(ss > 0, np.maximum((1.0 + rho_c) / (1.0 - rho_c), 1.0), 1.0)
    out: np.ndarray = np.maximum(np.maximum(nw * b / (b - 1), plain * factor), plain)
    return out


@dataclass(frozen=True)
class MeanTest:
    """A one-sided batch-means test of "the mean of the block statistics ≤ 0".

    Attributes:
        blocks: Block statistics used.
        mean: Their mean.
        se: Standard error of the mean (HAC, see :func:`long_run_variance`).
        p_value: One-sided p-value (Student's t on ``blocks - 1`` df); NaN when undefined.
        lag1: Lag-1 autocorrelation of the block statistics.
    """

    blocks: int
    mean: float
    se: float
    p_value: float
    lag1: float

    def interval(self, confidence: float) -> tuple[float, float]:
        """Two-sided t interval of the mean at ``confidence``."""
        if self.blocks < 2 or not math.isfinite(self.se):
            return math.nan, math.nan
        half = float(stats.t.ppf(0.5 + confidence / 2.0, self.blocks - 1)) * self.se
        return self.mean - half, self.mean + half

    def upper(self, alpha: float) -> float:
        """One-sided upper confidence bound of the mean at level ``1 - alpha``."""
        if self.blocks < 2 or not math.isfinite(self.se):
            return math.nan
        return self.mean + float(stats.t.ppf(1.0 - alpha, self.blocks - 1)) * self.se


def mean_test(series: np.ndarray, weights: np.ndarray | None = None) -> MeanTest:
    """Batch means: H0 "the blocks' mean ≤ 0", one-sided, HAC standard error.

    With ``weights`` (e.g. requests per block) the block statistics are combined as a ratio
    estimator: the weighted mean, with the variance of ``w_b (x_b - mean)`` (the usual
    linearisation); blocks of weight 0 are dropped.
    """
    x = np.asarray(series, dtype=float).ravel()
    if weights is not None:
        w = np.asarray(weights, dtype=float).ravel()
        keep = w > 0
        x, w = x[keep], w[keep]
    else:
        w = np.ones_like(x)
    b = int(x.size)
    if b < 2:
        return MeanTest(b, float(x.mean()) if b else math.nan, math.nan, math.nan, math.nan)
    mean = float(np.sum(w * x) / np.sum(w))
    scaled = w / w.mean() * (x - mean)
    se = math.sqrt(long_run_variance(scaled) / b)
    rho = lag1(x)
    if se > 0:
        p = float(stats.t.sf(mean / se, b - 1))
    else:
        p = 0.0 if mean > 0 else 1.0
    return MeanTest(b, mean, se, p, rho)


DESIGN_REPS = 20_000
"""Simulated runs behind :func:`design_effect` (seeded: the plan is deterministic)."""


@functools.lru_cache(maxsize=512)
def design_effect(alpha: float, power: float, blocks: int = TARGET_BLOCKS) -> float:
    """Sample-size factor of the block rule over the plain test on independent requests.

    A comparative rule rejects only when both its whole-run test (a z-test on independent
    requests, say) and its batch-means test on ``blocks`` blocks (Student's t on
    ``blocks - 1`` df with the :func:`long_run_variance` standard error) reject at
    ``alpha``. A plan sized for the z-test alone, ``n = ((z_α + z_power) σ / δ)²``,
    misses its power: the t quantile is larger than z's, the long-run variance is never
    below the plain one and is random, and both tests must agree. Under the normal
    approximation on independent requests, with noncentrality ``λ = δ √n / σ`` both
    statistics share the same estimate: the z statistic is ``λ + Z`` and the block one
    ``(λ + Z) / S`` with ``Z ~ N(0, 1)`` the standardised mean and ``S²`` the block
    variance estimate over the true one, so the rule rejects when
    ``λ > max(z_α, t_α S) - Z``. The ``power`` quantile of that over
    :data:`DESIGN_REPS` seeded standard-normal runs of ``blocks`` blocks is the ``λ`` the
    rule needs; the factor is ``(λ / (z_α + z_power))²``, ≥ 1 (1.2-1.3 at 40 blocks for
    α = 1%, power 0.9-0.95). Below :data:`MIN_BLOCKS` the block test does not run: 1.
    """
    if blocks < MIN_BLOCKS or not 0 < alpha < 1 or not 0 < power < 1:
        return 1.0
    rng = np.random.default_rng(np.random.SeedSequence([17, blocks]))
    eps = rng.standard_normal((DESIGN_REPS, blocks))
    z_mean = math.sqrt(blocks) * eps.mean(axis=1)
    spread = np.sqrt(long_run_variances(eps))
    za = float(stats.norm.ppf(1.0 - alpha))
    ta = float(stats.t.ppf(1.0 - alpha, blocks - 1))
    need = float(np.quantile(np.maximum(za, ta * spread) - z_mean, power))
    plain = za + float(stats.norm.ppf(power))
    return max((need / plain) ** 2, 1.0) if plain > 0 else 1.0


def overdispersion(counts: np.ndarray, totals: np.ndarray) -> float:
    """Pearson's χ² / df of per-block event counts against one common rate (≥ 1 means
    more clustered than binomial). NaN without events or with fewer than 2 blocks.

    ``counts`` are events per block (errors), ``totals`` trials per block (requests).
    """
    k = np.asarray(counts, dtype=float).ravel()
    n = np.asarray(totals, dtype=float).ravel()
    keep = n > 0
    k, n = k[keep], n[keep]
    if k.size < 2 or not k.sum() > 0:
        return math.nan
    p = float(k.sum() / n.sum())
    if not 0 < p < 1:
        return math.nan
    chi2 = float(np.sum((k - n * p) ** 2 / (n * p * (1 - p))))
    return chi2 / (k.size - 1)


def quasi_binomial_sf(k: float, n: float, rate: float, phi: float = 1.0) -> float:
    """P(X ≥ k) for the errors deflated by the overdispersion: X ~ Bin(n/φ, rate) at k/φ.

    φ ≤ 1 (or NaN) is read as 1, which is the exact binomial tail. Non-integer counts use
    the regularised incomplete beta function, ``P(X ≥ k) = I_rate(k, n - k + 1)``, which is
    the binomial tail at integers and continuous between them.
    """
    if k <= 0:
        return 1.0
    if rate <= 0.0:
        return 0.0
    if rate >= 1.0:
        return 1.0
    f = phi if phi is not None and math.isfinite(phi) and phi > 1.0 else 1.0
    ke, ne = k / f, n / f
    if ke > ne:
        return 0.0
    return float(special.betainc(ke, ne - ke + 1.0, rate))


def run_lengths(events: np.ndarray) -> tuple[int, int]:
    """``(Σ L, Σ L²)`` over the runs of consecutive True values of a boolean sequence."""
    x = np.asarray(events, dtype=bool).ravel()
    if not x.any():
        return 0, 0
    edges = np.diff(np.concatenate([[0], x.astype(np.int8), [0]]))
    lengths = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    return int(lengths.sum()), int(np.dot(lengths, lengths))


def cluster_inflation(sum_len: float, sum_len_sq: float, total: float) -> float:
    """Variance inflation of an event count from its runs: ``(Σ L² / Σ L)`` over what
    independent events at the same rate give, ``(1 + p)/(1 - p)``; at least 1.

    ``sum_len`` is the number of events (:func:`run_lengths`), ``total`` the trials.
    Bursts of 8 failures give ≈ 15 (geometric lengths of mean 8); independent events ≈ 1.
    """
    if not sum_len > 0 or not total > 0:
        return 1.0
    p = min(sum_len / total, 0.999)
    return max((sum_len_sq / sum_len) / ((1.0 + p) / (1.0 - p)), 1.0)


@dataclass(frozen=True)
class BlockDiagnostics:
    """How dependent the evidence was: for the report.

    Attributes:
        blocks: Blocks the run was split into.
        lag1: Lag-1 autocorrelation of the block statistic (NaN when undefined).
        overdispersion: Variance of per-block error counts over the binomial one (NaN
            without errors).
        high: Which of them were high (``lag1``, ``overdispersion``).
    """

    blocks: int
    lag1: float
    overdispersion: float
    high: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "lag1": _finite(self.lag1),
                "overdispersion": _finite(self.overdispersion), "high": list(self.high)}

    def text(self) -> str:
        """One phrase for a message: the figures and what was high."""
        parts = [f"{self.blocks} blocks"]
        if math.isfinite(self.lag1):
            parts.append(f"lag-1 autocorrelation {self.lag1:+.2f}"
                         + (" (high)" if "lag1" in self.high else ""))
        if math.isfinite(self.overdispersion):
            parts.append(f"overdispersion {self.overdispersion:.1f}"
                         + (" (high: errors come in bursts)" if "overdispersion" in self.high
                            else ""))
        return ", ".join(parts)


def diagnose(blocks: int, rho: float, phi: float = math.nan) -> BlockDiagnostics:
    """Diagnostics with the high flags set by :data:`HIGH_LAG1` and :data:`HIGH_OVERDISPERSION`."""
    high = tuple(name for name, hit in (("lag1", math.isfinite(rho) and rho > HIGH_LAG1),
                                        ("overdispersion", math.isfinite(phi)
                                         and phi > HIGH_OVERDISPERSION)) if hit)
    return BlockDiagnostics(blocks, rho, phi, high)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ------------------------------------------------------------------------- betting


def betting_log_e(x: np.ndarray, m: float, *, alpha: float = 0.05,
                  side: str = "upper") -> np.ndarray:
    """Running log wealth of the betting test of "mean ≤ m" (``side="upper"``: evidence that
    the mean is above ``m``) or "mean ≥ m" (``side="lower"``), for statistics in [0, 1].

    The capital is ``Π (1 + λ_i (x_i - m))`` (sign flipped for ``lower``) with the
    predictable plug-in bet of Waudby-Smith & Ramdas (2024, eq. 26):
    ``λ_i = min(sqrt(2 log(1/α) / (σ̂²_{i-1} i log(i+1))), c / m)`` with the running
    variance ``σ̂²`` (prior 1/4) and ``c = 1/2`` (a bet never risks more than half the
    wealth). A non-negative supermartingale when each ``x_i`` has conditional mean ≤ ``m``
    (≥ for ``lower``), so by Ville's inequality it crosses ``log(1/α)`` with probability
    ≤ α at any look.
    """
    xs = np.clip(np.asarray(x, dtype=float).ravel(), 0.0, 1.0)
    t = xs.size
    if t == 0:
        return np.zeros(0)
    sign = 1.0 if side == "upper" else -1.0
    i = np.arange(1, t + 1, dtype=float)
    mu = (0.5 + np.cumsum(xs)) / (i + 1.0)
    var = (0.25 + np.cumsum((xs - mu) ** 2)) / (i + 1.0)
    var_prev = np.concatenate([[0.25], var[:-1]])
    lam = np.sqrt(2.0 * math.log(1.0 / alpha) / (var_prev * i * np.log(i + 1.0)))
    cap = 0.5 / m if sign > 0 else 0.5 / max(1.0 - m, 1e-12)
    lam = np.minimum(lam, cap)
    steps = np.log1p(np.maximum(sign * lam * (xs - m), -1.0 + 1e-12))
    return np.cumsum(steps)


def betting_cs(x: np.ndarray, alpha: float, *, grid: int = 1000) -> tuple[float, float]:
    """Two-sided ``1 - alpha`` confidence sequence for the mean of statistics in [0, 1],
    after all of ``x`` (the hedged capital of Waudby-Smith & Ramdas 2024, §4.3).

    The set is every ``m`` on a grid of ``grid`` points where neither one-sided betting
    test at ``alpha/2`` has crossed (running maximum: once excluded, ``m`` stays out).
    Returns ``(low, high)``; ``(0, 1)`` without data.
    """
    xs = np.clip(np.asarray(x, dtype=float).ravel(), 0.0, 1.0)
    if xs.size == 0:
        return 0.0, 1.0
    level = math.log(2.0 / alpha)
    ms = (np.arange(grid) + 0.5) / grid
    inside = np.ones(grid, dtype=bool)
    for j, m in enumerate(ms):
        up = betting_log_e(xs, float(m), alpha=alpha / 2, side="upper")
        down = betting_log_e(xs, float(m), alpha=alpha / 2, side="lower")
        inside[j] = not (np.max(up) >= level or np.max(down) >= level)
    if not inside.any():
        mean = float(xs.mean())
        return mean, mean
    kept = ms[inside]
    return float(kept[0] - 0.5 / grid), float(kept[-1] + 0.5 / grid)
