"""Seconds until each component of the embedded stack is ready, for 1 and 3 replicas.

Run: ``.venv/bin/python -m bench.stack_startup [--runs N]``. Each run starts a fresh stack
in a temporary home on free ports, records when each component became ready, and stops it.
Figures go to ``bench/results/stack_startup.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.results import print_table, write_results
from modelship.settings import Settings
from modelship.stack import manager

ROOT = Path(__file__).resolve().parent.parent


def measure(replicas: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ms-bench-") as tmp:
        settings = Settings(home=Path(tmp) / ".modelship",
                            triton_runtime=ROOT / ".venv-triton")
        try:
            _, report = manager.up(settings, replicas=replicas)
        finally:
            manager.down(settings)
    return {**report.ready_s, "total": report.total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2, help="Runs per replica count.")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    for replicas in args.replicas:
        runs = [measure(replicas) for _ in range(args.runs)]
        components = sorted(runs[0], key=lambda k: runs[0][k])
        results[f"replicas_{replicas}"] = {
            name: round(statistics.median(r[name] for r in runs), 2) for name in components
        }
    path = write_results("stack_startup", {"runs_per_config": args.runs,
                                           "median_ready_s": results, "goal_total_s": 45})
    names = sorted({n for r in results.values() for n in r},
                   key=lambda n: (n == "total", n))
    print_table("stack startup: median seconds from `up` until ready",
                ["component", *results],
                [(n, *(results[k].get(n, "-") for k in results)) for n in names])
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
