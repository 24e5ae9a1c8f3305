"""The canary judge by simulation, before and after issue 17: every row of its table.

Run: ``.venv/bin/python -m bench.judge [--reps N] [--seq-reps N] [--workers 2]
[--bake-reps N] [--no-bake]``.

Every canary is simulated (no servers) with the seeded generators of
:mod:`bench.traffic_models` (``SeedSequence([case, rep])``): per-arm AR(1) latency of the
standard family (lognormal body, median 2 ms, log-sd 0.3, plus a 5% exponential tail of mean
4 ms), errors in bursts, a tail-only stretch. Both arms run 30 s with evenly spaced sends,
so the snapshot carries every request's send time; Triton's server time is simulated as
0.85 × each client latency, summed per one-second interval (so dependence reaches the
server rule too).

- **before**: the rules at ``8cc6873`` (``tasks/gates.py`` and ``tasks/sequential.py`` read
  from git into temporary modules), with that commit's default gates (error rule α 0.05)
  and its canary logic (the "clearly fine" stop sized with a fixed 40% effect, then the
  fixed gates at the 2000-request floor).
- **after**: the current rules as ``promote`` calls them: the default gates
  (family-wise α 5%), the sequential watch from :func:`tasks.canary.sequential_config`
  with :func:`tasks.canary.spend_alpha` for the fixed tests, early passes only when shown
  within tolerance.

Rows (the issue's table, canary and gate side):

- ``errors_burst8_fixed``: errors exactly at the budget (0.1%) in bursts of mean length 8,
  n = 5000: the fixed error gate's fail rate. Goal ≤ the rule's α.
- ``errors_burst8_sequential``: the same traffic through the sequential watch, 200 looks of
  100 requests per arm. Goal ≤ the watch's α for the rule.
- ``identical_ar09_sequential``: an identical candidate, per-arm AR(1) φ = 0.9, 200 looks:
  the watch's fail rate. Goal ≤ 1%.
- ``p50_at_tolerance_ar05``: per-arm AR(1) φ = 0.5, latency ×1.10 (the tolerance), n = 5000:
  the fixed p50 gate. Goal ≤ its α (1%).
- ``identical_ar099_fixed``: per-arm AR(1) φ = 0.99, identical, n = 5000: all fixed gates.
  Goal ≤ 1%.
- ``all_at_boundary``: every default rule at its boundary at once (latency ×1.10, errors at
  the budget, independent), n = 5000: the combined verdict. Goal ≤ the stated family-wise
  α (before: the docstring's "A/A ≤ 1%"; after: 5%).
- ``tail_p99_+40pct``: the p99 +40%, tail only (p50 unchanged), at the planned n: the
  p99 gate. Goal ≥ 90%.
- ``errors_2x_seq_off`` / ``errors_2x_seq_on`` / ``errors_2x_early_pass``: errors at 2×
  the budget, independent: the canary's detection with the sequential watch off (fixed
  gates at the planned n) and on (looks of 100 per arm up to the planned n, early pass
  allowed after the 2000-request floor), and how often it passed early. Goals: on ≥ off;
  early pass only when within tolerance (so ≈ 0).

The bake rows come from :func:`bench.judge_bake.run` when that module exists, so one
command reports every row. Figures go to ``bench/results/judge.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import print_table, rate_cell, wilson, write_results
from bench.traffic_models import Arm, arm, standard_latency, tail_stretch
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import FAMILY_ALPHA, GateRule, default_gates
from tasks import gates as after_gates
from tasks import sequential as after_sequential
from tasks.canary import sequential_config, spend_alpha, watched

__all__ = ["run", "wilson"]

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "8cc6873"
DURATION_S = 30.0
N_FIXED = 5000
FLOOR = 2000
BATCH = 100
LOOKS = 200
REFERENCE = 2000
MAX_PLAN = 12_000
SERVER_SHARE = 0.85

_modules: dict[str, types.ModuleType] = {}


def before(name: str) -> types.ModuleType:
    """``tasks/<name>.py`` as it was at :data:`BEFORE`, as a module (cached per process)."""
    if name not in _modules:
        source = subprocess.run(["git", "show", f"{BEFORE}:tasks/{name}.py"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
        module = types.ModuleType(f"_before_{name}")
        sys.modules[module.__name__] = module
        exec(compile(source, f"{BEFORE}:tasks/{name}.py", "exec"), module.__dict__)
        _modules[name] = module
    return _modules[name]


def gates_before() -> list[GateRule]:
    """The default gates at :data:`BEFORE` (the error rule at α 0.05)."""
    return [g.model_copy(update={"alpha": 0.05}) if g.name == "error_rate" else g
            for g in default_gates()]


# ------------------------------------------------------------------------- simulation


def _measured(version: int, a: Arm) -> ArmMeasurements:
    return ArmMeasurements(version, a.latency_ms, a.requests, int(a.error_s.size),
                           a.requests / DURATION_S, None, None, a.ok_s, a.error_s)


def snapshot(rng: np.random.Generator, n: int, *, phi: float = 0.0, scale: float = 1.0,
             c_err: float = 0.0, burst: float = 1.0,
             transform: Callable[[np.ndarray], np.ndarray] | None = None) -> CanarySnapshot:
    """One paired canary: the candidate ×``scale`` (or ``transform``ed), both arms AR(1)."""
    def cand_transform(x: np.ndarray) -> np.ndarray:
        return transform(x) if transform is not None else scale * x

    cand = arm(rng, n, phi=phi, error_rate=c_err, mean_burst=burst, duration_s=DURATION_S,
               transform=cand_transform)
    base = arm(rng, n, phi=phi, duration_s=DURATION_S)
    intervals = []
    for second in range(int(DURATION_S)):
        cell = {}
        for name, a in (("candidate", cand), ("baseline", base)):
            inside = (a.ok_s >= second) & (a.ok_s < second + 1)
            cell[name] = {"us": float(a.latency_ms[inside].sum()) * 1000 * SERVER_SHARE,
                          "n": float(inside.sum())}
        intervals.append(cell)
    c_m, b_m = _measured(7, cand), _measured(6, base)
    c_us = SERVER_SHARE * 1000 * float(cand.latency_ms.mean())
    b_us = SERVER_SHARE * 1000 * float(base.latency_ms.mean())
    return CanarySnapshot(
        "fraud", ArmMeasurements(7, c_m.latency_ms, c_m.requests, c_m.errors,
                                 c_m.throughput_rps, 20.0, c_us - 20.0, c_m.latency_s,
                                 c_m.error_s),
        ArmMeasurements(6, b_m.latency_ms, b_m.requests, b_m.errors, b_m.throughput_rps,
                        20.0, b_us - 20.0, b_m.latency_s, b_m.error_s),
        agreement=1.0, agreement_samples=n, window_s=DURATION_S,
        extra={"server_intervals": intervals})


def _rng(case: str, rep: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([sum(map(ord, case)), rep]))


def judge_rules(version: str, snap: CanarySnapshot, rules: Sequence[GateRule],
                min_samples: int = 1) -> bool:
    """Whether the combined verdict of ``rules`` is ``failed`` (before or after)."""
    mod = before("gates") if version == "before" else after_gates
    results = [mod.judge(snap, r, min_samples=min_samples) for r in rules]
    return bool(mod.combine(results) is mod.Verdict.FAILED)


def planned(version: str, rules: Sequence[GateRule]) -> int:
    mod = before("gates") if version == "before" else after_gates
    ref = standard_latency(np.random.default_rng(7), 20_000)
    return int(min(mod.plan_samples(rules, baseline_latency_ms=ref, min_samples=FLOOR),
                   MAX_PLAN))


def _rule(version: str, name: str) -> list[GateRule]:
    rules = gates_before() if version == "before" else default_gates()
    return [r for r in rules if r.name == name]


FIXED: dict[str, dict[str, Any]] = {
    "errors_burst8_fixed": {"kw": {"c_err": 0.001, "burst": 8.0}, "rules": "error_rate",
                            "what": "errors at budget, bursts of 8, n = 5000",
                            "rule": "fixed error gate", "goal": "≤ rule's α"},
    "p50_at_tolerance_ar05": {"kw": {"phi": 0.5, "scale": 1.1}, "rules": "latency_p50",
                              "what": "per-arm AR(1) φ = 0.5, latency ×1.10 (at tolerance)",
                              "rule": "fixed p50 gate", "goal": "≤ 1%"},
    "identical_ar099_fixed": {"kw": {"phi": 0.99}, "rules": "all",
                              "what": "per-arm AR(1) φ = 0.99, identical",
                              "rule": "all fixed gates", "goal": "≤ 1%"},
    "all_at_boundary": {"kw": {"scale": 1.1, "c_err": 0.001}, "rules": "all",
                        "what": "every default rule at its boundary at once",
                        "rule": "fixed gates, family-wise",
                        "goal": f"≤ stated α (before 'A/A ≤ 1%', after {FAMILY_ALPHA:.0%})"},
    "tail_p99_+40pct": {"kw": {"tail": 1.4}, "rules": "latency_p99", "plan": True,
                        "what": "p99 +40%, tail only, p50 unchanged, at the planned n",
                        "rule": "fixed p99 gate", "goal": "≥ 90% caught"},
}


def run_fixed(args: tuple[str, str, int]) -> dict[str, Any]:
    case, version, reps = args
    spec = FIXED[case]
    rules = (gates_before() if version == "before" else default_gates()) \
        if spec["rules"] == "all" else _rule(version, spec["rules"])
    n = planned(version, rules) if spec.get("plan") else N_FIXED
    kw = dict(spec["kw"])
    ref = standard_latency(np.random.default_rng(99), 200_000)
    if "tail" in kw:
        ratio = kw.pop("tail")
        kw["transform"] = lambda x: tail_stretch(x, ref, 0.99, ratio)
    failed = sum(judge_rules(version, snapshot(_rng(case, rep), n, **kw), rules)
                 for rep in range(reps))
    return {"case": case, "version": version, "k": failed, "n": reps, "n_per_arm": n}


# ------------------------------------------------------------------------- sequential


def _watch(version: str, reference: np.ndarray) -> Any:
    if version == "before":
        return before("sequential").SequentialCanary(reference_ms=reference)
    return after_sequential.SequentialCanary(sequential_config(default_gates()),
                                             reference_ms=reference)


def _look(version: str, watch: Any, c: Arm, b: Arm, lo: float, hi: float) -> str:
    inside_c = (c.ok_s >= lo) & (c.ok_s < hi)
    inside_b = (b.ok_s >= lo) & (b.ok_s < hi)
    err = (c.error_s >= lo) & (c.error_s < hi)
    kw: dict[str, Any] = {"candidate_errors": int(err.sum())}
    if version == "after":
        sent = np.concatenate([c.ok_s[inside_c], c.error_s[err]])
        failed = np.concatenate([np.zeros(int(inside_c.sum()), bool), np.ones(int(err.sum()),
                                                                              bool)])
        kw["candidate_failed"] = failed[np.argsort(sent, kind="stable")]
    return str(watch.update(b.latency_ms[inside_b], c.latency_ms[inside_c], **kw).status)


SEQUENTIAL: dict[str, dict[str, Any]] = {
    "errors_burst8_sequential": {"kw": {"c_err": 0.001, "burst": 8.0},
                                 "what": "errors at budget, bursts of 8, 200 looks",
                                 "rule": "sequential error watch",
                                 "goal": "≤ watch's α (before α/3 = 0.33%, after 1%)"},
    "identical_ar09_sequential": {"kw": {"phi": 0.9},
                                  "what": "identical, per-arm AR(1) φ = 0.9, 200 looks",
                                  "rule": "sequential latency watch", "goal": "≤ 1%"},
}


def run_sequential(args: tuple[str, str, int]) -> dict[str, Any]:
    case, version, reps = args
    kw = SEQUENTIAL[case]["kw"]
    n = LOOKS * BATCH
    failed = 0
    for rep in range(reps):
        rng = _rng(case, rep)
        c = arm(rng, n, phi=kw.get("phi", 0.0), error_rate=kw.get("c_err", 0.0),
                mean_burst=kw.get("burst", 1.0), duration_s=float(LOOKS))
        b = arm(rng, n, phi=kw.get("phi", 0.0), duration_s=float(LOOKS))
        watch = _watch(version, standard_latency(rng, REFERENCE))
        for look in range(LOOKS):
            status = _look(version, watch, c, b, float(look), float(look + 1))
            if status != "continue":
                break
        failed += status == "failed"
    return {"case": case, "version": version, "k": failed, "n": reps, "n_per_arm": n}


def run_canary_2x(args: tuple[str, int]) -> dict[str, Any]:
    """Errors at 2× the budget: detection with the watch off and on, and early passes.

    Common random numbers: one simulated canary of the larger planned n per rep; the watch
    off judges its first ``n_off`` requests per arm, the watch on looks at it from the start.
    """
    version, reps = args
    rules = gates_before() if version == "before" else default_gates()
    fixed_on = rules if version == "before" else spend_alpha(rules)
    n_off, n_on = planned(version, rules), planned(version, fixed_on)
    off = on = early = 0
    for rep in range(reps):
        rng = _rng("errors_2x", rep)
        n_max = max(n_off, n_on)
        snap = snapshot(rng, n_max, c_err=0.002)
        c, b = snap.candidate, snap.baseline
        assert b is not None
        t_off = DURATION_S * n_off / n_max
        off += judge_rules(version, CanarySnapshot(
            "fraud", _cut(c, t_off), _cut(b, t_off), agreement=1.0, agreement_samples=n_off,
            window_s=t_off, extra={"server_intervals": snap.extra["server_intervals"][
                :max(int(t_off), 3)]}), rules)
        assert c.latency_s is not None and c.error_s is not None and b is not None \
            and b.latency_s is not None
        c_arm = Arm(c.latency_ms, c.latency_s, c.error_s)
        b_arm = Arm(b.latency_ms, b.latency_s, np.zeros(0))
        watch = _watch(version, standard_latency(rng, REFERENCE))
        looks = int(np.ceil(n_on / BATCH))
        step = DURATION_S * n_on / n_max / looks
        status, stop = "continue", looks
        for look in range(looks):
            status = _look(version, watch, c_arm, b_arm, look * step, (look + 1) * step)
            done = look + 1
            if status == "failed" or (status == "passed" and done * BATCH >= FLOOR):
                stop = done
                break
        if status == "failed":
            on += 1
            continue
        passed_early = status == "passed" and stop < looks
        early += passed_early
        cut = stop * step
        part = CanarySnapshot(
            "fraud", _cut(c, cut), _cut(b, cut), agreement=1.0, agreement_samples=n_on,
            window_s=cut, extra={"server_intervals": snap.extra["server_intervals"][
                :max(int(cut), 3)]})
        if version == "before":
            on += judge_rules(version, part, rules, FLOOR if passed_early else 1)
        else:
            judged = [r for r in fixed_on if not (passed_early and watched(r))]
            on += judge_rules(version, part, judged, FLOOR if passed_early else 1)
    return {"version": version, "reps": reps, "off": off, "on": on, "early": early,
            "n_off": n_off, "n_on": n_on}


def _cut(a: ArmMeasurements, t: float) -> ArmMeasurements:
    assert a.latency_s is not None and a.error_s is not None
    keep, errs = a.latency_s < t, a.error_s < t
    return ArmMeasurements(a.version, a.latency_ms[keep], int(keep.sum() + errs.sum()),
                           int(errs.sum()), a.throughput_rps, a.queue_us_mean,
                           a.compute_us_mean, a.latency_s[keep], a.error_s[errs])


# ------------------------------------------------------------------------- all rows


def run(reps: int = 200, seq_reps: int = 100, workers: int = 2) -> list[dict[str, Any]]:
    """The canary and gate rows: ``{case, what, rule, goal, before: (k, n), after: (k, n)}``."""
    fixed_jobs = [(c, v, reps) for c in FIXED for v in ("before", "after")]
    seq_jobs = [(c, v, seq_reps) for c in SEQUENTIAL for v in ("before", "after")]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        cells = list(pool.map(run_fixed, fixed_jobs)) + list(pool.map(run_sequential,
                                                                     seq_jobs))
        canary = {c["version"]: c for c in pool.map(run_canary_2x,
                                                     [("before", seq_reps),
                                                      ("after", seq_reps)])}
    specs = {**FIXED, **SEQUENTIAL}
    rows: list[dict[str, Any]] = []
    for case in specs:
        by = {c["version"]: c for c in cells if c["case"] == case}
        rows.append({"case": case, "what": specs[case]["what"], "rule": specs[case]["rule"],
                     "goal": specs[case]["goal"],
                     "before": (by["before"]["k"], by["before"]["n"]),
                     "after": (by["after"]["k"], by["after"]["n"]),
                     "n_per_arm": {"before": by["before"]["n_per_arm"],
                                   "after": by["after"]["n_per_arm"]}})
    for key, what, goal in (("off", "errors at 2× budget, watch off (planned n)", "≤ on"),
                            ("on", "errors at 2× budget, watch on", "≥ off"),
                            ("early", "errors at 2× budget: early passes", "≈ 0")):
        rows.append({"case": f"errors_2x_{key}", "what": what,
                     "rule": "sequential canary" if key != "off" else "fixed gates",
                     "goal": goal,
                     "before": (canary["before"][key], canary["before"]["reps"]),
                     "after": (canary["after"][key], canary["after"]["reps"]),
                     "n_per_arm": {v: canary[v]["n_off" if key == "off" else "n_on"]
                                   for v in ("before", "after")}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--seq-reps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bake-reps", type=int, default=200)
    parser.add_argument("--bake-long-reps", type=int, default=100)
    parser.add_argument("--no-bake", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run(args.reps, args.seq_reps, args.workers)
    bake: list[dict[str, Any]] = []
    if not args.no_bake and importlib.util.find_spec("bench.judge_bake") is not None:
        from bench import judge_bake

        bake = judge_bake.run(args.bake_reps, args.workers, args.bake_long_reps)
    elapsed = time.perf_counter() - started
    plan = {v: planned(v, gates_before() if v == "before" else default_gates())
            for v in ("before", "after")}
    figures = {"setup": {"reps": args.reps, "seq_reps": args.seq_reps, "before": BEFORE,
                         "family_alpha_after": FAMILY_ALPHA, "default_plan_n": plan,
                         "seconds": round(elapsed, 1)},
               "rows": [{**r, "before": list(r["before"]), "after": list(r["after"]),
                         "before_ci95": list(wilson(*r["before"])),
                         "after_ci95": list(wilson(*r["after"]))} for r in rows + bake]}
    path = write_results("judge", figures)
    print_table(f"Canary and gate rules, before ({BEFORE}) → after ({elapsed:.0f} s; default "
                f"plan n/arm {plan['before']} → {plan['after']})",
                ["case", "rule", "before [95% CI]", "after [95% CI]", "goal"],
                [[r["case"], r["rule"], rate_cell(*r["before"]), rate_cell(*r["after"]), r["goal"]]
                 for r in rows + bake])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
