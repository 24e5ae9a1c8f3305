"""The canary judge by simulation: false rollbacks, power and early stopping, with intervals.

Run: ``.venv/bin/python -m bench.judge [--reps N] [--workers 2] [--seq-reps N]``.

Every canary is simulated (no servers) with deterministic seeds ``SeedSequence([case,
rep])``, and judged by :func:`tasks.gates.judge` with ``default_gates()`` (plus a dry-run
p95 quantile rule, reported per rule only) at the sample size the canary would plan for
that baseline (:func:`tasks.gates.plan_samples` on a baseline sample of the same family,
capped at 12,000). Every rate comes with its 95% Wilson interval.

Latency families, per request in ms:

- ``standard``: lognormal body (median 2 ms, log-sd 0.3) plus, on 5% of requests, an
  exponential tail of mean 4 ms: p50 ≈ 2.0, p95 ≈ 3.8, p99 ≈ 8.6 ms.
- ``heavy``: the same body, the 5% tail Pareto (shape 2.5, scale 2 ms): p99 ≈ 7 ms and a
  fat tail beyond.
- ``bimodal``: 85% fast mode (median 2 ms) and 15% slow mode (median 8 ms, log-sd 0.2),
  as a cache miss or a second code path gives.

Cases (what the candidate does; the baseline is the family as is):

- ``aa_*``: the same distribution, both failing 0.05% of requests. False rollback =
  P(combined verdict failed). Goal ≤ 1%.
- ``all_x1.15``: every request ×1.15 (p50 and p99 +15% against a 10% tolerance).
- ``tail_p99``: only the tail longer (standard: tail mean ×2.2, p99 ≈ +55%), p50 the same.
- ``tail_p95``: a tail-only regression that moves the p95 ≈ +30% (tail share 5% → 10%).
- ``body_slower_tail_better``: body ×1.12, tail mean 4 → 2.5 ms: the p99 is better. The
  p99 rule must not fail it (the old judge did 41% of the time); the p50 rule may (12% is
  beyond its 10% tolerance).
- ``errors_80pct_budget`` / ``errors_100pct_budget``: the candidate at 0.08% / 0.1% errors
  against a perfect baseline, budget 0.1%. Goal: fails ≤ 5% (≤ α).
- ``errors_0.5pct``: 0.5% errors against a perfect baseline (kayenta#377). Goal ≥ 95%.
- ``heavy_tail_x1.5`` and ``bimodal_slow_x1.5``: the heavy tail ×1.5, the slow mode ×1.5.

Triton's server-side figures are simulated as the client mean minus 0.3 ms of client
overhead, seen through 30 one-second metrics intervals with 5% log-normal noise per arm
(the ``server_latency`` rule's t-test works on those intervals).

Sequential (``tasks.sequential``, looks every 100 requests per arm, capped at the fixed
horizon): A/A false detections over all looks, the median requests to a decision, and the
median time to detect ×1.5 latency and 2% errors as a share of the fixed horizon (goal ≤
25%). Figures go to ``bench/results/judge.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from bench.results import print_table, write_results
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import GateRule, default_gates
from tasks.gates import Verdict, combine, judge, plan_samples
from tasks.sequential import SequentialCanary

AA_ERROR_RATE = 0.0005
MAX_N = 12_000
GOAL_POWER = 0.95
GOAL_FALSE = 0.01
GOAL_BUDGET = 0.05
GOAL_SEQ_SHARE = 0.25
SERVER_NOISE = 0.05
GATES = [*default_gates(),
         GateRule(name="latency_p95", metric="latency_p95_ms", test="quantile",
                  max_increase_pct=10.0, alpha=0.01, dry_run=True)]

Draw = Callable[[np.random.Generator, int], np.ndarray]


def family(name: str, *, scale: float = 1.0, body: float = 1.0, tail: float = 1.0,
           tail_share: float = 0.05) -> Draw:
    """A latency sampler (ms) of one family, with the candidate's changes applied."""
    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        if name == "bimodal":
            fast = 2.0 * np.exp(0.3 * rng.standard_normal(n))
            slow = tail * 8.0 * np.exp(0.2 * rng.standard_normal(n))
            return scale * np.where(rng.random(n) < 0.15, slow, body * fast)
        lat = body * 2.0 * np.exp(0.3 * rng.standard_normal(n))
        hit = rng.random(n) < tail_share
        if name == "heavy":
            extra = tail * 2.0 * (rng.pareto(2.5, n) + 1.0)
        else:
            extra = rng.exponential(4.0 * tail, n)
        return scale * (lat + hit * extra)
    return draw


CASES: dict[str, dict[str, Any]] = {
    "aa_standard": {"fam": "standard", "cand": {}, "err": (AA_ERROR_RATE, AA_ERROR_RATE)},
    "aa_heavy": {"fam": "heavy", "cand": {}, "err": (AA_ERROR_RATE, AA_ERROR_RATE)},
    "aa_bimodal": {"fam": "bimodal", "cand": {}, "err": (AA_ERROR_RATE, AA_ERROR_RATE)},
    "all_x1.15": {"fam": "standard", "cand": {"scale": 1.15}, "err": (0.0, 0.0)},
    "tail_p99": {"fam": "standard", "cand": {"tail": 1.7}, "err": (0.0, 0.0)},
    "tail_p95": {"fam": "standard", "cand": {"tail_share": 0.10}, "err": (0.0, 0.0)},
    "body_slower_tail_better": {"fam": "standard", "cand": {"body": 1.12, "tail": 0.625},
                                "err": (0.0, 0.0)},
    "errors_80pct_budget": {"fam": "standard", "cand": {}, "err": (0.0008, 0.0)},
    "errors_100pct_budget": {"fam": "standard", "cand": {}, "err": (0.001, 0.0)},
    "errors_0.5pct": {"fam": "standard", "cand": {}, "err": (0.005, 0.0)},
    "heavy_tail_x1.5": {"fam": "heavy", "cand": {"tail": 1.5}, "err": (0.0, 0.0)},
    "bimodal_slow_x1.5": {"fam": "bimodal", "cand": {"tail": 1.5}, "err": (0.0, 0.0)},
}
GOALS = {"aa": ("false rollback", GOAL_FALSE, "≤"), "errors_80": ("fails", GOAL_BUDGET, "≤"),
         "errors_100": ("fails", GOAL_BUDGET, "≤"), "body": ("p99 rule fails", GOAL_BUDGET, "≤")}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a rate k/n."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def planned_n(fam: str) -> int:
    sample = family(fam)(np.random.default_rng(7), 20_000)
    return min(plan_samples([g for g in GATES if not g.dry_run], baseline_latency_ms=sample,
                            baseline_error_rate=0.0, min_samples=2000), MAX_N)


def simulate(case: str, rep: int, n: int) -> CanarySnapshot:
    spec = CASES[case]
    rng = np.random.default_rng(np.random.SeedSequence([list(CASES).index(case), rep]))
    c_rate, b_rate = spec["err"]
    c_err, b_err = int(rng.binomial(n, c_rate)), int(rng.binomial(n, b_rate))
    cand = family(spec["fam"], **spec["cand"])(rng, n - c_err)
    base = family(spec["fam"])(rng, n - b_err)
    # Server-side time: the client latency minus ~0.3 ms of client overhead, per arm, seen
    # by 30 one-second metrics intervals with 5% noise each (per arm, log scale).
    c_us = max(float(cand.mean()) - 0.3, 0.05) * 1000
    b_us = max(float(base.mean()) - 0.3, 0.05) * 1000
    intervals = [{"candidate": {"us": n / 30 * c_us * float(np.exp(e_c)), "n": n / 30},
                  "baseline": {"us": n / 30 * b_us * float(np.exp(e_b)), "n": n / 30}}
                 for e_c, e_b in rng.normal(0.0, SERVER_NOISE, (30, 2))]
    return CanarySnapshot(
        "fraud", ArmMeasurements(7, cand, n, c_err, n / 30.0, 20.0, c_us - 20.0),
        ArmMeasurements(6, base, n, b_err, n / 30.0, 20.0, b_us - 20.0),
        agreement=1.0, agreement_samples=n, window_s=30.0,
        extra={"server_intervals": intervals})


def run_case(args: tuple[str, int, int]) -> dict[str, Any]:
    """``reps`` canaries of one case: failures of the combined verdict and of each rule."""
    case, reps, n = args
    failed = 0
    by_rule = {g.name: 0 for g in GATES}
    for rep in range(reps):
        snapshot = simulate(case, rep, n)
        results = [judge(snapshot, rule, min_samples=1) for rule in GATES]
        failed += combine(results) is Verdict.FAILED
        for r in results:
            by_rule[r.rule] += r.verdict is Verdict.FAILED
    return {"case": case, "n": n, "reps": reps, "failed": failed, "by_rule": by_rule}


SEQ_CASES = {"aa": ("standard", {}, AA_ERROR_RATE), "latency_x1.5": ("standard",
                                                                      {"scale": 1.5}, 0.0),
             "errors_2pct": ("standard", {}, 0.02)}


def run_sequential(args: tuple[str, int, int, int]) -> dict[str, Any]:
    """``reps`` sequential canaries: status and requests per arm at the decision."""
    case, reps, horizon, batch = args
    fam, cand_kw, c_rate = SEQ_CASES[case]
    b_rate = AA_ERROR_RATE if case == "aa" else 0.0
    statuses: list[str] = []
    stops: list[int] = []
    for rep in range(reps):
        rng = np.random.default_rng(np.random.SeedSequence([100 + list(SEQ_CASES).index(case),
                                                            rep]))
        watch = SequentialCanary(reference_ms=family(fam)(rng, 400))
        n, status = 0, "continue"
        while n < horizon and status == "continue":
            ce, be = int(rng.binomial(batch, c_rate)), int(rng.binomial(batch, b_rate))
            status = watch.update(family(fam)(rng, batch - be),
                                  family(fam, **cand_kw)(rng, batch - ce),
                                  candidate_errors=ce, baseline_errors=be).status
            n += batch
        statuses.append(status)
        stops.append(n)
    return {"case": case, "reps": reps, "horizon": horizon, "statuses": statuses,
            "stops": stops}


def median_ci(values: list[int]) -> tuple[float, float, float]:
    """Median with its distribution-free 95% interval (binomial order statistics)."""
    xs = np.sort(np.asarray(values, dtype=float))
    n = xs.size
    lo = max(int(math.floor(n / 2 - 0.98 * math.sqrt(n))), 0)
    hi = min(int(math.ceil(n / 2 + 0.98 * math.sqrt(n))), n - 1)
    return float(np.median(xs)), float(xs[lo]), float(xs[hi])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--seq-reps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    plans = {fam: planned_n(fam) for fam in ("standard", "heavy", "bimodal")}
    jobs = [(case, args.reps, plans[spec["fam"]]) for case, spec in CASES.items()]
    horizon = plans["standard"]
    seq_jobs = [(case, args.seq_reps, horizon, 100) for case in SEQ_CASES]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        cells = list(pool.map(run_case, jobs))
        seq_cells = list(pool.map(run_sequential, seq_jobs))
    elapsed = time.perf_counter() - started

    cases: dict[str, Any] = {}
    rows = []
    for cell in cells:
        k, reps = cell["failed"], cell["reps"]
        lo, hi = wilson(k, reps)
        rules = {name: {"rate": f / reps, "ci95": list(wilson(f, reps))}
                 for name, f in cell["by_rule"].items()}
        cases[cell["case"]] = {"n_per_arm": cell["n"], "reps": reps, "failed_rate": k / reps,
                               "ci95": [lo, hi], "by_rule": rules}
        worst = max(cell["by_rule"].items(), key=lambda kv: kv[1])
        rows.append([cell["case"], cell["n"], f"{k / reps:.1%} [{lo:.1%}, {hi:.1%}]",
                     ", ".join(f"{name} {f / reps:.0%}" for name, f in cell["by_rule"].items()
                               if f) or "none", worst[0] if worst[1] else "—"])
    sequential: dict[str, Any] = {}
    seq_rows = []
    for cell in seq_cells:
        reps = cell["reps"]
        counts = {s: cell["statuses"].count(s) for s in ("failed", "passed", "continue",
                                                         "inconclusive")}
        med, mlo, mhi = median_ci(cell["stops"])
        f_lo, f_hi = wilson(counts["failed"], reps)
        sequential[cell["case"]] = {
            "reps": reps, "fixed_horizon": cell["horizon"], "statuses": counts,
            "failed_rate": counts["failed"] / reps, "failed_ci95": [f_lo, f_hi],
            "median_requests": med, "median_ci95": [mlo, mhi],
            "median_share_of_fixed_horizon": med / cell["horizon"],
            "median_share_ci95": [mlo / cell["horizon"], mhi / cell["horizon"]]}
        seq_rows.append([cell["case"], cell["horizon"],
                         f"{counts['failed'] / reps:.1%} [{f_lo:.1%}, {f_hi:.1%}]",
                         f"{counts['passed'] / reps:.0%}",
                         f"{med:.0f} [{mlo:.0f}, {mhi:.0f}]",
                         f"{med / cell['horizon']:.1%} [{mlo / cell['horizon']:.1%}, "
                         f"{mhi / cell['horizon']:.1%}]"])
    figures = {"setup": {"reps": args.reps, "seq_reps": args.seq_reps, "planned_n": plans,
                         "gates": [g.model_dump(exclude_defaults=True) for g in GATES],
                         "goals": {"power": GOAL_POWER, "aa_false_rollback": GOAL_FALSE,
                                   "at_budget_fail": GOAL_BUDGET,
                                   "sequential_median_share": GOAL_SEQ_SHARE},
                         "seconds": round(elapsed, 1)},
               "cases": cases, "sequential": sequential}
    path = write_results("judge", figures)
    print_table(f"Default gates, {args.reps} canaries per case ({elapsed:.0f} s)",
                ["case", "n/arm", "failed [95% CI]", "rules that failed", "top rule"], rows)
    print_table(f"Sequential canary, {args.seq_reps} runs per case, looks every 100/arm",
                ["case", "fixed horizon", "failed [95% CI]", "passed early",
                 "median requests [95% CI]", "share of horizon"], seq_rows)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
