"""The bake's rules by simulation: false rollbacks under surges, dependence and bursts, and
power, before (the rules of session 16) and after issue 17, with 95% intervals.

Run: ``.venv/bin/python -m bench.judge_bake [--reps N] [--long-reps N] [--workers 2]``.
``bench/judge.py`` calls :func:`run` for the bake rows of its table.

Every bake is simulated (no servers) with the seeded generator
:func:`bench.traffic_models.bake_traffic` and ``SeedSequence([case, rep])``: the probe's
per-request latencies (the judge bench's standard family, AR(1) across the whole run when
``phi`` is set), the fleet's requests and failures per 2-s window, and the request rate.
A traffic surge multiplies the rate and slows every request by M/M/1 queueing
(:func:`bench.traffic_models.queueing_factor`: traffic ×2 → latency ×1.5).

- **after**: :func:`tasks.bake.judge_windows` as the bake calls it (after every window,
  stopping at the first breach; :func:`first_breach` only skips the calls that cannot
  change the verdict, and a unit test checks it against calling after every window), with
  the default :class:`modelship.policy.BakePolicy` and the case's duration.
- **before**: the session-16 rules, restated here as they were (``tasks/bake.py`` at
  ``8cc6873``): one pre-swap window of 4 s; per-request Bernoulli e-processes, errors
  against the budget and, per quantile, the exceedances of ``max(τ·1.25, τ + 0.3 ms)``
  against the Clopper-Pearson bound of the reference.

Each row: the share of bakes that rolled back (a false rollback, or a catch), with its 95%
Wilson interval, and the goal. Figures go to ``bench/results/judge_bake.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from bench.results import print_table, rate_cell, wilson, write_results
from bench.traffic_models import BakeTraffic, bake_traffic
from modelship.policy import BakePolicy
from tasks.bake import (
    Reference,
    Window,
    error_log_e_path,
    latency_state,
    load_departure,
    look_plan,
    total_windows,
)
from tasks.sequential import log_e_above, log_e_over_budget, quantile_bound

BEFORE = BakePolicy(baseline_s=4.0, probe_rps=40.0)
"""The session-16 defaults the old rules ran with (tolerance 25%, p50 and p90, α 0.01)."""

HOUR = 3600.0

CASES: dict[str, dict[str, Any]] = {
    "surge_x2_10s": {"duration_s": 10.0, "load_after": 2.0, "goal": "≤ 1%",
                     "what": "good model, traffic ×2 right after the swap (latency ×1.5)"},
    "surge_x2_1h": {"duration_s": HOUR, "load_after": 2.0, "goal": "≤ 1%",
                    "what": "good model, traffic ×2 right after the swap (latency ×1.5)"},
    "ar1_0.9_10s": {"duration_s": 10.0, "phi": 0.9, "goal": "≤ 1%",
                    "what": "unchanged model, per-request latency AR(1) φ = 0.9"},
    "ar1_0.9_1h": {"duration_s": HOUR, "phi": 0.9, "goal": "≤ 1%",
                   "what": "unchanged model, per-request latency AR(1) φ = 0.9"},
    "errors_budget_bursts8_1h": {"duration_s": HOUR, "error_rate": 0.001, "mean_burst": 8.0,
                                 "goal": "≤ 1%",
                                 "what": "errors exactly at budget, bursts of mean 8"},
    "latency_x1.3_10s": {"duration_s": 10.0, "scale": 1.3, "goal": "—",
                         "what": "+30% latency, unchanged load"},
    "latency_x1.3_120s": {"duration_s": 120.0, "scale": 1.3, "goal": "≥ 90%",
                          "what": "+30% latency, unchanged load"},
    "latency_x1.3_1h": {"duration_s": HOUR, "scale": 1.3, "goal": "≥ 90%",
                        "what": "+30% latency, unchanged load"},
    "errors_2x_10min": {"duration_s": 600.0, "error_rate": 0.002, "goal": "≥ 90%",
                        "what": "errors at 2× the budget, independent"},
}


def policy_for(case: str, base: BakePolicy | None = None) -> BakePolicy:
    """The policy a case runs with: the defaults (or ``base``) at the case's duration."""
    return (base or BakePolicy()).model_copy(update={"duration_s": CASES[case]["duration_s"]})


def simulate(case: str, rep: int, policy: BakePolicy) -> BakeTraffic:
    """One seeded bake of ``case`` under ``policy``'s probe rate, windows and reference."""
    spec = CASES[case]
    rng = np.random.default_rng(np.random.SeedSequence([list(CASES).index(case), rep]))
    reference = max(int(round(policy.baseline_s / policy.window_s)), 1)
    return bake_traffic(rng, reference=reference, windows=total_windows(policy),
                        window_s=policy.window_s, probe_rps=policy.probe_rps,
                        phi=spec.get("phi", 0.0), scale=spec.get("scale", 1.0),
                        load_after=spec.get("load_after", 1.0),
                        error_rate=spec.get("error_rate", 0.0),
                        mean_burst=spec.get("mean_burst", 1.0))


def windows_of(traffic: BakeTraffic, window_s: float) -> tuple[Reference, list[Window]]:
    """The simulated bake as the judge sees it: the reference and the windows after."""
    made = [Window(index=i - traffic.reference, seconds=window_s,
                   requests=int(traffic.requests[i]), errors=int(traffic.errors[i]),
                   server_us=None, latencies_ms=tuple(traffic.latency_ms[i].tolist()),
                   rate_rps=float(traffic.rate_rps[i]))
            for i in range(len(traffic.latency_ms))]
    return Reference(tuple(made[:traffic.reference])), made[traffic.reference:]


def first_breach(reference: Reference, windows: list[Window],
                 policy: BakePolicy) -> tuple[int, str] | None:
    """The first window (1-based) after which :func:`tasks.bake.judge_windows` breaches,
    and the rule, or None: the same verdicts, computed only where they can change (the
    error e-process after every window, the latency rules at their looks)."""
    totals = np.asarray([w.requests + w.errors for w in windows], dtype=float)
    fractions = np.asarray([w.errors for w in windows], dtype=float) / np.maximum(totals, 1)
    crossed = np.nonzero(error_log_e_path(fractions, policy.max_error_rate)
                         >= math.log(1.0 / policy.alpha))[0]
    errors_at = int(crossed[0]) + 1 if crossed.size else None
    points, _ = look_plan(total_windows(policy), policy.alpha)
    looks = set(points)
    latency_at = None
    judged = 0
    for i, window in enumerate(windows):
        if errors_at is not None and i + 1 >= errors_at:
            break
        judged += load_departure(window, reference, policy) is None
        if judged in looks or i + 1 == len(windows):
            looks.discard(judged)
            if latency_state(windows[:i + 1], reference, policy)["breach"]:
                latency_at = i + 1
                break
    if errors_at is not None and (latency_at is None or errors_at <= latency_at):
        return errors_at, "errors"
    return (latency_at, "latency") if latency_at is not None else None


def first_breach_before(traffic: BakeTraffic, policy: BakePolicy) -> tuple[int, str] | None:
    """The session-16 rules on the same bake (see the module docstring)."""
    ref = np.concatenate(traffic.latency_ms[:traffic.reference])
    ref = ref[:int(round(policy.baseline_s * policy.probe_rps))]
    alpha_q = policy.alpha / len(policy.latency_quantiles)
    limits = []
    for q in policy.latency_quantiles:
        tau, theta0 = quantile_bound(ref, q, alpha_q / 2)
        limits.append((max(tau * 1.25, tau + policy.min_latency_effect_us / 1000.0), theta0))
    failed = total = 0
    slow = [0] * len(limits)
    answered = 0
    for i in range(traffic.reference, len(traffic.latency_ms)):
        failed += int(traffic.errors[i])
        total += int(traffic.errors[i] + traffic.requests[i])
        if failed and log_e_over_budget(failed, total, policy.max_error_rate) >= math.log(
                1.0 / policy.alpha):
            return i - traffic.reference + 1, "errors"
        lat = traffic.latency_ms[i]
        answered += lat.size
        for j, (limit, theta0) in enumerate(limits):
            slow[j] += int(np.count_nonzero(lat > limit))
            if log_e_above(slow[j], answered, theta0) >= math.log(2.0 / alpha_q):
                return i - traffic.reference + 1, "latency"
    return None


def run_case(args: tuple[str, int]) -> dict[str, Any]:
    """``reps`` bakes of one case, judged before and after."""
    case, reps = args
    after_policy, before_policy = policy_for(case), policy_for(case, BEFORE)
    after: dict[str, Any] = {"rolled_back": 0, "errors": 0, "latency": 0, "windows": []}
    before: dict[str, Any] = {"rolled_back": 0, "errors": 0, "latency": 0, "windows": []}
    for rep in range(reps):
        traffic = simulate(case, rep, after_policy)
        reference, windows = windows_of(traffic, after_policy.window_s)
        found = first_breach(reference, windows, after_policy)
        if found:
            after["rolled_back"] += 1
            after[found[1]] += 1
            after["windows"].append(found[0])
        old = first_breach_before(simulate(case, rep, before_policy), before_policy)
        if old:
            before["rolled_back"] += 1
            before[old[1]] += 1
            before["windows"].append(old[0])
    return {"case": case, "reps": reps, "after": after, "before": before}


def run(reps: int = 200, workers: int = 2, long_reps: int | None = None
        ) -> list[dict[str, Any]]:
    """The bake rows: ``{case, rule, before: (k, n), after: (k, n), goal, ...}`` per case,
    ``k`` the bakes that rolled back out of ``n``. One-hour cases run ``long_reps`` (default
    ``reps``)."""
    jobs = [(case, long_reps if long_reps and CASES[case]["duration_s"] >= HOUR else reps)
            for case in CASES]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        cells = list(pool.map(run_case, jobs))
    rows = []
    for cell in cells:
        spec = CASES[cell["case"]]
        rule = "bake errors" if "error" in cell["case"] else "bake latency"
        n = cell["reps"]
        rows.append({
            "case": cell["case"], "what": spec["what"], "rule": rule,
            "duration_s": spec["duration_s"], "goal": spec["goal"],
            "before": (cell["before"]["rolled_back"], n),
            "after": (cell["after"]["rolled_back"], n),
            "before_ci95": wilson(cell["before"]["rolled_back"], n),
            "after_ci95": wilson(cell["after"]["rolled_back"], n),
            "after_by_rule": {k: cell["after"][k] for k in ("errors", "latency")},
            "before_by_rule": {k: cell["before"][k] for k in ("errors", "latency")},
            "after_median_windows": (float(np.median(cell["after"]["windows"]))
                                     if cell["after"]["windows"] else None)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--long-reps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run(args.reps, args.workers, args.long_reps)
    elapsed = time.perf_counter() - started
    policy = BakePolicy()
    figures = {"setup": {"reps": args.reps, "long_reps": args.long_reps,
                         "after_policy": policy.model_dump(),
                         "before_policy": BEFORE.model_dump(),
                         "seconds": round(elapsed, 1)},
               "rows": [{**r, "before": list(r["before"]), "after": list(r["after"])}
                        for r in rows]}
    path = write_results("judge_bake", figures)
    print_table(f"Bake rules, before → after ({elapsed:.0f} s)",
                ["case", "rule", "rolled back before [95% CI]", "after [95% CI]", "goal"],
                [[r["case"], r["rule"], rate_cell(*r["before"]), rate_cell(*r["after"]), r["goal"]]
                 for r in rows])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
