"""The sequential judge on live traffic (issue 20 item 3): per-version server-side metrics
of the requests each version actually served through the router.

Under ``canary.traffic: progressive`` the candidate C answers a share of live requests on
the canary Triton and production P answers the rest on the replicas. There are no paired
rows and no client-side latencies of C's requests: the evidence is what Triton counted
per version (``nv_inference_request_success`` / ``_failure`` and the queue and compute
µs counters), read from the canary Triton for C and summed over the replicas for P at
each look (:func:`arm_look`, pure, on two scrapes).

**Each look is one block** (as in :mod:`tasks.sequential` and the bake): within it,
requests share a queue and a batcher, so the unit of evidence is the look's mean
server-side µs per request of each arm, never the single request. The rules (pure:
:class:`LiveJudge`), with the tolerances, α and power of the policy's watched gates
(:func:`tasks.canary_sizing.sequential_config`, all of each rule's α: in this mode the
live judge is the canary's only test):

- **latency** (the p50 rule's tolerance, or the tightest latency rule's): a look where
  both arms answered gives ``x = 1`` when C's mean µs per request exceeds ``r ×`` P's
  (``r = 1 + tolerance``), else 0. H0: ``P(x = 1) ≤ ½`` (C within the tolerance is not
  above it more often than not). The regression e-process is the Bernoulli mixture
  :func:`tasks.sequential.log_e_above` at ``θ0 = ½``: always valid, so the executor may
  look after every look and step back at the first ``1/α``. The early pass is its mirror
  (:func:`tasks.sequential.log_e_below` at ``1/(1 - power)``).
- **errors** (the ``exact_rate`` rule's budget): C's failures over its requests,
  :func:`tasks.sequential.log_e_over_budget`; when P is certainly above the budget too,
  the verdict is ``inconclusive`` (a shared cause, not the candidate's doing). The pass
  needs C shown within the budget (``log_e_below``), so a candidate with too few live
  requests is never passed on errors alone: the step's ceiling then decides
  (:mod:`tasks.traffic_plan`).

One e-process runs over the whole canary (every step's looks): Ville's inequality holds
over all looks, so evidence from an early step is not thrown away at the next one.

**Per-server load** (:func:`tasks.traffic_plan.latency_judged`). A look taken at a step
where the canary server carries more than a replica's load is not a latency look
(``update(..., latency=False)``): its µs are kept (``last``) but neither counted above nor
below, nor in the dependence; its requests and failures count for the error rule as at
every step. So the latency e-process only moves at steps of fair load: a slow candidate
breaches there, and a good one is never failed on latency because its server was busier.
Leaving looks out at steps the executor fixes in advance (not on what they showed) keeps
the e-process valid: it is the same test on a subsequence chosen before each look.

**Dependence between looks** (:func:`look_inflation`). The Bernoulli mixture is valid when
the looks' indicators are independent given the past. Live traffic is not: a server that
is slow for a few seconds (a noisy neighbour, CPU contention, a burst queued on one side)
gives runs of looks above or below, and a run is not that many independent pieces of
evidence. So the counts are divided by a measured variance inflation, the route
:mod:`tasks.sequential` takes for requests: an upper 80 % bound ``ρ`` of the lag-1
autocorrelation of the looks' log ratios, mapped to the indicators' by Sheppard's
``(2/π) asin ρ``, gives ``(1 + ρ')/(1 - ρ')``; nothing is decided before
:data:`MIN_JUDGED_LOOKS` judged looks. What a shared load does (a burst or the morning ramp
reaching both versions at once) cancels in the ratio and needs no correction; what differs
between the two servers does not. Seeded table tests (``tests/unit/
test_live_judge_traffic.py``: 30 canaries of steps 5 → 25 → 50 % of 5-30 s each, per
load: flat, bursty on/off, diurnal ramp ×5), undeflated → deflated:

- with the dependence measured on this machine (request-level AR(1) φ = 0.6 per server, a
  per-server drift of log-spread 0.15 and look-level φ = 0.6): an identical candidate was
  failed 0-1 → 0 times in 30; ×1.25 stepped back 18-23 → 9-16 times, never passed; ×2
  always stepped back (both);
- with a drift that outlasts ten looks (log-spread 0.3, φ = 0.9): identical failed
  7-8 → 0-2 of 30; ×1.25 passed to the swap 1-3 → 0-1 of 30.

The price is evidence: a deflated count needs more looks, so within short steps more
canaries end inconclusive (exit 6, no swap): identical 2-4 → 5-13 of 30 with the measured
dependence; the policy's default steps (up to 60 s each) leave more room.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import special

from modelship.policy import Policy
from modelship.triton.metrics import Scrape, delta, mean_compute_us, mean_queue_us
from tasks.blocks import lag1
from tasks.canary_sizing import sequential_config
from tasks.sequential import (
    INFLATION_CONFIDENCE,
    SequentialConfig,
    WatchRule,
    log_e_above,
    log_e_below,
    log_e_over_budget,
)
from tasks.traffic_plan import Status

__all__ = ["MIN_JUDGED_LOOKS", "ArmLook", "LiveDecision", "LiveJudge", "LiveRules", "arm_look",
           "look_inflation"]

#: Judged looks before the latency rule decides anything: the inflation of fewer is unknown.
MIN_JUDGED_LOOKS = 4


@dataclass(frozen=True)
class ArmLook:
    """What one version served between two looks, as Triton counted it.

    Attributes:
        requests: Successful requests.
        failures: Failed requests.
        server_us: Mean queue + compute µs per successful request (compute alone where
            the server exports no queue counter); None without one.
    """

    requests: int = 0
    failures: int = 0
    server_us: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "failures": self.failures,
                "server_us": None if self.server_us is None else round(self.server_us, 1)}


def arm_look(before: Mapping[str, Scrape], after: Mapping[str, Scrape], *, model: str,
             version: int) -> ArmLook:
    """``version``'s look from per-server scrapes before and after (pure): requests and
    failures add up over the servers, the µs per request is their request-weighted mean.
    A server missing from either scrape contributes nothing."""
    key = (model, str(version))
    requests = failures = 0.0
    weighted = 0.0
    timed = 0.0
    for name, now in after.items():
        then = before.get(name)
        if then is None:
            continue
        change = delta(then, now).get(key)
        if change is None:
            continue
        requests += change.requests
        failures += change.failures
        queue, compute = mean_queue_us(change), mean_compute_us(change)
        if compute is not None and change.requests > 0:
            weighted += (compute + (queue or 0.0)) * change.requests
            timed += change.requests
    return ArmLook(int(requests), int(failures), weighted / timed if timed else None)


@dataclass(frozen=True)
class LiveRules:
    """The live judge's two rules (see the module docstring)."""

    latency: WatchRule
    errors: WatchRule

    @classmethod
    def from_policy(cls, policy: Policy) -> LiveRules:
        """From the policy's watched gates (all of each rule's α); the defaults of
        :class:`tasks.sequential.SequentialConfig` for a kind the gates do not watch."""
        rules = sequential_config(policy.gates, share=1.0).watch_rules()
        defaults = SequentialConfig().watch_rules()
        latency = sorted((r for r in rules if r.kind == "latency"),
                         key=lambda r: (r.quantile != 0.5, r.tolerance))
        errors = [r for r in rules if r.kind == "errors"]
        return cls(latency[0] if latency else next(r for r in defaults if r.kind == "latency"),
                   errors[0] if errors else next(r for r in defaults if r.kind == "errors"))


@dataclass(frozen=True)
class LiveDecision:
    """The judge's verdict after one look (``to_dict`` is JSON as it is)."""

    status: Status
    reason: str
    looks: int
    judged: int
    candidate_requests: int
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "looks": self.looks,
                "judged": self.judged, "candidate_requests": self.candidate_requests,
                **self.evidence}


def look_inflation(log_ratios: Sequence[float],
                   confidence: float = INFLATION_CONFIDENCE) -> float:
    """The variance inflation of the count of looks above, from the judged looks' log
    ratios ``log(C µs / P µs)`` (pure): ``inf`` before :data:`MIN_JUDGED_LOOKS`; else
    ``(1 + ρ')/(1 - ρ')`` (at least 1), where ``ρ`` is an upper ``confidence`` bound of the
    ratios' lag-1 autocorrelation (the estimate ρ̂, 0 for a series that has not varied,
    plus Kendall's bias ``(1 + 3ρ̂)/n`` and ``z·√((1 - ρ̂²)/n)``, capped at 0.95) and
    ``ρ' = (2/π) asin ρ`` the lag-1 of the looks' indicators it implies.

    Measured on the ratios, not on the 0/1 looks: the ratios still vary when every look is
    above (a far slower candidate), where the indicators carry nothing. Sheppard's formula
    is the correlation of two Gaussian variables' signs at their median, the largest a
    threshold gives, so ``ρ'`` does not understate the indicators' dependence.
    An upper bound, not the estimate, for the reason :data:`tasks.sequential.
    INFLATION_CONFIDENCE` gives: early, a run of looks looks independent."""
    d = np.asarray(log_ratios, dtype=float)
    n = int(d.size)
    if n < MIN_JUDGED_LOOKS:
        return math.inf
    rho = lag1(d)
    rho = 0.0 if not math.isfinite(rho) else rho
    z = float(special.ndtri(confidence))
    upper = min(rho + (1.0 + 3.0 * rho) / n + z * math.sqrt(max(1.0 - rho * rho, 0.0) / n),
                0.95)
    looks = 2.0 / math.pi * math.asin(max(upper, 0.0))  # Sheppard: the indicators' lag-1
    return max((1.0 + looks) / (1.0 - looks), 1.0)


def _e(log_e: float) -> float:
    return math.exp(min(log_e, 700.0))


class LiveJudge:
    """Ingests one look of each arm at a time and decides (pure, stateful)."""

    def __init__(self, rules: LiveRules) -> None:
        self.rules = rules
        self.looks = 0
        self.judged = 0       # looks where both arms answered
        self.load_skipped = 0  # ... at a step above equal per-server load (not judged)
        self.above = 0        # ... with C above r × P
        self.log_ratios: list[float] = []   # each judged look: log(C µs / P µs)
        self.c_requests = self.c_failures = 0
        self.p_requests = self.p_failures = 0
        self.last: tuple[ArmLook, ArmLook] | None = None
        self.decision = LiveDecision("continue", "no look yet", 0, 0, 0)

    @property
    def ratio(self) -> float:
        return 1.0 + self.rules.latency.tolerance / 100.0

    def update(self, candidate: ArmLook, production: ArmLook, *,
               latency: bool = True) -> LiveDecision:
        """Ingest one look of each arm; ``latency=False`` at a step where the canary server
        carries more than a replica's load: the look counts for errors only."""
        self.looks += 1
        self.last = (candidate, production)
        self.c_requests += candidate.requests + candidate.failures
        self.c_failures += candidate.failures
        self.p_requests += production.requests + production.failures
        self.p_failures += production.failures
        if candidate.server_us is not None and production.server_us is not None \
                and production.server_us > 0:
            if not latency:
                self.load_skipped += 1
            else:
                self.judged += 1
                above = candidate.server_us > self.ratio * production.server_us
                self.above += int(above)
                self.log_ratios.append(math.log(max(candidate.server_us, 1e-9)
                                                / production.server_us))
        self.decision = self._decide()
        return self.decision

    def _decide(self) -> LiveDecision:
        lat, err = self.rules.latency, self.rules.errors
        inflation = look_inflation(self.log_ratios)
        k, n = self.above / inflation, self.judged / inflation
        lat_reg = log_e_above(k, n, 0.5) if n else 0.0
        lat_fine = log_e_below(k, n, 0.5) if n else 0.0
        budget = err.tolerance
        err_reg = log_e_over_budget(self.c_failures, self.c_requests, budget)
        base_reg = log_e_over_budget(self.p_failures, self.p_requests, budget)
        err_fine = log_e_below(self.c_failures, self.c_requests, budget) \
            if budget > 0 and self.c_requests else 0.0
        evidence = {
            "latency": {"rule": lat.name, "tolerance_pct": lat.tolerance,
                        "looks_above": self.above, "looks_judged": self.judged,
                        "looks_not_judged_for_load": self.load_skipped,
                        "inflation": None if math.isinf(inflation) else round(inflation, 3),
                        "e_regression": _e(lat_reg), "e_fine": _e(lat_fine)},
            "errors": {"rule": err.name, "budget": budget, "candidate": [self.c_failures,
                                                                         self.c_requests],
                       "production": [self.p_failures, self.p_requests],
                       "e_regression": _e(err_reg)},
            "last": None if self.last is None else {"candidate": self.last[0].to_dict(),
                                                    "production": self.last[1].to_dict()}}
        shown = (f"{self.above} of {self.judged} looks with the candidate's server-side µs "
                 f"per request above ×{self.ratio:.2f} production's"
                 + (f" ({self.load_skipped} more not judged: the canary server above a "
                    "replica's load)" if self.load_skipped else ""))
        errors = (f"candidate {self.c_failures}/{self.c_requests} failed, production "
                  f"{self.p_failures}/{self.p_requests}, budget {budget:.3%}")

        def say(status: Status, reason: str) -> LiveDecision:
            return LiveDecision(status, reason, self.looks, self.judged, self.c_requests,
                                evidence)

        if err_reg >= math.log(1.0 / err.alpha):
            if base_reg >= math.log(1.0 / err.alpha):
                return say("inconclusive", f"{err.name}: both versions fail alike on live "
                           f"traffic ({errors}): a shared cause, not the candidate")
            return say("failed", f"{err.name}: the candidate's errors on live traffic are "
                       f"certainly over budget ({errors}; e-value {_e(err_reg):.3g} ≥ "
                       f"1/α = {1 / err.alpha:g})")
        if lat_reg >= math.log(1.0 / lat.alpha):
            return say("failed", f"{lat.name}: slower on live traffic: {shown}; e-value "
                       f"{_e(lat_reg):.3g} ≥ 1/α = {1 / lat.alpha:g}")
        level = math.log(1.0 / (1.0 - lat.power))
        if lat_fine >= level and (budget <= 0 and self.c_failures == 0 and self.c_requests
                                  or err_fine >= math.log(1.0 / (1.0 - err.power))):
            return say("passed", f"shown within tolerance on live traffic: {shown}; "
                       f"{errors}")
        return say("continue", f"no decision after {self.looks} looks: {shown}; {errors}")
