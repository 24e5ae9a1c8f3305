"""CLI start per run: the console script against a run forked from a CLI zygote.

The fault matrix (``tests/e2e/test_crash.py``) runs ``modelship`` about 40 times; each run
of the console script imports the CLI, Prefect, MLflow and, for a release, GX and ONNX.
``tests/zygote.py`` imports them once and forks each run. This measures both ways on the
same machine at the same time, interleaved: ``modelship status MODEL --json`` and
``modelship rollback MODEL --json`` against a home without a stack (each command imports
what it needs and ends at once with its usage or status answer: what is left is start-up
and exit), and checks that both ways give the same exit code and stdout.

``.venv/bin/python -m bench.cli_start [--runs N]`` writes ``bench/results/cli_start.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results import print_table, write_results
from tests.conftest import ROOT, cli_env, run_cli
from tests.faults import cli_zygote

COMMANDS = {"status": ["status", "bench-model", "--json"],
            "rollback": ["rollback", "bench-model", "--json"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=4, help="runs of each command each way")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-cli-start-")) / ".modelship"
    home.mkdir(parents=True)
    began = time.monotonic()
    times: dict[str, dict[str, list[float]]] = {c: {"console": [], "zygote": []}
                                                for c in COMMANDS}
    mismatches: list[dict[str, Any]] = []
    with cli_zygote(cli_env(home), ROOT) as zygote:
        ready = zygote.wait_ready()
        ready_s = time.monotonic() - began
        for _ in range(args.runs):
            for name, argv in COMMANDS.items():
                t = time.monotonic()
                plain = run_cli(*argv, home=home, timeout=300)
                times[name]["console"].append(time.monotonic() - t)
                t = time.monotonic()
                forked = zygote.run(["modelship", *argv], timeout=300)
                times[name]["zygote"].append(time.monotonic() - t)
                if (plain.returncode, plain.stdout) != (forked.returncode, forked.stdout):
                    mismatches.append({"command": name, "console": plain.returncode,
                                       "zygote": forked.returncode})
    figures = {
        "runs": args.runs,
        "zygote_ready_s": round(ready_s, 2), "zygote_import_s": ready["import_s"],
        "zygote_modules": ready["modules"],
        "commands": {name: {way: {"median_s": round(statistics.median(v), 2),
                                  "min_s": round(min(v), 2), "max_s": round(max(v), 2)}
                            for way, v in ways.items()} for name, ways in times.items()},
        "same_exit_and_stdout": not mismatches, "mismatches": mismatches,
    }
    path = write_results("cli_start", figures)
    rows = [[name, f"{w['console']['median_s']:.2f}", f"{w['zygote']['median_s']:.2f}",
             f"×{w['console']['median_s'] / max(w['zygote']['median_s'], 1e-3):.0f}"]
            for name, w in figures["commands"].items()]
    print_table(f"CLI start per run, median of {args.runs} (zygote: {ready['import_s']} s of "
                f"imports once, {ready['modules']} modules); same exit and stdout: "
                f"{not mismatches}", ["command", "console script s", "zygote s", "ratio"], rows)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
