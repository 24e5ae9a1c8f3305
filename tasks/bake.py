"""Stage 9, bake: watch the fleet after the swap; a breach rolls back (SageMaker's baking
period).

The bake sends a light probe load of golden rows across every replica (so there is always
evidence, even with no organic traffic) and, window by window, reads Triton's metrics on
every replica. It judges each window against the **pre-swap window**, the same probe load
on the production version measured just before the swap:

- **errors**: failed requests seen by the probe plus failures Triton counted for the new
  version (organic traffic included), against ``bake.max_error_rate``. The watch looks
  after every window, so a per-window threshold would fail a version that is exactly at
  its budget more and more often the longer it is watched. The rule is the always-valid
  e-process of :mod:`tasks.sequential` instead (H0: the version's error rate ≤
  ``max_error_rate``), over all windows so far: it breaches when the evidence reaches
  ``1 / bake.alpha``, so over the whole bake, however many windows, a version within its
  budget is rolled back with probability ≤ ``alpha`` (Ville's inequality). The mixing
  prior is a Beta(1, b) with mean 20 × the budget, so a few errors over a small budget
  are enough (3 of 160 at 0.1%), and a 50% failure rate breaches in the first window;
- **latency**, one rule per quantile ``q`` of ``bake.latency_quantiles`` (p50 for the
  typical request, p90 for the tail by default). The pre-swap window's per-request probe
  latencies are the reference sample: ``τ`` is its ``k``-th order statistic,
  ``k = ⌈q·n⌉``, and ``θ0 = P(latency > τ)`` before the swap is bounded above, exactly and
  for any latency distribution, by the Clopper-Pearson bound at level ``α_q / 2`` on the
  ``n - k`` reference requests above ``τ`` (``1 - F(X_(k))`` is Beta(n-k+1, k): the
  distribution-free tolerance limit of Wilks, 1941; ``scipy.stats.beta``). After the
  swap, each answered probe request is a Bernoulli trial, "slower than
  ``max(τ·r, τ + min_latency_effect_us)``" with ``r = 1 + max_latency_increase_pct/100``,
  and the one-sided Bernoulli mixture e-process :func:`tasks.sequential.log_e_above`
  tests H0 ``P(trial) ≤ θ0`` over all windows so far; it breaches at ``2 / α_q``. By
  Ville's inequality (and Howard, Ramdas, McAuliffe and Sekhon, "Time-uniform,
  nonparametric, nonasymptotic confidence sequences", Ann. Statist. 2021, for the
  time-uniform view) the e-process crosses with probability ≤ ``α_q / 2`` under H0 at any
  window, so a version whose latency, divided by the tolerance, is no worse than before
  the swap is rolled back with probability ≤ ``α_q`` (``α_q / 2`` for the reference bound,
  ``α_q / 2`` for the looks) however many windows are watched, and the latency rules
  together at most ``alpha`` (``α_q = alpha / len(latency_quantiles)``). This is the
  quantile-exceedance form of Lindon, Sanden and Shirikian, "Rapid Regression Detection in
  Software Deployments through Sequential Testing" (KDD 2022, arXiv:2205.14762): a mixture
  likelihood ratio on counts, valid at every look. The old rule (the server-side mean
  over a limit for ``breach_windows`` windows in a row) looked at every window with a
  fixed threshold, so its false rollbacks grew with the bake's length; ``breach_windows``
  is deprecated and ignored.

  The per-request samples are the probe's **client-side** latencies: Triton's metrics
  only give sums per scrape (one mean per window, no quantiles, and too few windows for a
  test), while the probe gives every request's latency. The pre-swap and post-swap
  windows send the same golden rows at the same rate through the same client path to the
  same replicas, so the client overhead is on both sides of the comparison and dilutes a
  relative regression (the tolerance applies to the whole latency) rather than creating
  one; like any before/after comparison, it assumes the machine's load did not change
  across the swap. The server-side mean per window (queue + compute, from the metrics)
  stays in every window's record and in the breach reason as evidence;
- **a replica that stops answering** (its metrics or its requests) is an infrastructure
  outcome, never a pass.

Each window also records, per replica that exports them (a GPU server), the ``nv_gpu_*``
gauges at the window's end (memory used and total, utilization, power: see
:func:`modelship.triton.gpu.summarize`); they are evidence in the record, not a rule.

The verdict is pure (:func:`judge_windows`); the I/O around it is :func:`measure_window`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from modelship.errors import ModelshipError
from modelship.jsonable import jsonable
from modelship.loadgen import LoadSpec, run_load_sync
from modelship.policy import BakePolicy
from modelship.triton.client import TritonServer
from modelship.triton.gpu import parse_gpu_metrics, summarize
from modelship.triton.metrics import (
    Scrape,
    delta,
    mean_compute_us,
    mean_queue_us,
    parse_metrics,
    scrape_text,
)
from tasks.sequential import log_e_above, log_e_over_budget, quantile_bound

Progress = Callable[[str], None]
Outcome = Literal["passed", "breach", "infrastructure"]
Fault = Callable[[int], None]


def _quiet(_: str) -> None:
    """The default progress sink: say nothing."""


@dataclass(frozen=True)
class Window:
    """What one window of the watch saw on the whole fleet.

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

    def to_dict(self) -> dict[str, Any]:
        probe: dict[str, Any] = {}
        if self.latencies_ms:
            values = np.asarray(self.latencies_ms)
            probe = {"probe_ms": {"answered": int(values.size),
                                  **{f"p{q:g}": round(float(np.percentile(values, q)), 3)
                                     for q in (50, 90, 99)}}}
        return jsonable({"index": self.index, "seconds": round(self.seconds, 3),
                         "requests": self.requests, "errors": self.errors,
                         "server_us": None if self.server_us is None
                         else round(self.server_us, 1),
                         "unreachable": self.unreachable, "error_texts": self.error_texts,
                         **probe, **({"gpu": self.gpu} if self.gpu else {})})


@dataclass(frozen=True)
class BakeVerdict:
    outcome: Outcome
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "reason": self.reason}


def judge_window(window: Window) -> str | None:
    """Why this window is no evidence at all (nothing answered or failed), or None. Pure."""
    if window.requests + window.errors == 0:
        return f"window {window.index}: no request was answered or failed (no evidence)"
    return None


def errors_over_budget(windows: Sequence[Window], policy: BakePolicy) -> str | None:
    """Why the failures so far show an error rate above ``max_error_rate``, or None.

    Always valid at every window (see the module docstring); pure.
    """
    failed = sum(w.errors for w in windows)
    total = failed + sum(w.requests for w in windows)
    if failed == 0 or total == 0:
        return None
    budget = policy.max_error_rate
    log_e = log_e_over_budget(failed, total, budget)
    if log_e < math.log(1.0 / policy.alpha):
        return None
    texts: dict[str, int] = {}
    for window in windows:
        for text, count in window.error_texts.items():
            texts[text] = texts.get(text, 0) + count
    top = ", ".join(f"{k} ×{v}" for k, v in list(texts.items())[:3])
    evidence = "certain" if math.isinf(log_e) else f"e-value {math.exp(min(log_e, 700)):.3g}"
    return (f"window {windows[-1].index}: error rate {failed / total:.2%} ({failed} of "
            f"{total} since the swap) is above the bake's {budget:.2%} ({evidence} ≥ "
            f"1/α = {1 / policy.alpha:g})" + (f" ({top})" if top else ""))


@dataclass(frozen=True)
class LatencyReference:
    """One latency rule's reference, fixed from the pre-swap window (pure data).

    Attributes:
        quantile: The rule's quantile ``q`` (0.5 for p50).
        tau_ms: The pre-swap sample's ``⌈q·n⌉``-th order statistic, in ms.
        limit_ms: What a post-swap request must exceed to count:
            ``max(τ·r, τ + min_latency_effect_us)``, in ms.
        theta0: Exact upper bound (level ``α_q / 2``) of P(latency > τ) before the swap.
        samples: Size of the pre-swap sample.
        alpha: The rule's ``α_q`` (half for the bound, half for the e-process).
    """

    quantile: float
    tau_ms: float
    limit_ms: float
    theta0: float
    samples: int
    alpha: float

    @property
    def name(self) -> str:
        return f"latency_p{self.quantile * 100:g}"


def latency_references(baseline: Window | None, policy: BakePolicy
                       ) -> list[LatencyReference]:
    """Each latency rule's reference from the pre-swap window's probe latencies (pure).

    Empty without a pre-swap window or with fewer than two answered probe requests in it
    (nothing to compare with: the latency rules are skipped, the errors rule still runs).
    """
    if baseline is None or len(baseline.latencies_ms) < 2 or not policy.latency_quantiles:
        return []
    reference = np.asarray(baseline.latencies_ms, dtype=float)
    alpha_q = policy.alpha / len(policy.latency_quantiles)
    ratio = 1.0 + policy.max_latency_increase_pct / 100.0
    floor_ms = policy.min_latency_effect_us / 1000.0
    found = []
    for q in policy.latency_quantiles:
        tau, theta0 = quantile_bound(reference, q, alpha_q / 2)
        found.append(LatencyReference(quantile=q, tau_ms=tau,
                                      limit_ms=max(tau * ratio, tau + floor_ms),
                                      theta0=theta0, samples=int(reference.size),
                                      alpha=alpha_q))
    return found


def latency_over(windows: Sequence[Window], baseline: Window | None,
                 policy: BakePolicy) -> str | None:
    """Why the probe latencies since the swap show a regression beyond the tolerance at one
    of the policy's quantiles, or None.

    Always valid at every window (see the module docstring); pure.
    """
    refs = latency_references(baseline, policy)
    if not refs or not windows:
        return None
    after = np.concatenate([np.asarray(w.latencies_ms, dtype=float) for w in windows])
    if after.size == 0:
        return None
    for ref in refs:
        slow = int(np.count_nonzero(after > ref.limit_ms))
        log_e = log_e_above(slow, int(after.size), ref.theta0)
        bound = 2.0 / ref.alpha
        if log_e < math.log(bound):
            continue
        server = ""
        last = windows[-1]
        before_us = baseline.server_us if baseline is not None else None
        if last.server_us is not None and before_us is not None:
            server = (f"; server-side {last.server_us:.0f} µs per request in the last "
                      f"window against {before_us:.0f} µs before the swap")
        evidence = "certain" if math.isinf(log_e) else f"e-value {math.exp(min(log_e, 700)):.3g}"
        return (f"window {last.index}: {ref.name}: {slow} of {after.size} probe requests "
                f"since the swap ({slow / after.size:.0%}) took longer than "
                f"{ref.limit_ms:.3g} ms (the pre-swap p{ref.quantile * 100:g} "
                f"{ref.tau_ms:.3g} ms +{policy.max_latency_increase_pct:g}%, at least "
                f"+{policy.min_latency_effect_us:g} µs), against at most "
                f"{ref.theta0:.0%} before the swap ({evidence} ≥ {bound:g}: α_q = "
                f"{ref.alpha:g} over every window){server}")
    return None


def judge_windows(windows: Sequence[Window], baseline: Window | None,
                  policy: BakePolicy) -> BakeVerdict:
    """The bake's verdict from its windows so far (pure; worst first).

    An unreachable replica is ``infrastructure``; a window with no evidence, errors over
    budget or latency over the tolerance at one of the quantiles (both always-valid, over
    all windows so far) are a ``breach``; otherwise ``passed``.
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
    why = errors_over_budget(windows, policy)
    if why:
        return BakeVerdict("breach", why)
    why = latency_over(windows, baseline, policy)
    if why:
        return BakeVerdict("breach", why)
    if not windows:
        return BakeVerdict("passed", "nothing to watch (bake.duration_s is 0)")
    served = sum(w.requests for w in windows)
    return BakeVerdict("passed", f"{len(windows)} windows, {served} requests, no breach")


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


def measure_window(replicas: Sequence[TritonServer], *, index: int, model: str,
                   version: int, payload: Mapping[str, np.ndarray], policy: BakePolicy,
                   seconds: float, timeout_s: float) -> Window:
    """Probe the fleet for ``seconds`` and read what Triton counted for ``version``."""
    before, failed, _ = _scrape_all(replicas, timeout_s)
    began = time.monotonic()
    spec = LoadSpec(protocol="grpc", rate_rps=policy.probe_rps, duration_s=seconds,
                    warmup_s=0.0, window_s=seconds, timeout_s=timeout_s)
    report = run_load_sync([s.endpoint.grpc for s in replicas], model, payload, spec)
    after, failed_after, gpus = _scrape_all(replicas, timeout_s)
    failed.update(failed_after)
    for server in replicas:
        row = report.by_server.get(server.endpoint.grpc) or {}
        sent, errors = int(row.get("requests", 0) or 0), int(row.get("errors", 0) or 0)
        if sent and errors == sent and server.name not in failed:
            failed[server.name] = f"every one of its {sent} probe requests failed"
    key = (model, str(version))
    server_requests = server_failures = 0.0
    queue_total = compute_total = 0.0
    for name, now in after.items():
        change = delta(before.get(name, {}), now).get(key)
        if change is None:
            continue
        server_requests += change.requests
        server_failures += change.failures
        queue, compute = mean_queue_us(change), mean_compute_us(change)
        if queue is not None and compute is not None:
            queue_total += queue * change.requests
            compute_total += compute * change.requests
    server_us = (queue_total + compute_total) / server_requests if server_requests else None
    # Triton counts the probe's requests too: the server's count covers them, and failures
    # it did not count (wrong shapes, refused connections) come from the probe.
    probe_only_errors = max(0, report.errors - int(server_failures))
    latencies = tuple(float(r.latency_ms) for r in report.measured_records() if r.ok)
    return Window(index=index, seconds=time.monotonic() - began,
                  requests=int(max(server_requests, report.requests - report.errors)),
                  errors=int(server_failures) + probe_only_errors, server_us=server_us,
                  unreachable=failed, error_texts=dict(report.error_texts), gpu=gpus,
                  latencies_ms=latencies)


@dataclass
class BakeReport:
    verdict: BakeVerdict
    baseline: Window | None
    windows: list[Window]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**self.verdict.to_dict(),
                "baseline": self.baseline.to_dict() if self.baseline else None,
                "windows": [w.to_dict() for w in self.windows],
                "seconds": round(self.seconds, 3)}


def watch(replicas: Sequence[TritonServer], *, model: str, version: int,
          payload: Mapping[str, np.ndarray], policy: BakePolicy, baseline: Window | None,
          timeout_s: float, progress: Progress = _quiet, fault: Fault | None = None
          ) -> BakeReport:
    """Watch ``version`` on the fleet for ``bake.duration_s``; stop at the first breach.

    Args:
        fault: Test hook, called with the window index before each window (a test sends
            poisoned traffic or kills a replica there).
    """
    started = time.monotonic()
    windows: list[Window] = []
    count = int(np.ceil(policy.duration_s / policy.window_s)) if policy.duration_s else 0
    for index in range(count):
        if fault is not None:
            fault(index)
        seconds = min(policy.window_s, policy.duration_s - index * policy.window_s)
        window = measure_window(replicas, index=index, model=model, version=version,
                                payload=payload, policy=policy, seconds=seconds,
                                timeout_s=timeout_s)
        windows.append(window)
        latency = "-" if window.server_us is None else f"{window.server_us:.0f} µs"
        probe = (f", probe p50 {float(np.median(window.latencies_ms)):.2f} ms"
                 if window.latencies_ms else "")
        progress(f"bake window {index + 1}/{count}: {window.requests} ok, {window.errors} "
                 f"failed, server-side {latency}{probe}")
        verdict = judge_windows(windows, baseline, policy)
        if verdict.outcome != "passed":
            return BakeReport(verdict, baseline, windows, time.monotonic() - started)
    return BakeReport(judge_windows(windows, baseline, policy), baseline, windows,
                      time.monotonic() - started)
