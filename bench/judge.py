"""Canary judges compared by simulation: power and false rollbacks against sample size.

Run: ``.venv/bin/python -m bench.judge [--reps N] [--sizes 250 500 ...] [--workers 2]``.

Every canary is simulated (no servers), with deterministic seeds: ``SeedSequence([case,
n, rep])``, so each judge sees exactly the same canaries. Latencies in ms are a lognormal
body (median 2 ms, log-sd 0.3) plus, on 5% of requests, an exponential tail of mean 4 ms
(queueing, GC): p50 ≈ 2.0 ms, p95 ≈ 3.8 ms, p99 ≈ 8.6 ms. Three cases, per version
``n`` requests each:

- ``latency``: the candidate's latencies are the baseline's distribution × 1.15 (every
  percentile, p95 included, +15%); no errors on either side. Power = P(failed).
- ``errors``: the candidate fails 0.5% of its requests, the baseline none (kayenta#377).
  Power = P(failed).
- ``aa``: the same distribution on both sides, both failing 0.05% of requests (half the
  default budget of 0.1%), agreement 100%. False rollback = P(failed).

Three judges:

- ``ours``: :func:`tasks.gates.judge` + :func:`~tasks.gates.combine` (what ``evaluate``
  does) with ``default_gates()`` and ``min_samples=1``, so
  the statistics decide at every n (in a release the canary runs to ``plan_samples``
  first). ``ours@α=0.01`` is the same tests with α = 0.01, derived from the recorded
  p-values (each rule's decision is ``p < α``).
- ``mann_whitney``: Kayenta-like, no tolerance and no floor: one-sided Mann-Whitney at α =
  0.05 on the latencies and on the 0/1 error indicators; a metric fails when ``p < α``
  and the lower end of the Hodges-Lehmann interval is above 0 (Kayenta's ``High``).
- ``fixed``: Flagger-like, the candidate alone: p99 ≤ 1.10 × the baseline's true p99 (the
  SLO a user would read off today's dashboard) and error rate ≤ 1%.

Goal: ≥ 95% power on both regressions and ≤ 1% false rollbacks on A/A, with the fewest
samples. Figures go to ``bench/results/judge.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

from bench.results import print_table, write_results
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import default_gates
from tasks.gates import (
    Verdict,
    combine,
    hodges_lehmann,
    judge,
    plan_samples,
    required_samples,
)

CASES = ("latency", "errors", "aa")
SIZES = (250, 500, 1000, 1500, 2000, 4000)
JUDGES = ("ours", "ours@α=0.01", "mann_whitney", "fixed")
LATENCY_SHIFT = 1.15
CANDIDATE_ERROR_RATE = 0.005
AA_ERROR_RATE = 0.0005
FIXED_P99_FACTOR = 1.10
FIXED_MAX_ERROR_RATE = 0.01
GOAL_POWER = 0.95
GOAL_FALSE = 0.01
GATES = default_gates()


def latencies(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    """Per-request latency in ms: lognormal body plus a 5% exponential tail."""
    body = 2.0 * np.exp(0.3 * rng.standard_normal(n))
    tail = (rng.random(n) < 0.05) * rng.exponential(4.0, n)
    return scale * (body + tail)


def true_p99() -> float:
    """The baseline distribution's p99, from one large fixed-seed sample."""
    return float(np.percentile(latencies(np.random.default_rng(12345), 2_000_000), 99))


@dataclass(frozen=True)
class Canary:
    """One simulated canary: the snapshot plus the raw arrays the other judges need."""

    snapshot: CanarySnapshot
    cand_errors: np.ndarray
    base_errors: np.ndarray


def simulate(case: str, n: int, rep: int) -> Canary:
    """One canary of ``case`` with ``n`` requests per version, seeded by (case, n, rep)."""
    rng = np.random.default_rng(np.random.SeedSequence([CASES.index(case), n, rep]))
    scale = LATENCY_SHIFT if case == "latency" else 1.0
    cand_rate = {"latency": 0.0, "errors": CANDIDATE_ERROR_RATE, "aa": AA_ERROR_RATE}[case]
    base_rate = AA_ERROR_RATE if case == "aa" else 0.0
    cand_err = rng.random(n) < cand_rate
    base_err = rng.random(n) < base_rate
    cand_lat = latencies(rng, int(n - cand_err.sum()), scale)
    base_lat = latencies(rng, int(n - base_err.sum()))
    agree = 1.0 if case == "aa" else float(rng.binomial(n, 0.995)) / n
    window = 30.0
    cand = ArmMeasurements(7, cand_lat, n, int(cand_err.sum()), cand_lat.size / window)
    base = ArmMeasurements(6, base_lat, n, int(base_err.sum()), base_lat.size / window)
    snap = CanarySnapshot("fraud", cand, base, agreement=agree, agreement_samples=n,
                          window_s=window)
    return Canary(snap, cand_err.astype(float), base_err.astype(float))


def judge_ours(canary: Canary) -> dict[str, bool]:
    """Our default gates, and the same tests at α = 0.01 from the recorded p-values."""
    # evaluate() minus its plan_samples(), which does not change the verdict.
    results = [judge(canary.snapshot, rule, min_samples=1) for rule in GATES]
    failed_strict = False
    for r in results:
        if r.dry_run:
            continue
        if r.test == "mann_whitney":
            failed_strict |= r.p_value is not None and r.p_value < 0.01
        elif r.test == "exact_rate":
            p_abs = r.details.get("p_absolute")
            p_cmp = r.details.get("p_vs_baseline")
            over = r.value is not None and r.threshold_value is not None \
                and r.value > r.threshold_value
            failed_strict |= (p_abs is not None and p_abs < 0.01) or \
                (p_cmp is not None and p_cmp < 0.01 and over)
        else:
            failed_strict |= r.verdict is Verdict.FAILED
    return {"ours": combine(results) is Verdict.FAILED, "ours@α=0.01": failed_strict}


def _kayenta_high(cand: np.ndarray, base: np.ndarray, alpha: float = 0.05) -> bool:
    """Kayenta's Mann-Whitney classifier without tolerance: significant and CI above 0."""
    p = float(stats.mannwhitneyu(cand, base, alternative="greater").pvalue)
    if math.isnan(p) or p >= alpha:
        return False
    _, low, _ = hodges_lehmann(cand, base, alpha=alpha)
    return low > 0


def judge_mann_whitney(canary: Canary) -> bool:
    snap = canary.snapshot
    assert snap.baseline is not None
    return _kayenta_high(snap.candidate.latency_ms, snap.baseline.latency_ms) or \
        _kayenta_high(canary.cand_errors, canary.base_errors)


def judge_fixed(canary: Canary, p99_limit_ms: float) -> bool:
    cand = canary.snapshot.candidate
    p99 = float(np.percentile(cand.latency_ms, 99))
    return p99 > p99_limit_ms or cand.errors / cand.requests > FIXED_MAX_ERROR_RATE


def run_cell(args: tuple[str, int, int, float]) -> dict[str, Any]:
    """All judges on ``reps`` canaries of one (case, n): failure counts per judge."""
    case, n, reps, p99_limit = args
    failed = dict.fromkeys(JUDGES, 0)
    for rep in range(reps):
        canary = simulate(case, n, rep)
        for name, verdict in judge_ours(canary).items():
            failed[name] += verdict
        failed["mann_whitney"] += judge_mann_whitney(canary)
        failed["fixed"] += judge_fixed(canary, p99_limit)
    return {"case": case, "n": n, "reps": reps, "failed": failed}


def summarise(cells: list[dict[str, Any]], sizes: tuple[int, ...]) -> dict[str, Any]:
    """Per judge and n: power on each regression, A/A false rollbacks, and the smallest n."""
    rate = {(c["case"], c["n"], j): c["failed"][j] / c["reps"] for c in cells for j in JUDGES}
    judges: dict[str, Any] = {}
    for j in JUDGES:
        rows = []
        for n in sizes:
            rows.append({"n": n, "power_latency": rate["latency", n, j],
                         "power_errors": rate["errors", n, j],
                         "false_rollback_aa": rate["aa", n, j]})
        meets = [r["n"] for r in rows if r["power_latency"] >= GOAL_POWER
                 and r["power_errors"] >= GOAL_POWER and r["false_rollback_aa"] <= GOAL_FALSE]
        judges[j] = {"by_n": rows, "smallest_n_meeting_goal": min(meets) if meets else None}
    return judges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    sizes = tuple(args.sizes)
    started = time.perf_counter()
    p99 = true_p99()
    limit = FIXED_P99_FACTOR * p99
    # Largest cells first so the two workers finish together.
    jobs = sorted(((case, n, args.reps, limit) for case in CASES for n in sizes),
                  key=lambda job: -job[1])
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        cells = list(pool.map(run_cell, jobs))
    judges = summarise(cells, sizes)

    # What the canary would plan for the default gates, sized from a baseline sample, and
    # for the goal of this benchmark (+15% against a 10% tolerance = effect 5, power 0.95).
    sample = latencies(np.random.default_rng(7), 4000)
    gates = default_gates()
    plan_default = plan_samples(gates, baseline_latency_ms=sample, min_samples=1)
    lat_rule = gates[0].model_copy(update={"effect": 5.0, "power": GOAL_POWER})
    err_rule = gates[1].model_copy(update={"effect": CANDIDATE_ERROR_RATE - 0.001,
                                           "power": GOAL_POWER})
    plan_goal = {"latency_p99": required_samples(lat_rule, baseline_latency_ms=sample),
                 "error_rate": required_samples(err_rule)}
    elapsed = time.perf_counter() - started

    figures = {
        "setup": {"reps": args.reps, "sizes": list(sizes), "latency_shift": LATENCY_SHIFT,
                  "candidate_error_rate": CANDIDATE_ERROR_RATE,
                  "aa_error_rate": AA_ERROR_RATE, "baseline_true_p99_ms": p99,
                  "fixed_p99_limit_ms": limit, "fixed_max_error_rate": FIXED_MAX_ERROR_RATE,
                  "goal": {"power": GOAL_POWER, "false_rollback": GOAL_FALSE},
                  "seconds": round(elapsed, 1)},
        "plan": {"default_gates": plan_default, "goal_effects_power_0.95": plan_goal},
        "judges": judges,
    }
    path = write_results("judge", figures)
    rows = []
    for j in JUDGES:
        for r in judges[j]["by_n"]:
            rows.append([j, r["n"], f"{r['power_latency']:.0%}", f"{r['power_errors']:.0%}",
                         f"{r['false_rollback_aa']:.1%}"])
    print_table(f"Judges, {args.reps} canaries per cell ({elapsed:.0f} s)",
                ["judge", "n/version", "power +15% latency", "power 0.5% errors",
                 "A/A false rollback"], rows)
    print_table("Smallest n with ≥95% power on both and ≤1% A/A false rollbacks",
                ["judge", "n/version"],
                [[j, judges[j]["smallest_n_meeting_goal"] or "not reached"] for j in JUDGES])
    print(f"\nplan_samples(default gates) = {plan_default}; for this goal: {plan_goal}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
