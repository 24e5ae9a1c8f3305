"""The judge end to end, as users meet it: real canaries on the stack, A/A and +15% slower.

Run: ``.venv/bin/python -m bench.canary_power [--runs N]``. It starts the embedded stack
(one replica plus the canary) in a temporary home, registers, checks and stages:

- **P**, the baseline: the test classifier's I/O with a chain of ``LAYERS`` ``WIDTH``-wide
  MatMuls in the path (server compute of a few milliseconds, so that the model, not the
  Python backend's fixed cost, dominates the server time);
- **A**, the same graph registered again (an A/A pair: identical bytes, another version);
- **S**, the same graph with ``k`` more layers, ``k`` calibrated so that Triton's compute
  time per request is +15% over P's: secant steps from ``k = 15% of LAYERS`` (at most three
  calibration canaries); the closest is kept and its measured compute and queue + compute
  ratios are reported.

Then ``--runs`` canaries of A against P and of S against P, interleaved (A, S, A, S, ...),
each a full :func:`tasks.canary.run_canary` with the default policy (``Policy()``: the
default gates, load and sample planning). Reported, each with its 95% Wilson interval:
the false-rollback rate (A/A verdict ``failed``), the detection rate (S verdict
``failed``), the inconclusive rates, and which rules fired. Figures go to
``bench/results/canary_power.json``; the stack is always stopped.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from onnx import helper, numpy_helper

from bench.judge import wilson
from bench.results import print_table, write_results
from flows.check import run_check
from modelship.clients import Clients, build_clients
from modelship.errors import ModelshipError
from modelship.policy import Policy
from modelship.settings import Settings, load_settings
from modelship.stack import manager
from tasks.canary import run_canary

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / ".venv-triton"
MODEL = "canary_power"
WIDTH = 384
LAYERS = 32
TARGET_RATIO = 1.15


def chain_graph(layers: int) -> Any:
    """The shared classifier I/O with ``layers`` orthogonal 256-wide MatMuls in the path."""
    # lazy: tests.models pulls pandas (~0.4 s); importing this module for its helpers does not
    from tests import models

    rng = np.random.default_rng(5)
    q, _ = np.linalg.qr(rng.standard_normal((WIDTH, WIDTH)))
    n = models.N_FEATURES
    inits = [
        numpy_helper.from_array(rng.standard_normal((n, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal((n, WIDTH)).astype(np.float32), "Wide"),
        numpy_helper.from_array(q.astype(np.float32), "Q"),
        numpy_helper.from_array(np.array([1e-30], np.float32), "tiny"),
    ]
    nodes = [helper.make_node("MatMul", ["input", "Wide"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "Q"], [f"h{i + 1}"]))
    nodes += [
        helper.make_node("ReduceSum", [f"h{layers}"], ["total"], keepdims=1),
        helper.make_node("Mul", ["total", "tiny"], ["nudge"]),
        helper.make_node("MatMul", ["input", "W"], ["raw"]),
        helper.make_node("Add", ["raw", "nudge"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0),
    ]
    return models.classifier_graph(nodes, inits, name=f"chain{layers}")


def stage(settings: Settings, clients: Clients, layers: int, workdir: Path) -> int:
    # lazy: tests.models pulls pandas (~0.4 s); importing this module for its helpers does not
    from tests import models

    example = {"input": np.random.default_rng(0).standard_normal((16, models.N_FEATURES))
               .astype(np.float32)}
    version = models.register_onnx(str(settings.mlflow_tracking_uri), MODEL,
                                   chain_graph(layers), example=example)
    report = run_check(settings, clients, Policy(), model=MODEL, version=version,
                       workdir=workdir / f"check-{version}", stage=True)
    if report.verdict != "passed":
        raise SystemExit(f"the check of {MODEL} v{version} did not pass: {report.verdict}")
    return version


def server_ratio(result: Any) -> float | None:
    """Candidate / baseline Triton queue + compute µs per request."""
    cand, base = result.snapshot.candidate, result.snapshot.baseline
    if base is None or None in (cand.queue_us_mean, cand.compute_us_mean,
                                base.queue_us_mean, base.compute_us_mean):
        return None
    return float((cand.queue_us_mean + cand.compute_us_mean)
                 / (base.queue_us_mean + base.compute_us_mean))


def compute_ratio(result: Any) -> float | None:
    """Candidate / baseline Triton compute µs per request (what the graph costs)."""
    cand, base = result.snapshot.candidate, result.snapshot.baseline
    if base is None or not cand.compute_us_mean or not base.compute_us_mean:
        return None
    return float(cand.compute_us_mean / base.compute_us_mean)


def one_canary(settings: Settings, clients: Clients, candidate: int, baseline: int,
               workdir: Path) -> dict[str, Any]:
    started = time.monotonic()
    try:
        result = run_canary(settings, clients, Policy(), model=MODEL, candidate=candidate,
                            baseline=baseline, report_dir=workdir)
    except ModelshipError as exc:
        return {"verdict": f"raised {type(exc).__name__}", "message": exc.message,
                "seconds": round(time.monotonic() - started, 1)}
    fired = [r.rule for r in result.gate_report.results
             if str(r.verdict) == "failed" and not r.dry_run]
    return {"verdict": result.verdict, "fired": fired, "server_ratio": server_ratio(result),
            "compute_ratio": compute_ratio(result),
            "samples": result.load["samples"], "required": result.load["required_samples"],
            "seconds": round(time.monotonic() - started, 1)}


def rate(runs: list[dict[str, Any]], verdict: str) -> dict[str, Any]:
    k = sum(1 for r in runs if r["verdict"] == verdict)
    lo, hi = wilson(k, len(runs))
    return {"rate": k / len(runs) if runs else None, "ci95": [lo, hi], "count": k}


def run(settings: Settings, runs: int, workdir: Path) -> dict[str, Any]:
    clients = build_clients(settings)
    try:
        baseline = stage(settings, clients, LAYERS, workdir)
        same = stage(settings, clients, LAYERS, workdir)
        calibration: list[dict[str, Any]] = []

        def calibrate(extra: int) -> float | None:
            version = stage(settings, clients, LAYERS + extra, workdir)
            figures = one_canary(settings, clients, version, baseline, workdir / f"cal{extra}")
            calibration.append({"extra_layers": extra, "version": version, **figures})
            print(f"calibration +{extra} layers: compute ×{figures.get('compute_ratio')}, "
                  f"queue + compute ×{figures.get('server_ratio')}", flush=True)
            return figures.get("compute_ratio")

        # Secant steps on k -> compute ratio (1.0 at k = 0), three canaries at most.
        points = [(0, 1.0)]
        k = max(1, round((TARGET_RATIO - 1.0) * LAYERS))
        for _ in range(3):
            if any(k == done for done, _ in points):
                break
            measured = calibrate(k)
            if not measured:
                break
            points.append((k, measured))
            (k0, r0), (k1, r1) = sorted(points, key=lambda p: abs(p[1] - TARGET_RATIO))[:2]
            if r1 == r0:
                break
            k = min(max(1, round(k0 + (TARGET_RATIO - r0) * (k1 - k0) / (r1 - r0))),
                    3 * LAYERS)
        usable = [c for c in calibration if c.get("compute_ratio")]
        if not usable:
            raise SystemExit(f"no calibration canary measured a compute ratio: {calibration}")
        slow = min(usable, key=lambda c: abs(c["compute_ratio"] - TARGET_RATIO))
        aa: list[dict[str, Any]] = []
        regression: list[dict[str, Any]] = []
        for i in range(runs):
            aa.append(one_canary(settings, clients, same, baseline, workdir / f"aa{i}"))
            regression.append(one_canary(settings, clients, slow["version"], baseline,
                                         workdir / f"slow{i}"))
            print(f"run {i + 1}: A/A {aa[-1]['verdict']}, +15% {regression[-1]['verdict']}",
                  flush=True)
    finally:
        clients.close()
    slow_ratios = [r["server_ratio"] for r in regression if r.get("server_ratio")]
    aa_ratios = [r["server_ratio"] for r in aa if r.get("server_ratio")]
    slow_compute = [r["compute_ratio"] for r in regression if r.get("compute_ratio")]
    return {
        "setup": {"runs": runs, "layers": LAYERS, "width": WIDTH,
                  "slow_extra_layers": slow["extra_layers"], "policy": "Policy() defaults"},
        "calibration": calibration,
        "server_ratio": {"aa_median": float(np.median(aa_ratios)) if aa_ratios else None,
                         "slow_median": float(np.median(slow_ratios)) if slow_ratios else None,
                         "slow_compute_median": (float(np.median(slow_compute))
                                                 if slow_compute else None)},
        "aa": {"false_rollback": rate(aa, "failed"), "inconclusive": rate(aa, "inconclusive"),
               "runs": aa},
        "slow": {"detection": rate(regression, "failed"),
                 "inconclusive": rate(regression, "inconclusive"), "runs": regression},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="canaries per arm (default 10)")
    args = parser.parse_args(argv)
    for key, value in {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "GX_ANALYTICS_ENABLED": "false",
                       "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}.items():
        os.environ.setdefault(key, value)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ms-bench-canary-power-") as tmp:
        home = Path(tmp) / ".modelship"
        base = Settings(home=home, triton_runtime=RUNTIME)
        try:
            print(f"starting the stack in {home}", flush=True)
            manager.up(base, replicas=1)
            settings = load_settings(home=home, triton_runtime=RUNTIME)
            figures = run(settings, args.runs, Path(tmp))
        finally:
            manager.down(base)
    figures["runtime_s"] = round(time.monotonic() - started, 1)
    path = write_results("canary_power", figures)

    def cell(r: dict[str, Any]) -> str:
        return f"{r['rate']:.0%} [{r['ci95'][0]:.0%}, {r['ci95'][1]:.0%}] ({r['count']})"

    print_table(f"Real canaries on the stack, {args.runs} per arm (default policy)",
                ["pair", "server ratio (median)", "failed [95% CI]", "inconclusive"],
                [["A/A", figures["server_ratio"]["aa_median"],
                  cell(figures["aa"]["false_rollback"]), cell(figures["aa"]["inconclusive"])],
                 [f"+{figures['setup']['slow_extra_layers']} layers (≈+15% server)",
                  figures["server_ratio"]["slow_median"], cell(figures["slow"]["detection"]),
                  cell(figures["slow"]["inconclusive"])]])
    print(f"\nwritten to {path} ({figures['runtime_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
