"""Wall time of one release, stage by stage: ``modelship promote`` end to end.

Run: ``.venv/bin/python -m bench.e2e [--runs N] [--canary-s S] [--bake-s S] [--name NAME]
[--compare bench/results/e2e-before.json]``. Starts a
fresh embedded stack (2 replicas + canary) in a temporary home, registers a small sklearn
model twice, releases v1 (the first release) and then v2 against it with a canary of at most
``--canary-s`` seconds of load and a bake of ``--bake-s`` seconds, through the console
script as a release manager would. Per stage, the seconds come from the release record
(each stage's start and end); the whole is the console script's wall time, Python and
Prefect start-up included.

**Overhead** is everything but the canary's load window and the bake's watch: the time the
pipeline itself costs. Goal (issues 8 and 19): ≤ 30 s of overhead. The canary's load
window is the wall time its load ran, warm-up and the stability round's discarded windows
included (``canary_load_s``: from its ``warming up`` progress event to its last ``canary
round`` event, timestamps on stderr); the bake's watch is its windows plus the pre-swap
baseline window it compares with (``bake_watch_s``). Until session 21 both counted only
the kept measurement windows, so a stability round that settled on windows 2-4 of a 20 s
round put its first 5 s of load into the overhead; that figure stays as
``overhead_windows_s`` (with ``canary_measured_s`` and ``bake_windows_s``).
``canary_phases_s`` splits the canary stage by its progress events: ``before_load`` (the
canary slot, the inputs), ``load`` (Triton loading the versions), ``load_window``,
``after_load`` (unloading, the judgement, the report) and ``after_report`` (the slot's
release). Where the rest goes:
``start_s`` (the console script's launch to the record's start: Python, imports, the
Prefect flow run), the check's own stages, ``between_stages_s`` (inside the record but in
no stage: the journal's first writes, the recovery check, the candidate, the release lock,
the end of the release), and ``end_s`` (the record's end to the process's exit: the flow
run's end, Prefect's senders). ``outside_stages_s`` is all three together. ``cpu_s`` is the
CPU (user + system) of the promote process and the processes it waited for: the load
window's load generator included, but less sensitive than wall time to what else runs on
the machine. The tree is
byte-compiled first, as ``make install`` does (:func:`compile_tree`). ``--tree DIR`` runs
the promotes on another checkout's code (its packages first on ``PYTHONPATH``, this
driver's stack and models), so an older commit is measured by the same arithmetic.
Figures go to ``bench/results/NAME.json`` (``e2e``); ``--compare`` prints each figure next
to an earlier run's, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.results import print_table, write_results
from modelship.settings import Settings, load_settings
from modelship.stack import manager
from tests import models

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-e2e"
STAGES = ["resolve", "check", "stage", "canary", "gates", "approve", "baseline", "swap",
          "bake", "record"]
#: The project's packages, byte-compiled before a run as ``make install`` does.
PACKAGES = ["modelship", "tasks", "flows", "model_registry"]


def compile_tree(root: Path = ROOT) -> None:
    """Byte-compile the project's packages, as ``make install`` does: on a machine with
    PYTHONDONTWRITEBYTECODE set, every process would otherwise compile them from source."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *PACKAGES],
                   cwd=root, capture_output=True, check=False, timeout=300)


def _policy(path: Path, canary_s: float, bake_s: float) -> Path:
    """A canary of at most ``canary_s`` s of load (it stops sooner once the gates have their
    samples and the windows are stable), and a bake of ``bake_s`` s."""
    return models.write_policy(path, {
        "canary": {"warmup_s": 1.0, "window_s": 5.0, "max_duration_s": canary_s,
                   "min_samples": 300},
        "gates": [
            {"name": "latency_p99", "metric": "latency_p99_ms", "test": "quantile",
             "max_increase_pct": 50.0, "min_effect_ms": 2.0},
            {"name": "error_rate", "metric": "error_rate", "test": "exact_rate",
             "max_rate": 0.01},
            {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.9},
        ],
        "bake": {"duration_s": bake_s, "window_s": min(5.0, bake_s), "baseline_s": 2.0,
                 "max_latency_increase_pct": 400.0},
    })


def _seconds(start: str | None, end: str | None) -> float:
    if not start or not end:
        return 0.0
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def promote(home: Path, version: int, policy: Path, tree: Path = ROOT
            ) -> tuple[float, dict[str, Any]]:
    """One ``modelship promote`` through the console script: wall seconds and its record."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELSHIP_", "AWS_"))}
    env["MODELSHIP_HOME"] = str(home)
    if tree != ROOT:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    launched = datetime.now(UTC).isoformat()
    began, children = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([str(ROOT / ".venv/bin/modelship"), "promote", MODEL, "--version",
                           str(version), "--policy", str(policy), "--json"],
                          capture_output=True, text=True, env=env, cwd=tree, timeout=900)
    wall = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"promote v{version} exited {done.returncode}:\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout)
    record["_launched_at"], record["_exited_at"] = launched, datetime.now(UTC).isoformat()
    record["_stderr_tail"] = done.stderr.splitlines()[-5:]
    record["_cpu_s"] = cpu
    record["_canary_events"] = canary_events(done.stderr)
    return wall, record


#: The canary's progress events the phases are cut at (first or last line matching).
_EVENTS = {"loading": (" - loading ", False), "warming": (" - warming up for ", False),
           "measuring": (" - measuring until ", False), "last_round": (" - canary round ", True),
           "verdict": (" - canary of ", True)}
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d(?:\.\d+)?) \| ")


def canary_events(stderr: str) -> dict[str, float]:
    """Seconds of the day (the log's clock) of the canary task's progress events (pure)."""
    found: dict[str, float] = {}
    for line in stderr.splitlines():
        stamp = _STAMP.match(line)
        if stamp is None or "Task run 'canary " not in line:
            continue
        at = int(stamp[1]) * 3600 + int(stamp[2]) * 60 + float(stamp[3])
        for name, (marker, last) in _EVENTS.items():
            if marker in line and (last or name not in found):
                found[name] = at
    return found


def _of_day(iso: str | None) -> float | None:
    if not iso:
        return None
    at = datetime.fromisoformat(iso)
    return at.hour * 3600 + at.minute * 60 + at.second + at.microsecond / 1e6


def canary_phases(record: dict[str, Any]) -> dict[str, float]:
    """The canary stage cut at its progress events (pure); {} when they are missing."""
    stage = next((s for s in record.get("stages", []) if s["name"] == "canary"), None)
    events = record.get("_canary_events") or {}
    start = _of_day(stage["started_at"]) if stage else None
    end = _of_day(stage["ended_at"]) if stage else None
    loading, verdict, last = events.get("loading"), events.get("verdict"), events.get(
        "last_round")
    window_from = events.get("warming", events.get("measuring"))
    if None in (start, end, loading, window_from, last, verdict):
        return {}
    marks = [start, loading, window_from, last, verdict, end]
    # the log's clock has no date: a canary across midnight comes out one day short
    marks = [m + 86400 if m is not None and start is not None and m < start - 3600 else m
             for m in marks]
    names = ["before_load", "load", "load_window", "after_load", "after_report"]
    return {name: round(float(b) - float(a), 2)  # type: ignore[arg-type]
            for name, a, b in zip(names, marks, marks[1:], strict=False)}


def breakdown(wall: float, record: dict[str, Any]) -> dict[str, Any]:
    """Per stage seconds, the measured windows, and the overhead around them."""
    stages = {s["name"]: round(_seconds(s["started_at"], s["ended_at"]), 2)
              for s in record["stages"]}
    rounds = ((record.get("gates") or {}).get("load") or {}).get("rounds") or []
    canary_measured = sum(float(r.get("duration_s") or 0) for r in rounds)
    phases = canary_phases(record)
    canary_load = phases.get("load_window", canary_measured)
    bake = record.get("bake") or {}
    bake_windows = sum(float(w.get("seconds") or 0) for w in bake.get("windows") or [])
    bake_watch = bake_windows + float((bake.get("baseline") or {}).get("seconds") or 0)
    in_stages = sum(stages.values())
    start = _seconds(record.get("_launched_at"), record.get("started_at"))
    end = _seconds(record.get("finished_at"), record.get("_exited_at"))
    check = next((s for s in record["stages"] if s["name"] == "check"), None) or {}
    check_stages = {c["stage"]: round(float(c.get("seconds") or 0), 2)
                    for c in (check.get("details") or {}).get("stages") or []}
    return {"wall_s": round(wall, 2), "cpu_s": round(float(record.get("_cpu_s") or 0.0), 2),
            "stages_s": stages, "check_stages_s": check_stages,
            "start_s": round(start, 2), "end_s": round(end, 2),
            "between_stages_s": round(wall - in_stages - start - end, 2),
            "stderr_tail": record.get("_stderr_tail", []),
            "canary_phases_s": phases,
            "canary_load_s": round(canary_load, 2), "bake_watch_s": round(bake_watch, 2),
            "canary_measured_s": round(canary_measured, 2),
            "bake_windows_s": round(bake_windows, 2),
            "outside_stages_s": round(wall - in_stages, 2),
            "overhead_s": round(wall - canary_load - bake_watch, 2),
            "overhead_windows_s": round(wall - canary_measured - bake_windows, 2)}


def run_once(canary_s: float, bake_s: float, tree: Path = ROOT) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ms-bench-e2e-") as tmp:
        home = Path(tmp) / ".modelship"
        settings = Settings(home=home, triton_runtime=ROOT / ".venv-triton")
        try:
            manager.up(settings, replicas=2)
            live = load_settings(home=home, triton_runtime=ROOT / ".venv-triton")
            uri = str(live.mlflow_tracking_uri)
            v1 = models.register_sklearn(uri, MODEL, seed=0)
            v2 = models.register_sklearn(uri, MODEL, seed=0)
            policy = _policy(Path(tmp) / "policy.yaml", canary_s, bake_s)
            first = breakdown(*promote(home, v1, policy, tree))
            second = breakdown(*promote(home, v2, policy, tree))
        finally:
            manager.down(settings)
    return {"first_release": first, "release": second}


CHECK_STAGES = ["preflight", "resolve", "golden", "input_checks", "export", "validate",
                "output_checks", "trial_load"]
TOTALS = ["start_s", "between_stages_s", "end_s", "outside_stages_s", "canary_load_s",
          "bake_watch_s", "overhead_s", "canary_measured_s", "bake_windows_s",
          "overhead_windows_s", "wall_s", "cpu_s"]
CANARY_PHASES = ["before_load", "load", "load_window", "after_load", "after_report"]


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of release, the median of every figure over the runs."""

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    def figure(release: dict[str, Any], key: str) -> float:
        if key == "between_stages_s" and key not in release:  # a file from before it was kept
            return float(release.get("outside_stages_s", 0.0) - release.get("start_s", 0.0)
                         - release.get("end_s", 0.0))
        if key not in release and key in _BEFORE_SESSION_21:  # then measured windows only
            return float(release.get(_BEFORE_SESSION_21[key], 0.0))
        return float(release.get(key, 0.0))

    return {kind: {**{key: median([figure(r[kind], key) for r in runs]) for key in TOTALS},
                   "stages_s": {s: median([r[kind]["stages_s"].get(s, 0.0) for r in runs])
                                for s in STAGES},
                   "check_stages_s": {s: median([r[kind].get("check_stages_s", {}).get(s, 0.0)
                                                 for r in runs]) for s in CHECK_STAGES},
                   "canary_phases_s": {s: median([r[kind].get("canary_phases_s", {}).get(s, 0.0)
                                                  for r in runs]) for s in CANARY_PHASES}}
            for kind in ("first_release", "release")}


#: A file from before session 21 counted the measured windows only, under the plain names.
_BEFORE_SESSION_21 = {"canary_measured_s": "canary_load_s", "bake_windows_s": "bake_watch_s",
                      "overhead_windows_s": "overhead_s"}


def rows_of(table: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """(figure, {kind: seconds}) in print order: stages, check's stages, totals."""
    kinds = ("first_release", "release")
    return ([(s, {k: table[k]["stages_s"][s] for k in kinds}) for s in STAGES]
            + [(f"check.{s}", {k: table[k]["check_stages_s"].get(s, 0.0) for k in kinds})
               for s in CHECK_STAGES]
            + [(f"canary.{s}", {k: table[k].get("canary_phases_s", {}).get(s, 0.0)
                                for k in kinds}) for s in CANARY_PHASES]
            + [(t, {k: table[k].get(t, 0.0) for k in kinds}) for t in TOTALS])


def _describe(tree: Path) -> str:
    """The measured checkout: its commit when it is a git work tree, else its path."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return f"{tree} ({head.stdout.strip()})" if head.returncode == 0 else str(tree)


def _ratio(after: float, before: float) -> str:
    return f"{after / before:.2f}" if before else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=1)
    # 40 s: the gates' sample plans (quantile p99 with a block design effect) need ~8,400
    # requests per version, about 18 s of this canary's load; a 15 s ceiling is
    # inconclusive. The canary stops once the gates have their samples, and its load
    # window is not overhead.
    parser.add_argument("--canary-s", type=float, default=40.0)
    parser.add_argument("--bake-s", type=float, default=10.0)
    parser.add_argument("--name", default="e2e", help="results file: bench/results/NAME.json")
    parser.add_argument("--compare", type=Path, help="an earlier results file to compare with")
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose code the promotes run (default: this one)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    compile_tree(tree)
    runs = [run_once(args.canary_s, args.bake_s, tree) for _ in range(args.runs)]
    table = medians(runs)
    figures: dict[str, Any] = {"runs": runs, "canary_s": args.canary_s, "bake_s": args.bake_s,
                               "goal": {"total_s": 60, "overhead_s": 30}, "median": table,
                               "byte_compiled": PACKAGES, "tree": _describe(tree)}
    title = (f"promote, seconds (median of {args.runs}; canary {args.canary_s:g} s, bake "
             f"{args.bake_s:g} s)")
    if args.compare:
        before = medians(json.loads(args.compare.read_text())["runs"])
        figures["compared_with"] = {"file": str(args.compare), "median": before}
        old = dict(rows_of(before))
        print_table(f"{title}, before ({args.compare.name}) -> after, ratio after/before",
                    ["figure", "first: before", "after", "ratio", "v1->v2: before", "after",
                     "ratio"],
                    [(name, old[name]["first_release"], now["first_release"],
                      _ratio(now["first_release"], old[name]["first_release"]),
                      old[name]["release"], now["release"],
                      _ratio(now["release"], old[name]["release"]))
                     for name, now in rows_of(table)])
    else:
        print_table(title, ["figure", "first release", "v1 -> v2"],
                    [(name, v["first_release"], v["release"]) for name, v in rows_of(table)])
    path = write_results(args.name, figures)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
