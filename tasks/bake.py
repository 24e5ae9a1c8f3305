"""Stage 9, bake: watch the fleet after the swap; a breach rolls back (SageMaker's baking
period). Load is part of the evidence: a traffic surge is never blamed on the new version.

The bake sends a light probe load of golden rows across every replica (so there is always
evidence, even with no organic traffic) and, window by window, reads Triton's metrics on
every replica. **Each window is one block of evidence** (a time block, not a request:
requests of one version are serially correlated through its queue, batcher and instances,
and errors come in bursts). Every window records, next to its latency and errors, the
**load** the fleet carried (:func:`modelship.triton.metrics.load_of`, per replica and in
all): the request rate Triton counted (``nv_inference_request_success`` +
``..._failure`` per second, organic traffic included), the time-average requests in flight
(Little's law on ``nv_inference_request_duration_us``), the
``nv_inference_pending_request_count`` gauge, and the mean queue and compute µs per
request. The pre-swap **reference** is ``baseline_s`` of the same probe on the production
version, cut into the same windows, with the same figures.

Rules (pure: :func:`judge_windows`; the I/O around them is :func:`measure_window`):

- **errors** (``bake.max_error_rate``, level ``bake.alpha``): the unit is the window's
  error fraction ``x_w`` (failed / all requests, probe failures plus Triton's count). H0:
  each window's fraction has (conditional) mean ≤ the budget ``b``. The test is a betting
  e-process, a mixture with equal weights of the capital processes
  ``Π_w (1 + λ (x_w − b))`` for bets ``λ·b`` in :data:`ERROR_BETS` (Waudby-Smith and
  Ramdas, "Estimating means of bounded random variables by betting", JRSS-B 86(1), 2024):
  a non-negative supermartingale under H0 **whatever the dependence inside a window**, so
  a burst of failures is one large observation, not many independent ones. It breaches at
  ``1 / alpha`` (Ville's inequality: ≤ ``alpha`` false rollbacks over the whole bake,
  however many windows). The per-request Bernoulli e-process this replaces rolled back 64%
  of one-hour bakes of a version exactly at its budget when errors came in bursts of 8.
  The price: one window is proof only when it is far beyond the budget (50% failures
  against 0.1%: e-value ≈ 147 from one window; 10% against 1% takes three windows);
  ``max_error_rate: 0`` still rolls back at the first failure. The record gives
  the measured overdispersion of the per-window counts and the lag-1 autocorrelation of
  the fractions (:func:`tasks.blocks.diagnose`). The bake's own adaptive bet
  (:func:`tasks.blocks.betting_log_e`) is built for means near ½ and bets far too little
  on rare failures, hence the fixed grid.
- **latency**, one rule per ``q`` of ``bake.latency_quantiles`` (p50 and p90 by default),
  ``alpha`` split evenly. Block statistic: the log of the window's q-quantile of the probe's
  client-side latencies. The rule compares the windows since the swap with the reference
  windows: a two-sample batch-means t-test of H0 "mean log block quantile after ≤ before +
  log(1 + max_latency_increase_pct / 100)" (at least ``min_latency_effect_us``), with the
  variance of the pooled, centred block series from :func:`tasks.blocks.long_run_variance`
  (Newey-West / AR(1)-corrected: a **measured variance inflation**, so dependence that
  outlasts a window widens the interval instead of creating evidence; Schmeiser 1982,
  Newey and West 1987). It looks at a fixed schedule of judged-window counts (2, 4, 8, …)
  and at the end of the bake; ``α_q`` is split over the looks by Bonferroni, half of it on
  the last one (a group-sequential design: Pocock 1977 for repeated looks, Bonferroni for
  the spending), so false rollbacks stay ≤ ``α_q`` however the bake ends. A two-sample test
  instead of a fixed bound on the reference: the old rule lifted θ0 by a Clopper-Pearson
  bound on 160 reference requests (p50 0.5 → 0.61), which made the real tolerance +45-50%,
  and it looked at per-request exceedances as if independent.
  **Load-matched control.** A window is judged on latency only when the fleet's request
  rate is within ±``load_tolerance_pct`` of the reference's (``load_departure``); otherwise
  the latency rules **hold** for that window: no rollback and no pass on latency alone,
  the record lists the held windows with the rate against the reference's. Errors are
  judged in every window. A bake whose latency held in *every* window ends ``held``: the
  release completes (a hold is not evidence against the version, and errors were judged
  throughout), and the record and the release notes say that latency was never judged
  and why. A bake with some windows judged ends ``passed`` with the held ones listed.
  Why the request rate, and why the client-side probe latency:
  - the rate is what the clients send (the probe is open-loop at ``probe_rps``); in-flight
    requests and queue time are not load but a consequence of it *and of the version's
    speed* (L = λW: a slower version at the same rate has more in flight), so matching on
    them would hold exactly when a slower version is at fault. They are recorded as
    evidence, not matched;
  - Triton's server-side compute time (which excludes queueing) was the other candidate.
    Measured on this stack (2 replicas and the canary on 2 CPU cores, the test softmax
    model, probe 80 req/s, 4-s windows, the same version throughout; ``bench/bake_load.py``):
    quiet, 79 req/s, compute 1480 µs per request, probe p50 2.37 ms (per-request log-spread
    0.30); with 1-2 closed-loop organic clients, 700-1400 req/s, compute fell to ×0.5-0.6
    (dynamic batching amortises the backend's per-call cost) while the probe p50 stayed
    ×0.85-1.0; with 12 clients (the window where all of them were sending: 1250 req/s,
    8.9 requests in flight) compute rose ×2.8 (4170 µs: CPU contention, the replicas share
    two cores with the clients; ×1.7 over the level's three windows), queue ×10, and the
    probe p50 ×2.1 (``bench/results/bake_load.json``). Compute time moves with load in
    both directions, so it is no load-free control on CPU servers; the probe latency at a
    matched rate is (queueing included, which at a matched rate is the version's own
    doing). Both are recorded.
  - a concurrent control (issue 20: a holdback share of live traffic on the previous
    version, through the gateway) plugs in as a :class:`Reference` of kind ``holdback``
    whose windows are measured at the same time as the bake's: it covers every load, so
    nothing is held, and the same test judges it.
  The load match assumes that the latency is flat within the band; near saturation a
  +20% rate can cost more than the tolerance (queueing), so keep ``load_tolerance_pct``
  small where the fleet runs hot. A noisy neighbour that is not traffic (another process
  on the node) is invisible to Triton's metrics; only a concurrent control sees it.
- **a replica that stops answering** (its metrics or its requests) is an infrastructure
  outcome, never a pass.

The effective tolerance (:func:`effective_tolerance_pct`): the latency increase that the
p50 rule catches with probability 0.9 by the end of the bake, at matched load; the named
tolerance plus what the reference's and the bake's finite samples cost. ``promote
--dry-run`` prints it for a per-request log-spread of :data:`ASSUMED_LOG_SD`, and each
bake records it for the spread it measured. The default ``baseline_s``/``probe_rps`` size
the reference so that +30% is caught ≥ 90% within a 120-s bake (``bench/judge_bake.py``).

Each window also records, per replica that exports them (a GPU server), the ``nv_gpu_*``
gauges at the window's end (:func:`modelship.triton.gpu.summarize`): evidence in the
record, not a rule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from scipy import special, stats

from modelship.errors import ModelshipError
from modelship.jsonable import jsonable
from modelship.loadgen import LoadSpec, run_load_sync
from modelship.policy import BakePolicy
from modelship.progress import Progress, quiet
from modelship.triton.client import TritonServer
from modelship.triton.gpu import parse_gpu_metrics, summarize
from modelship.triton.metrics import (
    Scrape,
    delta,
    load_of,
    mean_compute_us,
    mean_queue_us,
    parse_metrics,
    scrape_text,
)
from tasks.blocks import HIGH_LAG1, diagnose, lag1, long_run_variance, overdispersion

Outcome = Literal["passed", "held", "breach", "infrastructure"]

ERROR_BETS: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.5, 0.9)
"""The error rule's bets, as ``λ·b`` (the share of the capital staked on one window's
failures against the budget ``b``): small bets win on failure rates a little over the
budget, large ones on many failures at once."""

MIN_BLOCK_PROBES = 10
"""Answered probe requests a window needs to give a latency block statistic."""

ASSUMED_LOG_SD = 0.3
"""Per-request spread of the probe's log latency that ``--dry-run``'s effective tolerance
assumes (a CPU model's; each bake records the one it measured)."""

POWER_Z = float(stats.norm.ppf(0.9))
"""The effective tolerance is the increase caught with this power (0.9)."""

MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2.0)
"""Standard error of a sample median over that of a mean, for normal data."""


@dataclass(frozen=True)
class Window:
    """What one window of the watch saw on the whole fleet (one block of evidence).

    Attributes:
        requests: Answered requests (probe) plus successes Triton counted for the version.
        errors: Failed probe requests plus failures Triton counted for the version.
        server_us: Mean server-side latency per request (queue + compute), in µs; None
            without server-side data.
        unreachable: Replicas whose metrics or requests did not answer, with why.
        gpu: Per replica exporting ``nv_gpu_*`` (a GPU server), its GPUs at the window's
            end (:func:`modelship.triton.gpu.summarize`); empty on CPU servers.
        latencies_ms: Client-side latency of each answered probe request, in ms (the
            latency rules' samples; summarized, not listed, in ``to_dict``).
        queue_us: Mean time a request queued in Triton, in µs (None without data).
        compute_us: Mean compute time per request, in µs (None without data).
        rate_rps: Requests per second Triton finished for the version, every replica,
            organic traffic included (None without server-side data).
        inflight: Time-average requests inside the servers (Little's law), all replicas.
        pending: ``nv_inference_pending_request_count`` at the window's end, all replicas.
        probe_requests: Requests the probe sent in the window.
        replicas: Per replica: ``rate_rps``, ``inflight``, ``pending``, ``queue_us``,
            ``compute_us``, ``requests``, ``failures``.
    """

    index: int
    seconds: float
    requests: int
    errors: int
    server_us: float | None
    unreachable: dict[str, str] = field(default_factory=dict)
    error_texts: dict[str, int] = field(default_factory=dict)
    gpu: dict[str, dict[str, Any]] = field(default_factory=dict)
    latencies_ms: tuple[float, ...] = field(default=(), repr=False)
    queue_us: float | None = None
    compute_us: float | None = None
    rate_rps: float | None = None
    inflight: float | None = None
    pending: float | None = None
    probe_requests: int = 0
    replicas: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: A holdback's window only: why it is no control although it was measured (the
    #: router did not hold the holdback's share through it; :class:`Holdback` ``check``).
    held_for: str | None = None

    @property
    def load_rps(self) -> float | None:
        """The request rate the latency rules match on: Triton's count per second, or the
        window's answered and failed requests per second when no server figure exists."""
        if self.rate_rps is not None:
            return self.rate_rps
        if self.seconds > 0 and self.requests + self.errors > 0:
            return (self.requests + self.errors) / self.seconds
        return None

    def to_dict(self) -> dict[str, Any]:
        probe: dict[str, Any] = {}
        if self.latencies_ms:
            values = np.asarray(self.latencies_ms)
            probe = {"probe_ms": {"answered": int(values.size),
                                  **{f"p{q:g}": round(float(np.percentile(values, q)), 3)
                                     for q in (50, 90, 99)}}}
        load = {"rate_rps": _round(self.load_rps, 2), "inflight": _round(self.inflight, 3),
                "pending": self.pending, "queue_us": _round(self.queue_us, 1),
                "compute_us": _round(self.compute_us, 1),
                "probe_requests": self.probe_requests}
        return jsonable({"index": self.index, "seconds": round(self.seconds, 3),
                         "requests": self.requests, "errors": self.errors,
                         "server_us": _round(self.server_us, 1), "load": load,
                         "unreachable": self.unreachable, "error_texts": self.error_texts,
                         **probe, **({"gpu": self.gpu} if self.gpu else {}),
                         **({"replicas": self.replicas} if self.replicas else {}),
                         **({"held_for": self.held_for} if self.held_for else {})})


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


@dataclass(frozen=True)
class Reference:
    """The latency rules' control: windows measured on the previous version.

    ``pre-swap``: ``baseline_s`` of the probe on production just before the swap, covering
    the load it saw (its request rate ±``load_tolerance_pct``). ``holdback`` (issue 20
    item 4, :class:`Holdback`): windows of the previous version on a share of the same live
    traffic at the same time (probed in the same runs), which cover any load.
    """

    windows: tuple[Window, ...]
    kind: Literal["pre-swap", "holdback"] = "pre-swap"

    @property
    def rate_rps(self) -> float | None:
        """The reference's request rate: the time-weighted mean of its windows'."""
        seen = [(w.load_rps, w.seconds) for w in self.windows
                if w.load_rps is not None and w.seconds > 0]
        if not seen:
            return None
        return sum(r * s for r, s in seen) / sum(s for _, s in seen)

    def to_dict(self) -> dict[str, Any]:
        latencies = [x for w in self.windows for x in w.latencies_ms]
        summary: dict[str, Any] = {}
        if latencies:
            values = np.asarray(latencies)
            summary = {"probe_ms": {"answered": int(values.size),
                                    **{f"p{q:g}": round(float(np.percentile(values, q)), 3)
                                       for q in (50, 90, 99)}}}
        return jsonable({"kind": self.kind, "rate_rps": _round(self.rate_rps, 2),
                         "seconds": round(sum(w.seconds for w in self.windows), 3),
                         "requests": sum(w.requests for w in self.windows),
                         "errors": sum(w.errors for w in self.windows), **summary,
                         "windows": [w.to_dict() for w in self.windows]})


Baseline = Reference | Window | Sequence[Window] | None
"""What the judge accepts as the reference: a :class:`Reference`, or windows (one window
is a reference of one block, as older callers pass it)."""


def as_reference(baseline: Baseline) -> Reference | None:
    """The reference of whatever the caller passed (pure)."""
    if baseline is None or isinstance(baseline, Reference):
        return baseline
    if isinstance(baseline, Window):
        return Reference((baseline,))
    return Reference(tuple(baseline)) if baseline else None


@dataclass(frozen=True)
class BakeVerdict:
    """The bake's verdict, with what each rule saw.

    Attributes:
        outcome: ``passed`` | ``held`` (latency never judged: the load left the
            reference's in every window; errors judged and fine) | ``breach`` |
            ``infrastructure``.
        reason: One sentence: the rule, its evidence and its bound.
        latency: The latency rules' state: windows judged and held (with why), the last
            look of each rule, the effective tolerance.
        errors: The error rule's state: e-value, failures, overdispersion, lag-1.
    """

    outcome: Outcome
    reason: str
    latency: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return jsonable({"outcome": self.outcome, "reason": self.reason,
                         **({"latency": self.latency} if self.latency else {}),
                         **({"errors": self.errors} if self.errors else {})})


def judge_window(window: Window) -> str | None:
    """Why this window is no evidence at all (nothing answered or failed), or None. Pure."""
    if window.requests + window.errors == 0:
        return f"window {window.index}: no request was answered or failed (no evidence)"
    return None


# ------------------------------------------------------------------------------ errors


def error_log_e(fractions: np.ndarray, budget: float) -> float:
    """log of the error rule's e-process after these per-window error fractions (pure).

    The equal-weight mixture over :data:`ERROR_BETS` of ``Π (1 + λ (x_w − b))``,
    ``λ = bet / b``; 0 without windows. With ``b = 0`` any failure is certain (``inf``).
    """
    path = error_log_e_path(fractions, budget)
    return float(path[-1]) if path.size else 0.0


def error_log_e_path(fractions: np.ndarray, budget: float) -> np.ndarray:
    """:func:`error_log_e` after each window (pure): the e-process's whole path."""
    x = np.clip(np.asarray(fractions, dtype=float).ravel(), 0.0, 1.0)
    if x.size == 0:
        return np.zeros(0)
    if budget <= 0.0:
        return np.where(np.cumsum(x) > 0, math.inf, 0.0)
    bets = np.asarray(ERROR_BETS)[:, None] / budget
    logs = np.cumsum(np.log1p(bets * (x[None, :] - budget)), axis=1)
    return np.asarray(special.logsumexp(logs, axis=0) - math.log(len(ERROR_BETS)))


def error_state(windows: Sequence[Window], policy: BakePolicy) -> dict[str, Any]:
    """The error rule on the windows so far (pure): e-value, totals and diagnostics."""
    failed = np.asarray([w.errors for w in windows], dtype=float)
    total = failed + np.asarray([w.requests for w in windows], dtype=float)
    seen = total > 0
    fractions = failed[seen] / total[seen]
    log_e = error_log_e(fractions, policy.max_error_rate)
    phi = overdispersion(failed[seen], total[seen]) if seen.sum() >= 2 else math.nan
    found = diagnose(int(seen.sum()), lag1(fractions), phi)
    return {"failed": int(failed.sum()), "requests": int(total.sum()),
            "log_e": log_e, "bound": 1.0 / policy.alpha, "diagnostics": found}


def errors_over_budget(windows: Sequence[Window], policy: BakePolicy) -> str | None:
    """Why the failures so far show an error rate above ``max_error_rate``, or None.

    Always valid at every window, bursts included (see the module docstring); pure.
    """
    state = error_state(windows, policy)
    failed, total, log_e = state["failed"], state["requests"], state["log_e"]
    if failed == 0 or total == 0 or log_e < math.log(state["bound"]):
        return None
    texts: dict[str, int] = {}
    for window in windows:
        for text, count in window.error_texts.items():
            texts[text] = texts.get(text, 0) + count
    top = ", ".join(f"{k} ×{v}" for k, v in list(texts.items())[:3])
    evidence = "certain" if math.isinf(log_e) else f"e-value {math.exp(min(log_e, 700)):.3g}"
    budget = policy.max_error_rate
    return (f"window {windows[-1].index}: error rate {failed / total:.2%} ({failed} of "
            f"{total} since the swap, {len(windows)} windows as blocks: "
            f"{state['diagnostics'].text()}) is above the bake's {budget:.2%} ({evidence} "
            f"≥ 1/α = {state['bound']:g})" + (f" ({top})" if top else ""))


# ----------------------------------------------------------------------------- latency


def total_windows(policy: BakePolicy) -> int:
    """Windows in the whole bake."""
    return int(math.ceil(policy.duration_s / policy.window_s)) if policy.duration_s else 0


def look_plan(windows: int, alpha_q: float) -> tuple[dict[int, float], float]:
    """When a latency rule looks, and at which level (pure).

    Returns ``({judged windows: α at that look}, α at the end of the bake)``: looks at 2,
    4, 8, … judged windows (below the bake's ``windows``) share half of ``α_q``, the end of
    the bake has the other half (all of it when there is no earlier look). The levels add
    up to ``α_q`` (Bonferroni over a schedule fixed in advance).
    """
    points = []
    n = 2
    while n < windows:
        points.append(n)
        n *= 2
    if not points:
        return {}, alpha_q
    each = alpha_q / 2.0 / len(points)
    return {p: each for p in points}, alpha_q / 2.0


def load_departure(window: Window, reference: Reference, policy: BakePolicy) -> str | None:
    """Why the load in ``window`` is outside what the reference covers, or None (pure).

    A ``holdback`` control saw the same traffic at the same time: it covers any load.
    """
    if reference.kind == "holdback":
        return None
    before, now = reference.rate_rps, window.load_rps
    if before is None or now is None or before <= 0:
        return f"window {window.index}: no request rate to match against the reference"
    band = 1.0 + policy.load_tolerance_pct / 100.0
    if now > before * band or now < before / band:
        return (f"window {window.index}: {now:.1f} req/s against {before:.1f} req/s in the "
                f"reference (×{now / before:.2f}, outside ±{policy.load_tolerance_pct:g}%)")
    return None


def block_stats(window: Window, quantiles: Sequence[float]) -> list[float | None]:
    """The window's latency block statistic per quantile ``q``: the log of its probe's
    q-quantile (ms, linear interpolation as ``numpy.quantile``), or None with fewer than
    :data:`MIN_BLOCK_PROBES` answered probe requests. Pure."""
    values = np.asarray(window.latencies_ms, dtype=float)
    values = np.sort(values[np.isfinite(values) & (values > 0)])
    n = int(values.size)
    if n < MIN_BLOCK_PROBES:
        return [None] * len(quantiles)
    out: list[float | None] = []
    for q in quantiles:
        pos = q * (n - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        out.append(math.log(float(values[lo] + (pos - lo) * (values[hi] - values[lo]))))
    return out


@dataclass(frozen=True)
class TwoSample:
    """Batch means, after against before, on log block statistics.

    Attributes:
        diff: Mean after minus mean before (log ratio of typical block quantiles).
        se: Its standard error (pooled long-run variance of the centred blocks).
        df: Degrees of freedom (blocks − 2).
        block_sd: The pooled per-block spread (sqrt of the long-run variance).
        lag1: Lag-1 autocorrelation of the pooled centred block series.
    """

    diff: float
    se: float
    df: int
    block_sd: float
    lag1: float

    def p_value(self, margin: float) -> float:
        """One-sided p of H0 ``diff ≤ margin`` (Student's t)."""
        if not self.se > 0:
            return 0.0 if self.diff > margin else 1.0
        return float(special.stdtr(max(self.df, 1), -(self.diff - margin) / self.se))

    def upper(self, alpha: float) -> float:
        """Upper ``1 - alpha`` confidence bound of ``diff``."""
        return self.diff + float(special.stdtrit(max(self.df, 1), 1.0 - alpha)) * self.se


def two_sample(before: np.ndarray, after: np.ndarray) -> TwoSample | None:
    """The two-sample batch-means comparison of block statistics, or None with fewer than
    two blocks before or none after (pure)."""
    b = np.asarray(before, dtype=float).ravel()
    a = np.asarray(after, dtype=float).ravel()
    if b.size < 2 or a.size < 1:
        return None
    resid = np.concatenate([b - b.mean(), a - a.mean()])
    df = int(b.size + a.size - 2)
    if df < 1:
        return None
    variance = long_run_variance(resid) * (resid.size - 1) / df  # two means estimated
    sd = math.sqrt(max(variance, 0.0))
    return TwoSample(diff=float(a.mean() - b.mean()),
                     se=sd * math.sqrt(1.0 / b.size + 1.0 / a.size), df=df, block_sd=sd,
                     lag1=lag1(resid))


def paired(control: np.ndarray, after: np.ndarray) -> TwoSample | None:
    """The paired comparison of block statistics measured at the same time (a holdback
    control and the fleet, window by window), or None with fewer than two pairs (pure):
    the mean of the per-window differences, with the long-run variance of the differences
    (what both arms share in a window, a surge, cancels out)."""
    c = np.asarray(control, dtype=float).ravel()
    a = np.asarray(after, dtype=float).ravel()
    if c.size != a.size or a.size < 2:
        return None
    d = a - c
    resid = d - d.mean()
    df = int(d.size - 1)
    sd = math.sqrt(max(long_run_variance(resid) * d.size / df, 0.0))
    return TwoSample(diff=float(d.mean()), se=sd / math.sqrt(d.size), df=df, block_sd=sd,
                     lag1=lag1(resid))


def margin_log(policy: BakePolicy, reference_ms: float) -> float:
    """The rule's tolerance on the log scale: ``log(1 + pct/100)``, at least the noise
    floor ``min_latency_effect_us`` over the reference's quantile."""
    ratio = 1.0 + policy.max_latency_increase_pct / 100.0
    floor = 1.0 + policy.min_latency_effect_us / 1000.0 / reference_ms if reference_ms > 0 \
        else 1.0
    return math.log(max(ratio, floor))


def effective_tolerance_pct(policy: BakePolicy, block_sd: float | None = None,
                            reference_blocks: int | None = None) -> float:
    """The latency increase (percent) that the p50 rule catches with probability 0.9 by the
    end of a bake that judged every window, at matched load (pure).

    ``block_sd`` is the spread of a window's log median; by default the one of
    :data:`ASSUMED_LOG_SD` per request at the policy's probe rate and window length. The
    reference has ``baseline_s / window_s`` blocks unless given.
    """
    n = max(total_windows(policy), 1)
    m = reference_blocks or max(int(round(policy.baseline_s / policy.window_s)), 2)
    if block_sd is None:
        per_window = max(policy.probe_rps * policy.window_s, 1.0)
        block_sd = MEDIAN_EFFICIENCY * ASSUMED_LOG_SD / math.sqrt(per_window)
    quantiles = policy.latency_quantiles or [0.5]
    _, final = look_plan(n, policy.alpha / len(quantiles))
    z = float(special.stdtrit(max(n + m - 2, 1), 1.0 - final)) + POWER_Z
    ratio = 1.0 + policy.max_latency_increase_pct / 100.0
    return 100.0 * (ratio * math.exp(z * block_sd * math.sqrt(1.0 / n + 1.0 / m)) - 1.0)


def plan(policy: BakePolicy) -> dict[str, Any]:
    """What the bake will do, for ``promote --dry-run`` (pure): durations, levels, looks and
    the effective latency tolerance (see :func:`effective_tolerance_pct`)."""
    n = total_windows(policy)
    quantiles = policy.latency_quantiles
    points, final = look_plan(n, policy.alpha / max(len(quantiles), 1))
    blocks = int(math.ceil(policy.baseline_s / policy.window_s))
    effective = effective_tolerance_pct(policy) if quantiles and n and blocks >= 2 else None
    return jsonable({
        "duration_s": policy.duration_s, "window_s": policy.window_s, "windows": n,
        "baseline_s": policy.baseline_s, "probe_rps": policy.probe_rps,
        "max_error_rate": policy.max_error_rate, "alpha": policy.alpha,
        "max_latency_increase_pct": policy.max_latency_increase_pct,
        "latency_quantiles": quantiles, "load_tolerance_pct": policy.load_tolerance_pct,
        "holdback_pct": policy.holdback_pct,
        "control": (f"holdback: the previous version answers {policy.holdback_pct:g} % of "
                    "live traffic on the canary Triton; each window is compared with the "
                    "holdback's window of the same time (a first release: none)"
                    if policy.holdback_pct > 0 else
                    f"pre-swap reference: {policy.baseline_s:g} s of the probe on production"),
        "latency_looks": {"judged_windows": sorted(points), "at_end": True,
                          "alpha_each": (next(iter(points.values())) if points else None),
                          "alpha_at_end": final},
        "effective_tolerance_pct": None if effective is None else round(effective, 1),
        "effective_tolerance": (
            "latency not judged: baseline_s covers fewer than 2 windows of window_s, so the "
            "reference has no spread to compare with" if quantiles and n and blocks < 2 else
            None if effective is None else
            f"+{effective:.1f}% latency at unchanged load is caught with probability 0.9 "
            f"by the end of a {policy.duration_s:g}-s bake (tolerance "
            f"+{policy.max_latency_increase_pct:g}%, {policy.baseline_s:g} s of pre-swap "
            f"reference at {policy.probe_rps:g} req/s, assuming a per-request log-spread "
            f"of {ASSUMED_LOG_SD:g}; the bake records the one it measures)"),
    })


def latency_state(windows: Sequence[Window], reference: Reference | None,
                  policy: BakePolicy) -> dict[str, Any]:
    """Every latency rule after these windows (pure): which windows were judged and which
    held, and each rule's looks so far; ``breach`` names the first rule that crossed."""
    quantiles = policy.latency_quantiles
    state: dict[str, Any] = {"judged": 0, "held": {}, "rules": [], "breach": None}
    ref_rows = [block_stats(w, quantiles) for w in reference.windows] \
        if reference is not None else []
    if reference is None or not quantiles or reference.kind != "holdback" and sum(
            all(x is not None for x in row) for row in ref_rows) < 2:
        state["status"] = "off" if not quantiles else "no reference"
        return state
    concurrent = reference.kind == "holdback"  # the control's window of the same index
    control_by_index = {w.index: row for w, row in zip(reference.windows, ref_rows,
                                                        strict=True)}
    held, judged = _held_or_judged(windows, reference, policy, control_by_index)
    state.update(judged=len(judged), held=held, reference_rate_rps=reference.rate_rps,
                 load_tolerance_pct=policy.load_tolerance_pct)
    n_total = total_windows(policy)
    alpha_q = policy.alpha / len(quantiles)
    points, final_alpha = look_plan(n_total, alpha_q)
    bake_over = len(windows) >= n_total > 0
    judged_rows = [block_stats(w, quantiles) for w in judged]
    for j, q in enumerate(quantiles):
        before = np.asarray([row[j] for row in ref_rows if row[j] is not None])
        stat_by_count: list[float] = []
        control_by_count: list[float] = []
        rule: dict[str, Any] = {"rule": f"latency_p{q * 100:g}", "quantile": q,
                                "reference_blocks": int(before.size), "looks": 0}
        breach = None
        for count, window in enumerate(judged, start=1):
            stat = judged_rows[count - 1][j]
            mate = control_by_index.get(window.index, [None] * len(quantiles))[j] \
                if concurrent else None
            if stat is not None and (mate is not None or not concurrent):
                stat_by_count.append(stat)
                if mate is not None:
                    control_by_count.append(mate)
            level = points.get(count)
            last = bake_over and count == len(judged)
            if level is None and not last:
                continue
            for alpha_look in ([level] if level is not None else []) + \
                    ([final_alpha] if last else []):
                test = paired(np.asarray(control_by_count), np.asarray(stat_by_count)) \
                    if concurrent else two_sample(before, np.asarray(stat_by_count))
                if test is None:
                    continue
                margin = margin_log(policy, math.exp(float(before.mean())))
                p = test.p_value(margin)
                rule.update(looks=rule["looks"] + 1, judged_blocks=len(stat_by_count),
                            ratio=math.exp(test.diff),
                            upper_ratio=math.exp(test.upper(alpha_look)),
                            tolerance_ratio=math.exp(margin), p_value=p, alpha=alpha_look,
                            block_sd=test.block_sd, lag1=test.lag1,
                            lag1_high=bool(test.lag1 > HIGH_LAG1),
                            effective_tolerance_pct=effective_tolerance_pct(
                                policy, test.block_sd, int(before.size)))
                if p <= alpha_look and breach is None:
                    breach = (window, test, margin, p, alpha_look)
            if breach is not None:
                break
        state["rules"].append(rule)
        if breach is not None and state["breach"] is None:
            control = (f"the holdback's windows of the same time, {len(control_by_count)} "
                       "pairs; concurrent control" if concurrent else
                       f"{before.size} pre-swap windows at {reference.rate_rps or 0:.1f} "
                       "req/s; matched load")
            state["breach"] = _breach_text(rule["rule"], len(stat_by_count), control,
                                           alpha_q, *breach)
    state["status"] = ("nothing to judge" if not windows else "held" if not judged
                       else "partly held" if held else "judged")
    return state


def _held_or_judged(windows: Sequence[Window], reference: Reference, policy: BakePolicy,
                    control_rows: Mapping[int, Sequence[float | None]]
                    ) -> tuple[dict[int, str], list[Window]]:
    """The windows held (by index, with why: the load left the reference's, or the
    holdback has no window of the same time) and the judged ones (pure)."""
    held: dict[int, str] = {}
    judged: list[Window] = []
    for window in windows:
        why = load_departure(window, reference, policy) or (
            thin_control(window, reference, control_rows) if reference.kind == "holdback"
            else None)
        if why is not None:
            held[window.index] = why
        else:
            judged.append(window)
    return held, judged


def thin_control(window: Window, reference: Reference,
                 control_rows: Mapping[int, Sequence[float | None]]) -> str | None:
    """Why ``window`` has no holdback window of the same time to be compared with, or None
    (pure): the holdback answered fewer than :data:`MIN_BLOCK_PROBES` probe requests then
    (a small ``holdback_pct`` does not thin the probe, which goes to every target alike;
    a holdback that failed or was slow does). Such a window is held, never judged nor
    failed: the concurrent control is what the bake compares with. A holdback window the
    router did not carry the holdback's share through (``held_for``) is no control either."""
    mate = next((w for w in reference.windows if w.index == window.index), None)
    if mate is not None and mate.held_for:
        return mate.held_for
    row = control_rows.get(window.index)
    if row is not None and all(x is not None for x in row):
        return None
    answered = 0 if mate is None else len(mate.latencies_ms)
    return (f"window {window.index}: the holdback answered {answered} probe requests in the "
            f"same time, fewer than {MIN_BLOCK_PROBES}: no control to compare with")


def _breach_text(rule: str, blocks: int, control: str, alpha_q: float, window: Window,
                 test: TwoSample, margin: float, p: float, alpha_look: float) -> str:
    """What a latency breach says: the rule, the ratio against its control, the tolerance
    and the look's share of alpha (pure)."""
    return (f"window {window.index}: {rule}: the probe's typical {rule.split('_', 1)[1]} "
            f"over {blocks} windows since the swap is ×{math.exp(test.diff):.2f} the "
            f"reference's ({control}), above the tolerance ×{math.exp(margin):.2f} "
            f"(p = {p:.2g} ≤ {alpha_look:.2g}, its share of α_q = {alpha_q:g} at this look; "
            f"windows are blocks: spread {test.block_sd:.3f}, lag-1 {test.lag1:+.2f})")


def latency_over(windows: Sequence[Window], baseline: Baseline,
                 policy: BakePolicy) -> str | None:
    """Why the probe latencies since the swap, at matched load, show a regression beyond
    the tolerance at one of the policy's quantiles, or None (pure)."""
    found: str | None = latency_state(windows, as_reference(baseline), policy)["breach"]
    return found


def _latency_record(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in state.items() if k != "breach"}
    out["held"] = {str(k): v for k, v in state["held"].items()}
    return out


def judge_windows(windows: Sequence[Window], baseline: Baseline,
                  policy: BakePolicy) -> BakeVerdict:
    """The bake's verdict from its windows so far (pure; worst first).

    An unreachable replica is ``infrastructure``; a window with no evidence, errors over
    budget, or latency over the tolerance at matched load (both always-valid over all
    windows so far) are a ``breach``; latency that held in every window (the load left the
    reference's) with errors fine is ``held``; otherwise ``passed``.
    """
    for window in windows:
        if window.unreachable:
            who = "; ".join(f"{k}: {v}" for k, v in window.unreachable.items())
            return BakeVerdict("infrastructure",
                               f"window {window.index}: replicas stopped answering ({who})")
    for window in windows:
        why = judge_window(window)
        if why:
            return BakeVerdict("breach", why)
    errors = error_state(windows, policy)
    error_record = {**{k: v for k, v in errors.items() if k != "diagnostics"},
                    "e_value": math.exp(min(errors["log_e"], 700.0)),
                    **errors["diagnostics"].to_dict()}
    why = errors_over_budget(windows, policy)
    if why:
        return BakeVerdict("breach", why, errors=error_record)
    latency = latency_state(windows, as_reference(baseline), policy)
    record = _latency_record(latency)
    if latency["breach"]:
        return BakeVerdict("breach", latency["breach"], latency=record, errors=error_record)
    if not windows:
        return BakeVerdict("passed", "nothing to watch (bake.duration_s is 0)")
    served = sum(w.requests for w in windows)
    errs = f"errors within {policy.max_error_rate:.2%} ({errors['failed']} failed)"
    if latency["status"] == "held":
        first = next(iter(latency["held"].values()))
        return BakeVerdict("held", f"{len(windows)} windows, {served} requests, {errs}; "
                           f"latency held in every window, not judged (load outside what "
                           f"the reference covers, or no holdback to compare with: {first})",
                           latency=record,
                           errors=error_record)
    held = (f"; latency held in {len(latency['held'])} of {len(windows)} windows (load "
            f"outside the reference's, or no holdback to compare with)"
            if latency["held"] else "")
    return BakeVerdict("passed", f"{len(windows)} windows, {served} requests, no breach: "
                       f"{errs}{held}", latency=record, errors=error_record)


# --------------------------------------------------------------------------------------
# I/O


def _scrape_all(replicas: Sequence[TritonServer], timeout_s: float
                ) -> tuple[dict[str, Scrape], dict[str, str], dict[str, dict[str, Any]]]:
    """Every replica's counters, the replicas that did not answer, and the GPUs of those
    that export ``nv_gpu_*`` (summarized), from one fetch each."""
    def one(server: TritonServer) -> tuple[str, str | None, str | None]:
        try:
            return server.name, scrape_text(server.endpoint.metrics, timeout_s), None
        except ModelshipError as exc:
            return server.name, None, exc.message

    found: dict[str, Scrape] = {}
    failed: dict[str, str] = {}
    gpus: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
        for name, text, error in pool.map(one, replicas):
            if text is None:
                failed[name] = error or "no answer"
                continue
            found[name] = parse_metrics(text)
            seen = parse_gpu_metrics(text)
            if seen:
                gpus[name] = summarize(seen)
    return found, failed, gpus


@dataclass(frozen=True)
class Holdback:
    """The bake's concurrent control (``bake.holdback_pct``, issue 20 item 4): the previous
    version alone on ``server`` (the canary Triton), answering a share of live traffic
    through the router while the fleet bakes the new one.

    ``check``, called after each window with its index, reads the router back: it returns
    None when the share held, or why the window is no control (the share had changed and
    was restored; the window is then held), and raises ``InfrastructureError`` when the
    share cannot be kept (:func:`tasks.holdback.holdback_look`)."""

    server: TritonServer
    version: int
    check: Callable[[int], str | None] | None = field(default=None, compare=False)


def measure_window(replicas: Sequence[TritonServer], *, index: int, model: str,
                   version: int, payload: Mapping[str, np.ndarray], policy: BakePolicy,
                   seconds: float, timeout_s: float) -> Window:
    """Probe the fleet for ``seconds`` and read what Triton counted for ``version``."""
    window, _ = measure_windows(replicas, index=index, model=model, version=version,
                                payload=payload, policy=policy, seconds=seconds,
                                timeout_s=timeout_s)
    return window


def measure_windows(replicas: Sequence[TritonServer], *, index: int, model: str,
                    version: int, payload: Mapping[str, np.ndarray], policy: BakePolicy,
                    seconds: float, timeout_s: float, holdback: Holdback | None = None
                    ) -> tuple[Window, Window | None]:
    """Probe the fleet (and the holdback, in the same run of the probe: the same time,
    the same machine) for ``seconds``; the fleet's window for ``version`` and the
    holdback's for its version (None without a holdback)."""
    servers = [*replicas, *([holdback.server] if holdback is not None else [])]
    before, failed, _ = _scrape_all(servers, timeout_s)
    began = time.monotonic()
    spec = LoadSpec(protocol="grpc", rate_rps=policy.probe_rps, duration_s=seconds,
                    warmup_s=0.0, window_s=seconds, timeout_s=timeout_s)
    report = run_load_sync([s.endpoint.grpc for s in servers], model, payload, spec)
    after, failed_after, gpus = _scrape_all(servers, timeout_s)
    failed.update(failed_after)
    taken = time.monotonic() - began
    fleet = _window_of(replicas, range(len(replicas)), report, before, after, failed,
                       gpus, index=index, key=(model, str(version)), seconds=taken,
                       whole=holdback is None)
    if holdback is None:
        return fleet, None
    return fleet, _window_of([holdback.server], [len(replicas)], report, before, after,
                             failed, gpus, index=index, key=(model, str(holdback.version)),
                             seconds=taken, whole=False)


def _probe_of(report: Any, indexes: Sequence[int], *, whole: bool
              ) -> tuple[int, int, dict[str, int], tuple[float, ...]]:
    """The probe's requests sent, failed, error texts and answered latencies (ms) for the
    targets at ``indexes``: the report's own figures when they are every target."""
    mine = set(indexes)
    measured = [r for r in report.measured_records() if r.server in mine]
    latencies = tuple(float(r.latency_ms) for r in measured if r.ok)
    if whole:
        return int(report.requests), int(report.errors), dict(report.error_texts), latencies
    texts: dict[str, int] = {}
    for r in measured:
        if not r.ok:
            texts[r.error or "error"] = texts.get(r.error or "error", 0) + 1
    return len(measured), sum(1 for r in measured if not r.ok), texts, latencies


def _window_of(servers: Sequence[TritonServer], indexes: Sequence[int], report: Any,
               before: Mapping[str, Scrape], after: Mapping[str, Scrape],
               failed_all: Mapping[str, str], gpus_all: Mapping[str, dict[str, Any]], *,
               index: int, key: tuple[str, str], seconds: float, whole: bool) -> Window:
    """One window from the probe's records sent to ``servers`` (their ``indexes`` in the
    probe's target list; ``whole``: every target) and what Triton counted there for
    ``key``."""
    names = {s.name for s in servers}
    failed = {k: v for k, v in failed_all.items() if k in names}
    for server in servers:
        row = report.by_server.get(server.endpoint.grpc) or {}
        sent, errors = int(row.get("requests", 0) or 0), int(row.get("errors", 0) or 0)
        if sent and errors == sent and server.name not in failed:
            failed[server.name] = f"every one of its {sent} probe requests failed"
    per_replica: dict[str, dict[str, Any]] = {}
    server_requests = server_failures = 0.0
    queue_total = compute_total = 0.0
    for name, now in after.items():
        if name not in names:
            continue
        change = delta(before.get(name, {}), now).get(key)
        if change is None:
            continue
        server_requests += change.requests
        server_failures += change.failures
        queue, compute = mean_queue_us(change), mean_compute_us(change)
        if queue is not None and compute is not None:
            queue_total += queue * change.requests
            compute_total += compute * change.requests
        per_replica[name] = {**load_of(change, seconds), "queue_us": queue,
                             "compute_us": compute, "requests": change.requests,
                             "failures": change.failures}
    server_us = (queue_total + compute_total) / server_requests if server_requests else None
    sent, probe_errors, texts, latencies = _probe_of(report, indexes, whole=whole)
    # Triton counts the probe's requests too: the server's count covers them, and failures
    # it did not count (wrong shapes, refused connections) come from the probe.
    probe_only_errors = max(0, probe_errors - int(server_failures))
    load = fleet_load(per_replica)
    return Window(index=index, seconds=seconds,
                  requests=int(max(server_requests, sent - probe_errors)),
                  errors=int(server_failures) + probe_only_errors, server_us=server_us,
                  unreachable=failed, error_texts=texts,
                  gpu={k: v for k, v in gpus_all.items() if k in names},
                  latencies_ms=latencies,
                  queue_us=queue_total / server_requests if server_requests else None,
                  compute_us=compute_total / server_requests if server_requests else None,
                  rate_rps=load["rate_rps"], inflight=load["inflight"],
                  pending=load["pending"], probe_requests=sent, replicas=per_replica)


def fleet_load(per_replica: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """The fleet's load from each replica's (:func:`modelship.triton.metrics.load_of`):
    rates, in-flight and pending add up; None when no replica reported the figure."""
    out: dict[str, float | None] = {}
    for name in ("rate_rps", "inflight", "pending"):
        seen = [float(row[name]) for row in per_replica.values() if row.get(name) is not None]
        out[name] = sum(seen) if seen else None
    return out


def measure_reference(replicas: Sequence[TritonServer], *, model: str, version: int,
                      payload: Mapping[str, np.ndarray], policy: BakePolicy,
                      timeout_s: float, progress: Progress = quiet) -> Reference:
    """The pre-swap reference: ``baseline_s`` of the probe on ``version`` (production),
    cut into windows of ``window_s`` exactly as the bake's (one block each)."""
    count = max(int(math.ceil(policy.baseline_s / policy.window_s)), 1)
    windows = []
    for index in range(count):
        seconds = min(policy.window_s, policy.baseline_s - index * policy.window_s)
        window = measure_window(replicas, index=-(count - index), model=model,
                                version=version, payload=payload, policy=policy,
                                seconds=seconds, timeout_s=timeout_s)
        windows.append(window)
        progress(f"pre-swap window {index + 1}/{count}: {_describe(window)}")
    return Reference(tuple(windows))


def _describe(window: Window) -> str:
    rate = "-" if window.load_rps is None else f"{window.load_rps:.1f} req/s"
    inflight = "" if window.inflight is None else f", {window.inflight:.2f} in flight"
    latency = "-" if window.server_us is None else f"{window.server_us:.0f} µs"
    probe = (f", probe p50 {float(np.median(window.latencies_ms)):.2f} ms"
             if window.latencies_ms else "")
    return (f"{window.requests} ok, {window.errors} failed, {rate}{inflight}, server-side "
            f"{latency}{probe}")


@dataclass
class BakeReport:
    verdict: BakeVerdict
    baseline: Reference | None
    windows: list[Window]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**self.verdict.to_dict(),
                "baseline": self.baseline.to_dict() if self.baseline else None,
                "windows": [w.to_dict() for w in self.windows],
                "seconds": round(self.seconds, 3)}


def watch(replicas: Sequence[TritonServer], *, model: str, version: int,
          payload: Mapping[str, np.ndarray], policy: BakePolicy, baseline: Baseline,
          timeout_s: float, progress: Progress = quiet,
          holdback: Holdback | None = None) -> BakeReport:
    """Watch ``version`` on the fleet for ``bake.duration_s``; stop at the first breach.

    Args:
        baseline: The reference (:func:`measure_reference`), or None for a first release
            (the latency rules are then off; errors are judged).
        holdback: The concurrent control: its windows, probed in the same runs as the
            fleet's, are the reference (kind ``holdback``: no window is held for load) in
            place of ``baseline``.
    """
    started = time.monotonic()
    reference = as_reference(baseline)
    windows: list[Window] = []
    control: list[Window] = []
    count = total_windows(policy)
    for index in range(count):
        seconds = min(policy.window_s, policy.duration_s - index * policy.window_s)
        window, held_back = measure_windows(replicas, index=index, model=model,
                                            version=version, payload=payload, policy=policy,
                                            seconds=seconds, timeout_s=timeout_s,
                                            holdback=holdback)
        windows.append(window)
        if held_back is not None:
            changed = holdback.check(index) if holdback and holdback.check else None
            if changed:
                held_back = replace(held_back, held_for=changed)
                progress(f"holdback: {changed}")
            control.append(held_back)
            reference = Reference(tuple(control), kind="holdback")
            progress(f"holdback window {index + 1}/{count}: {_describe(held_back)}")
        held = load_departure(window, reference, policy) if reference is not None else None
        progress(f"bake window {index + 1}/{count}: {_describe(window)}"
                 + (f"; latency held ({held.split(': ', 1)[1]})" if held else ""))
        verdict = judge_windows(windows, reference, policy)
        if verdict.outcome in ("breach", "infrastructure"):
            return BakeReport(verdict, reference, windows, time.monotonic() - started)
    return BakeReport(judge_windows(windows, reference, policy), reference, windows,
                      time.monotonic() - started)
