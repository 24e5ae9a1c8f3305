"""``modelship stack up`` and ``stack down``, wall and CPU, of two source trees side by side.

Run: ``.venv/bin/python -m bench.stack_up [--before DIR] [--after DIR] [--runs N]``. Each
tree's console script (``PYTHONPATH=DIR``, the servers inherit it) does, in a fresh home
(2 replicas), a first ``up`` (new databases, migrations), ``down``, an ``up`` again (the
kept data: what a restart costs) and ``down``; the trees alternate run by run, so a busy
machine weighs on both alike. Recorded: the wall seconds of each command, the CPU seconds
of the ``up`` command itself, and the CPU seconds each server's process group had used when
``up`` returned (user + system, its reaped children included). Figures go to
``bench/results/stack_up.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results import print_table, write_results
from modelship.stack.process import group_members

ROOT = Path(__file__).resolve().parent.parent
MODELSHIP = Path(sys.executable).parent / "modelship"
TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system, reaped children included) of a process group's members."""
    ticks = 0
    for pid in group_members(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += sum(int(f) for f in fields[11:15])
    return ticks / TICK


def _cli(tree: Path, home: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float,
                                                       float]:
    """The console script of ``tree``: its result, wall seconds and CPU seconds."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MODELSHIP_", "MLFLOW_", "AWS_", "PREFECT_API"))}
    env.update(PYTHONPATH=str(tree), MODELSHIP_HOME=str(home),
               MODELSHIP_TRITON_RUNTIME=str(ROOT / ".venv-triton"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run([str(MODELSHIP), *args], env=env, capture_output=True, text=True,
                          cwd=tree, timeout=900, check=False)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: modelship {' '.join(args)} exited {done.returncode}:\n"
                         f"{done.stderr[-3000:]}")
    return done, wall, cpu


def _up(tree: Path, home: Path) -> dict[str, Any]:
    done, wall, cpu = _cli(tree, home, "stack", "up", "--replicas", "2", "--json")
    doc = json.loads(done.stdout)
    state = json.loads((home / "stack.json").read_text())
    servers = {p["name"]: round(group_cpu_s(int(p["pid"])), 2) for p in state["processes"]}
    return {"wall_s": round(wall, 2), "cli_cpu_s": round(cpu, 2),
            "servers_cpu_s": round(sum(servers.values()), 2), "server_cpu_s": servers,
            "ready_s": doc["startup"]["ready_s"], "total_s": doc["startup"]["total_s"]}


def _down(tree: Path, home: Path) -> float:
    _, wall, _ = _cli(tree, home, "stack", "down")
    return round(wall, 2)


def measure(tree: Path) -> dict[str, Any]:
    """A first ``up``, ``down``, ``up`` again on the kept data, ``down``."""
    with tempfile.TemporaryDirectory(prefix="ms-bench-up-") as tmp:
        home = Path(tmp) / ".modelship"
        first = _up(tree, home)
        first["down_s"] = _down(tree, home)
        again = _up(tree, home)
        again["down_s"] = _down(tree, home)
    return {"first": first, "restart": again}


def _median(runs: list[dict[str, Any]], kind: str, key: str) -> float:
    return round(statistics.median(float(r[kind][key]) for r in runs), 2)


def _server_median(runs: list[dict[str, Any]], kind: str, name: str) -> float:
    return round(statistics.median(float(r[kind]["server_cpu_s"].get(name, 0.0))
                                   for r in runs), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", type=Path, help="The tree before the change.")
    parser.add_argument("--after", type=Path, default=ROOT, help="The tree after it.")
    parser.add_argument("--runs", type=int, default=1, help="Runs per tree.")
    args = parser.parse_args()
    trees = {"before": args.before, "after": args.after} if args.before else {
        "after": args.after}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            runs[name].append(measure(tree.resolve()))
    load = os.getloadavg()
    figures = {"runs_per_tree": args.runs, "trees": {k: str(v) for k, v in trees.items()},
               "load_avg_1m_at_end": round(load[0], 2), "runs": runs}
    write_results("stack_up", figures)
    rows = []
    for kind in ("first", "restart"):
        for key in ("wall_s", "cli_cpu_s", "servers_cpu_s", "down_s"):
            rows.append([f"{kind} {key}", *(_median(runs[n], kind, key) for n in trees)])
        names = sorted({s for n in trees for r in runs[n] for s in r[kind]["server_cpu_s"]})
        for server in names:
            rows.append([f"{kind}   cpu {server}",
                         *(_server_median(runs[n], kind, server) for n in trees)])
    print_table(f"stack up / down: median of {args.runs} run(s), seconds "
                f"(load {load[0]:.1f} at the end)", ["", *trees], rows)


if __name__ == "__main__":
    main()
