"""The canary judge by simulation, before and after issue 17: every row of its table.

Run: ``.venv/bin/python -m bench.judge [--reps N] [--seq-reps N] [--workers 2]
[--bake-reps N] [--no-bake] [--cases CASE ...] [--after-only]``. ``--cases`` runs only the
rows named (the other rows keep their figures in the file), ``--after-only`` only the
current rules (the before cells keep theirs); each row records when each cell was measured.

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
  p99 gate. Goal ≥ 90%. The plan is the canary's (:func:`tasks.canary.plan_rules`) from a
  20,000-request reference of the same family (before: its own planner and rule, p99
  +50% at power 0.95; after: the default rule, +40% at power 0.9).
- ``errors_2x_seq_off`` / ``errors_2x_seq_on`` / ``errors_2x_early_pass``: errors at 2×
  the budget, independent: the canary's detection with the sequential watch off (fixed
  gates at the planned n) and on (looks of 100 per arm up to the planned n, early pass
  allowed after the 2000-request floor), and how often it passed early. Goals: on ≥ off;
  early pass only when within tolerance (so ≈ 0). After: the watch-on plan is
  :func:`tasks.canary.plan_rules` with the watch's share (the fixed test at the α left
  loses no power where the watch-off test has at least half).

The bake rows come from :func:`bench.judge_bake.run` when that module exists, so one
command reports every row. Figures go to ``bench/results/judge.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import RESULTS_DIR, print_table, rate_cell, wilson, write_results
from bench.traffic_models import Arm, arm, standard_latency, tail_stretch
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import FAMILY_ALPHA, default_gates
from tasks import gates as after_gates
from tasks import sequential as after_sequential
from tasks.canary import SEQUENTIAL_SHARE, plan_rules, sequential_config, spend_alpha, watched

__all__ = ["run", "wilson"]

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "8cc6873"
DURATION_S = 30.0
N_FIXED = 5000
FLOOR = 2000
BATCH = 100
LOOKS = 200
REFERENCE = 2000
MAX_PLAN = 40_000
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


@dataclass(frozen=True)
class LegacyRule:
    """A gate rule in the one-class shape of :data:`BEFORE` (every field on every rule), for
    the rules read from that commit (today's rules are a union of classes per test)."""

    name: str
    metric: str
    test: str | None = None
    min: float | None = None
    max: float | None = None
    max_increase_pct: float | None = None
    min_effect_ms: float | None = None
    max_rate: float | None = None
    dry_run: bool = False
    alpha: float = 0.05
    power: float = 0.8
    effect: float | None = None

    def model_dump(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_copy(self, *, update: Mapping[str, Any]) -> LegacyRule:
        return dataclasses.replace(self, **update)


def gates_before() -> list[Any]:
    """The default gates at :data:`BEFORE` (its ``default_gates()``, error rule at α 0.05)."""
    return [
        LegacyRule("latency_p50", "latency_p50_ms", "mann_whitney", max_increase_pct=10.0,
                   min_effect_ms=0.05, alpha=0.01, power=0.95, effect=15.0),
        LegacyRule("latency_p99", "latency_p99_ms", "quantile", max_increase_pct=10.0,
                   min_effect_ms=0.5, alpha=0.01, power=0.95, effect=40.0),
        LegacyRule("error_rate", "error_rate", "exact_rate", max_rate=0.001, alpha=0.05,
                   power=0.95, effect=0.004),
        LegacyRule("agreement", "agreement", "threshold", min=0.98),
        LegacyRule("server_latency", "server_latency_ratio", "server_ratio",
                   max_increase_pct=10.0, alpha=0.01),
    ]


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


def judge_rules(version: str, snap: CanarySnapshot, rules: Sequence[Any],
                min_samples: int = 1) -> bool:
    """Whether the combined verdict of ``rules`` is ``failed`` (before or after)."""
    mod = before("gates") if version == "before" else after_gates
    results = [mod.judge(snap, r, min_samples=min_samples) for r in rules]
    return bool(mod.combine(results) is mod.Verdict.FAILED)


def planned(version: str, rules: Sequence[Any], *, watch: bool = False) -> int:
    """The canary's n per arm, from a 20,000-request reference: before, the plan of its
    rules; after, :func:`tasks.canary.plan_rules` (with the watch's share when ``watch``)."""
    ref = standard_latency(np.random.default_rng(7), 20_000)
    if version == "before":
        n = before("gates").plan_samples(rules, baseline_latency_ms=ref, min_samples=FLOOR)
    else:
        n = plan_rules(rules, baseline_latency_ms=ref, baseline_error_rate=0.0, floor=FLOOR,
                       share=SEQUENTIAL_SHARE if watch else 0.0)
    return int(min(n, MAX_PLAN))


def _rule(version: str, name: str) -> list[Any]:
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


def _watch(version: str, reference: np.ndarray, rules: Sequence[Any] | None = None) -> Any:
    if version == "before":
        return before("sequential").SequentialCanary(reference_ms=reference)
    return after_sequential.SequentialCanary(sequential_config(rules or default_gates()),
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


ERROR_RULE_ONLY = False
"""``--2x-error-rule-only``: the 2×-budget rows judge (and watch) the error rule alone, at
the default policy's planned n (a tenth of the cost: no latency watch)."""


def run_canary_2x(args: tuple[str, int] | tuple[str, int, int] | tuple[str, int, int, bool]
                  ) -> dict[str, Any]:
    """Errors at 2× the budget: detection with the watch off and on, and early passes.

    Common random numbers: one simulated canary of the larger planned n per rep; the watch
    off judges its first ``n_off`` requests per arm, the watch on looks at it from the start.
    """
    version, reps = args[0], args[1]
    first = args[2] if len(args) > 2 else 0
    error_only = bool(args[3]) if len(args) > 3 else ERROR_RULE_ONLY
    every = gates_before() if version == "before" else default_gates()
    n_off = planned(version, every)
    n_on = planned(version, every) if version == "before" else planned(version, every,
                                                                       watch=True)
    rules = [r for r in every if r.name == "error_rate"] if error_only else every
    fixed_on = rules if version == "before" else spend_alpha(rules)
    off = on = early = 0
    for rep in range(first, first + reps):
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
        watch = _watch(version, standard_latency(rng, REFERENCE), rules)
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


CANARY_2X = ("errors_2x_off", "errors_2x_on", "errors_2x_early")


def run(reps: int = 200, seq_reps: int = 100, workers: int = 2,
        cases: Sequence[str] | None = None,
        versions: Sequence[str] = ("before", "after")) -> list[dict[str, Any]]:
    """The canary and gate rows: ``{case, what, rule, goal, before: (k, n), after: (k, n)}``.

    ``cases`` keeps only the rows named (every row when None; any ``errors_2x_*`` name runs
    the three 2×-budget rows); ``versions`` the columns measured (a missing one is None).
    """
    wanted = set(cases) if cases is not None else None
    unknown = (wanted or set()) - {*FIXED, *SEQUENTIAL, *CANARY_2X}
    if unknown:
        raise SystemExit(f"unknown case(s): {', '.join(sorted(unknown))}; known: "
                         f"{', '.join([*FIXED, *SEQUENTIAL, *CANARY_2X])}")

    def keep(case: str) -> bool:
        return wanted is None or case in wanted

    fixed_jobs = [(c, v, reps) for c in FIXED if keep(c) for v in versions]
    seq_jobs = [(c, v, seq_reps) for c in SEQUENTIAL if keep(c) for v in versions]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        cells = list(pool.map(run_fixed, fixed_jobs)) + list(pool.map(run_sequential,
                                                                     seq_jobs))
        chunks = [(v, len(part), int(part[0]), ERROR_RULE_ONLY) for v in versions
                  if any(keep(c) for c in CANARY_2X)
                  for part in np.array_split(np.arange(seq_reps), workers) if part.size]
        canary: dict[str, dict[str, Any]] = {}
        for c in pool.map(run_canary_2x, chunks):  # reps split across the workers
            into = canary.setdefault(c["version"], {**c, "reps": 0, "off": 0, "on": 0,
                                                    "early": 0})
            for key in ("reps", "off", "on", "early"):
                into[key] += c[key]
    specs = {case: spec for case, spec in {**FIXED, **SEQUENTIAL}.items() if keep(case)}
    rows: list[dict[str, Any]] = []

    def cell(by: Mapping[str, Mapping[str, Any]], v: str, k: str, n: str
             ) -> tuple[int, int] | None:
        return (by[v][k], by[v][n]) if v in by else None

    for case in specs:
        by = {c["version"]: c for c in cells if c["case"] == case}
        rows.append({"case": case, "what": specs[case]["what"], "rule": specs[case]["rule"],
                     "goal": specs[case]["goal"],
                     "before": cell(by, "before", "k", "n"),
                     "after": cell(by, "after", "k", "n"),
                     "n_per_arm": {v: by[v]["n_per_arm"] for v in by}})
    for key, what, goal in (("off", "errors at 2× budget, watch off (planned n)", "≤ on"),
                            ("on", "errors at 2× budget, watch on", "≥ off"),
                            ("early", "errors at 2× budget: early passes", "≈ 0")):
        if not canary:
            break
        if ERROR_RULE_ONLY:
            what = f"{what}, the error rule alone"
        rows.append({"case": f"errors_2x_{key}" + ("_error_rule" if ERROR_RULE_ONLY else ""),
                     "what": what,
                     "rule": "sequential canary" if key != "off" else "fixed gates",
                     "goal": goal,
                     "before": cell(canary, "before", key, "reps"),
                     "after": cell(canary, "after", key, "reps"),
                     "n_per_arm": {v: canary[v]["n_off" if key == "off" else "n_on"]
                                   for v in canary}})
    return rows


def _merge(path: Path, rows: list[dict[str, Any]], setup: dict[str, Any]) -> dict[str, Any]:
    """The figures file with ``rows`` replacing the rows of the same case (cells measured
    now replace that cell; a cell not measured now keeps its earlier figure)."""
    old: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    by_case = {r["case"]: r for r in old.get("rows", [])}
    for row in rows:
        prev = by_case.get(row["case"], {})
        merged = {**prev, **{k: v for k, v in row.items() if v is not None}}
        merged["n_per_arm"] = {**prev.get("n_per_arm", {}), **row.get("n_per_arm", {})}
        for v in ("before", "after"):
            if row.get(v) is not None:
                merged[v] = list(row[v])
                merged[f"{v}_ci95"] = list(wilson(*row[v]))
                merged.setdefault("measured", {})[v] = setup["measured_at"]
        by_case[row["case"]] = merged
    order = [*FIXED, *SEQUENTIAL, *CANARY_2X, *(f"{c}_error_rule" for c in CANARY_2X)]
    rows_out = sorted(by_case.values(), key=lambda r: order.index(r["case"])
                      if r["case"] in order else len(order))
    return {"setup": {**old.get("setup", {}), **setup}, "rows": rows_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--seq-reps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bake-reps", type=int, default=200)
    parser.add_argument("--bake-long-reps", type=int, default=100)
    parser.add_argument("--no-bake", action="store_true")
    parser.add_argument("--cases", nargs="+", default=None,
                        help="only these rows (the others keep their figures in the file); "
                             "implies --no-bake")
    parser.add_argument("--after-only", action="store_true",
                        help="measure only the current rules (the 'before' cells keep their "
                             "figures)")
    parser.add_argument("--2x-error-rule-only", dest="error_only", action="store_true",
                        help="the errors_2x rows judge and watch the error rule alone")
    args = parser.parse_args()
    global ERROR_RULE_ONLY
    ERROR_RULE_ONLY = args.error_only
    started = time.perf_counter()
    versions = ("after",) if args.after_only else ("before", "after")
    rows = run(args.reps, args.seq_reps, args.workers, args.cases, versions)
    bake: list[dict[str, Any]] = []
    if not args.no_bake and args.cases is None \
            and importlib.util.find_spec("bench.judge_bake") is not None:
        from bench import judge_bake  # lazy: it may be absent (the find_spec above)

        bake = judge_bake.run(args.bake_reps, args.workers, args.bake_long_reps)
    elapsed = time.perf_counter() - started
    plan = {v: planned(v, gates_before() if v == "before" else default_gates())
            for v in ("before", "after")}
    setup = {"reps": args.reps, "seq_reps": args.seq_reps, "before": BEFORE,
             "family_alpha_after": FAMILY_ALPHA, "default_plan_n": plan,
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.cases is None:
        setup["seconds"] = round(elapsed, 1)
    figures = _merge(RESULTS_DIR / "judge.json", rows + bake, setup)
    path = write_results("judge", figures)

    def cell(r: Mapping[str, Any], v: str) -> str:
        return rate_cell(*r[v]) if r.get(v) is not None else "–"

    print_table(f"Canary and gate rules, before ({BEFORE}) → after ({elapsed:.0f} s; default "
                f"plan n/arm {plan['before']} → {plan['after']})",
                ["case", "rule", "before [95% CI]", "after [95% CI]", "goal"],
                [[r["case"], r["rule"], cell(r, "before"), cell(r, "after"), r["goal"]]
                 for r in rows + bake])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
