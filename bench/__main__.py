"""Run every benchmark in turn: ``.venv/bin/python -m bench`` (``make bench``)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ["bench.stack_startup", "bench.stack_restart", "bench.staging", "bench.judge",
              "bench.loadgen", "bench.swap", "bench.fleet_scale", "bench.traffic", "bench.e2e"]


def main() -> None:
    for name in BENCHMARKS:
        print(f"\n=== {name}", flush=True)
        module = importlib.import_module(name)
        sys.argv = [name]
        module.main()


if __name__ == "__main__":
    main()
