"""The fault matrix's cost per cell, before and after, from two runs' pytest output.

``python -m bench.crash_matrix BEFORE.log AFTER.log [--time-before F --time-after F]
[--out bench/results/crash_matrix.json]``: each log is the output of ``pytest -rA
--durations=0 tests/e2e/test_crash.py`` (a ``/usr/bin/time -v`` file beside it gives the
CPU seconds of the pytest processes and their children). Per cell: the worker seconds
pytest charged to its test (setup + call + teardown: the first cell of a worker carries
the module's setup, with the session stack's start when it is the worker's first stack
test). With the cells in lanes (after) a cell's call is the wait for its outcome, so the
cells' sum is the file's worker time, not the sum of the cells' own durations.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_DURATION = re.compile(
    r"^\s*([\d.]+)s (setup|call|teardown)\s+tests/e2e/test_crash\.py::\S+\[(\S+)\]\s*$")
_CELL = re.compile(r"^(?:lane \w+: )?cell (\S+): ([\d.]+) s \((.*)\)\s*$")
_TIME = re.compile(r"^\s*(User time|System time) \(seconds\): ([\d.]+)")
_WALL = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)")


def durations(text: str) -> dict[str, dict[str, float]]:
    """``{cell id: {"setup": s, "call": s, "teardown": s}}`` from ``--durations=0`` lines."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _DURATION.match(line)
        if match:
            seconds, phase, cell = float(match[1]), match[2], match[3]
            found.setdefault(cell, {})[phase] = seconds
    return found


def own_times(text: str) -> dict[str, dict[str, float]]:
    """``{cell id: {"own_s": s, "waited_s": s}}`` from the cells' own lines (``cell ID: N s
    (phase s, ...)``): a cell's duration from its start in its lane, and the part of it
    spent waiting for a turn on the stack (the lanes' phases named ``waiting ...``)."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _CELL.match(line)
        if match:
            waited = sum(float(part.rsplit(" ", 1)[1]) for part in match[3].split(", ")
                         if part.startswith("waiting"))
            found[match[1]] = {"own_s": float(match[2]), "waited_s": round(waited, 1)}
    return found


def cpu(text: str) -> dict[str, float]:
    """User and system CPU seconds and the wall seconds of a ``/usr/bin/time -v`` output."""
    doc: dict[str, float] = {}
    for line in text.splitlines():
        if match := _TIME.match(line):
            doc["user_s" if match[1] == "User time" else "sys_s"] = float(match[2])
        if match := _WALL.search(line):
            parts = [float(p) for p in match[1].split(":")]
            doc["wall_s"] = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    return doc


def summary(before: str, after: str, time_before: str = "", time_after: str = ""
            ) -> dict[str, Any]:
    """Both runs' per-cell worker seconds and totals (pure)."""
    runs = {"before": durations(before), "after": durations(after)}
    cells = sorted(set(runs["before"]) | set(runs["after"]))
    doc: dict[str, Any] = {"cells": {}, "totals": {}}
    own = {"before": own_times(before), "after": own_times(after)}
    for cell in cells:
        doc["cells"][cell] = {name: round(sum(run.get(cell, {}).values()), 1)
                              for name, run in runs.items()}
        for name in own:
            doc["cells"][cell][f"{name}_own"] = own[name].get(cell, {})
    for name, run in runs.items():
        doc["totals"][name] = {
            "worker_s": round(sum(sum(p.values()) for p in run.values()), 1),
            "cells": len(run)}
    for name, text in (("before", time_before), ("after", time_after)):
        doc["totals"][name].update(cpu(text))
    return doc


def table(doc: dict[str, Any]) -> str:
    def own(v: dict[str, float]) -> str:
        if not v:
            return "-"
        waited = f" (waited {v['waited_s']:.0f})" if v.get("waited_s") else ""
        return f"{v['own_s']:.1f}{waited}"

    rows = ["| cell | before: own s | after: own s (of it waiting for a turn) "
            "| before: worker s | after: worker s |", "|---|---|---|---|---|"]
    rows += [f"| {cell} | {own(v['before_own'])} | {own(v['after_own'])} "
             f"| {v['before']:.1f} | {v['after']:.1f} |" for cell, v in doc["cells"].items()]
    b, a = doc["totals"]["before"], doc["totals"]["after"]
    rows.append(f"| **file** | | | **{b['worker_s']:.0f}** | **{a['worker_s']:.0f}** |")
    if "user_s" in b and "user_s" in a:
        rows.append(f"| CPU of pytest + children (user+sys s) | | "
                    f"| {b['user_s'] + b['sys_s']:.0f} | {a['user_s'] + a['sys_s']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--time-before", type=Path)
    parser.add_argument("--time-after", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench/results/crash_matrix.json"))
    args = parser.parse_args()

    def read(path: Path | None) -> str:
        return path.read_text() if path else ""

    doc = summary(read(args.before), read(args.after), read(args.time_before),
                  read(args.time_after))
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))


if __name__ == "__main__":
    main()
