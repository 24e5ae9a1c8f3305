"""Write benchmark figures to ``bench/results/NAME.json`` and print a short table; the
Wilson interval the simulation benches report rates with."""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelship.output import table

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_results(name: str, figures: dict[str, Any]) -> Path:
    """Save ``figures`` with the machine and time they were measured on."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    document = {
        "benchmark": name,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        **figures,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print(f"\n{title}\n{table(headers, rows)}")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a rate k/n (NaN without trials)."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def rate_cell(k: int, n: int) -> str:
    """``k / n`` with its 95% Wilson interval, for a table cell: ``12.0% [7.0%, 19.8%]``."""
    lo, hi = wilson(k, n)
    return f"{k / n:.1%} [{lo:.1%}, {hi:.1%}]"


