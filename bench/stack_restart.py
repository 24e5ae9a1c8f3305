"""What the Prefect UI costs at ``stack up``, and how long ``up`` takes after ``down``.

Run: ``.venv/bin/python -m bench.stack_restart [--runs N]``. Each run makes a fresh home
(1 replica) and does ``up`` (Prefect UI on or off, alternating, so a busy machine weighs
on both arms alike), then ``down`` and ``up`` again in the same home (the kept keys,
ports and data), then ``down``. Recorded: seconds until the whole stack and Prefect were
ready, and Prefect's resident memory (RSS, MB) once up. Figures go to
``bench/results/stack_restart.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.results import print_table, write_results
from modelship.settings import Settings
from modelship.stack import components, manager
from modelship.stack.process import group_members

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def _ui(enabled: bool) -> Iterator[None]:
    """The off arm: the stack's Prefect without its UI (as before issue 18)."""
    original = components.prefect_env

    def without_ui(*args: Any, **kwargs: Any) -> dict[str, str]:
        kwargs["port"] = None  # no port: PREFECT_UI_ENABLED=false
        return original(*args, **kwargs)

    if not enabled:
        components.prefect_env = without_ui
    try:
        yield
    finally:
        components.prefect_env = original


def _rss_mb(state: dict[str, Any]) -> float:
    pid = next(p["pid"] for p in state["processes"] if p["name"] == "prefect")
    total = 0
    for member in group_members(pid) or [pid]:
        try:
            fields = Path(f"/proc/{member}/status").read_text().split("\n")
        except OSError:
            continue
        total += next((int(f.split()[1]) for f in fields if f.startswith("VmRSS:")), 0)
    return round(total / 1024, 1)


def run(ui: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ms-bench-") as tmp, _ui(ui):
        settings = Settings(home=Path(tmp) / ".modelship", triton_runtime=ROOT / ".venv-triton")
        figures: dict[str, float] = {}
        try:
            for label in ("first", "again"):
                state, report = manager.up(settings, replicas=1)
                figures[f"{label}_total_s"] = report.total_s
                figures[f"{label}_prefect_s"] = report.ready_s["prefect"]
                figures[f"{label}_prefect_rss_mb"] = _rss_mb(state)
                manager.down(settings)
        finally:
            manager.down(settings)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2, help="Runs per arm.")
    args = parser.parse_args()
    arms: dict[str, list[dict[str, float]]] = {"ui_off": [], "ui_on": []}
    for _ in range(args.runs):
        for name in arms:
            arms[name].append(run(name == "ui_on"))
    medians = {name: {key: round(statistics.median(r[key] for r in runs), 2)
                      for key in runs[0]} for name, runs in arms.items()}
    path = write_results("stack_restart", {"runs_per_arm": args.runs, "replicas": 1,
                                           "median": medians, "runs": arms})
    keys = list(medians["ui_on"])
    print_table("stack up (1 replica): medians, Prefect UI off vs on; `again` is up after "
                "down in the same home", ["figure", "ui_off", "ui_on"],
                [(k, medians["ui_off"][k], medians["ui_on"][k]) for k in keys])
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
