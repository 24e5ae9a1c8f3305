"""The fleet swap at a scale this machine cannot hold: 10, 30 and 100 simulated replicas.

Run: ``.venv/bin/python -m bench.fleet_scale [--sizes 10,30,100] [--repeats 3]``.

The coordinator is the real one: :func:`tasks.fleet.swap_unlocked` (what ``modelship swap``
and ``promote`` call under the release lock) → :func:`tasks.swap.swap_fleet`, with clients
built from :class:`~modelship.settings.Settings` by :func:`modelship.clients.build_clients`.
It observes the fleet, verifies C's signed manifest and every staged byte in a private
SeaweedFS (``weed mini``, as ``bench.staging``), then pauses batching, switches, probes
each replica with C's golden rows (the outputs recorded at staging), resumes batching, and
pins production; or aborts back to P. Only the replicas are simulated:
:mod:`bench.fake_triton` runs N of them in one process (its own, so it does not share the
coordinator's GIL), each on its own gRPC and HTTP ports, with Triton's load semantics and
settable faults.

Scenarios, each on a fleet that serves P (v1) with its production config, swapping to C (v2):

- ``clean``: every replica loads in ``--load-s``.
- ``dead``: 3 replicas (spread over the fleet) die 50 ms into their switch load of C.
- ``slow``: 3 replicas take ``--slow-s`` (past the phase deadline) to load C.
- ``fail``: 3 replicas fail to load C (Triton's INVALID_ARGUMENT; P keeps serving).
- ``hung``: 3 replicas stop answering in the middle of their switch load of C, their
  connections left open (a replica cut off by the network): nothing but deadlines notices.

Figures per N and scenario (median over ``--repeats``, max kept too):

- ``swap_s``: wall time of the whole swap (observation and verification included).
- ``skew_ms``: first to last replica answering the golden probe as C, as the coordinator saw
  it (the report's timeline), and ``server_skew_ms``: first to last replica switching to C
  in the fake (server clock, ``time.monotonic()`` shared by both processes).
- ``dispatch_ms``: first to last switch load *received* by the fleet: how concurrent the
  fan-out is.
- ``abort_s``: from the start of the failing phase to the end of the abort (every replica
  asked back to P): the time the fleet is not known to be on one version.
- ``detect_s``: when the slowest faulty replica's failure was recorded, from the failing
  phase's start (a dead replica's within a second, a slow or hung one's at the deadline).
- ``cpu_ms_per_replica``: the coordinator's CPU time per replica and phase (thread start,
  gRPC load, readiness, the HTTP golden probe), in ms; Python runs these one at a time
  (the GIL), which is the N-dependent part of every figure below.
- ``on_p``: every live replica serves exactly P with P's production config (batching on),
  read from the fake, not from the report.

The stated bounds (checked in the table; constants from :mod:`tasks.swap`):

- skew ≤ dispatch spread + load-time spread (0 here) + one readiness poll
  (``POLL_INTERVAL_S``) + one probe round-trip + N × the coordinator's CPU per replica.
  The fan-out is concurrent (one thread per replica and phase), so no term is N × a load
  or N × a round-trip; the dispatch spread itself is about N × (thread start + one gRPC
  call's CPU).
- abort, dead or failing replicas: ≤ one load (the others' in-flight load) + one parallel
  revert round (one load) + probes + 2 × N × the CPU per replica: far below the deadline,
  and independent of N but for that CPU term.
- abort, slow replicas: the switch ends when their loads return or at deadline +
  ``JOIN_GRACE_S``; then one parallel revert round, where a slow replica's revert waits
  behind its own load of C (Triton loads one model one at a time).
- abort, hung replicas: ≤ 2 × (deadline + ``JOIN_GRACE_S``): the switch gives up at its
  deadline and the hung replicas' reverts give up at the abort phase's.

Figures go to ``bench/results/fleet_scale.json``; a short table goes to stdout. The fake
fleet and SeaweedFS are always stopped. Runtime: about 5 minutes with the defaults on 2 CPUs
(the 100-replica fake fleet starts in 0.4 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from pydantic import SecretStr

from bench.fake_triton import FakeFleet, fake_model_config, fake_outputs, iter_switches
from bench.results import print_table, write_results
from bench.staging import BUCKET, REPOSITORY_PREFIX, seaweed
from modelship.clients import build_clients
from modelship.errors import SwapAborted
from modelship.policy import Policy, StagingPolicy, SwapPolicy
from modelship.settings import Settings, TritonEndpoint
from modelship.signing import generate_key, key_bytes
from modelship.storage import S3Storage
from modelship.triton.infer import TritonInference
from modelship.triton.model_config import to_pbtxt
from tasks.fleet import swap_unlocked
from tasks.stage import golden_probe, stage_version
from tasks.swap import JOIN_GRACE_S, POLL_INTERVAL_S

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

MODEL = "fleet"
P, C = 1, 2
FEATURES = 4
SCENARIOS = ("clean", "dead", "fail", "slow", "hung")
FAULTY = 3
FIGURES = ("swap_s", "skew_ms", "server_skew_ms", "dispatch_ms", "abort_s", "detect_s",
           "cpu_ms_per_replica")


@dataclass(frozen=True)
class Bench:
    """One fake fleet with S3 and the settings the coordinator runs with."""

    fleet: FakeFleet
    settings: Settings
    policy: Policy


def stage_fake_versions(storage: S3Storage, workdir: Path, *, model: str, versions: Sequence[int],
                        signing_key: bytes, features: int = FEATURES) -> None:
    """Stage each fake version as ``modelship stage`` does: files, config, signed manifest,
    and the golden probe (C's outputs on 4 rows, computed by the fake model itself)."""
    feed = {"input": np.random.default_rng(11).standard_normal((4, features)).astype(np.float32)}
    tolerance = SimpleNamespace(atol=1e-5, rtol=1e-4)
    for version in versions:
        graph = workdir / f"{model}-{version}.onnx"
        graph.write_bytes(f"fake model {model} v{version}\n".encode())
        stage_version(storage, model=model, version=version, files={"model.onnx": graph},
                      config_pbtxt=to_pbtxt(fake_model_config(model, features=features,
                                                              versions=[version])),
                      provenance={"source": "bench.fleet_scale (fake model)"},
                      policy=StagingPolicy(), repository_prefix=REPOSITORY_PREFIX,
                      signing_key=signing_key,
                      probe=golden_probe(feed, fake_outputs(model, version, feed), tolerance))


def fleet_settings(fleet: FakeFleet, *, home: Path, s3_endpoint: str, access_key: str,
                   secret_key: str, signing_key: str, timeout_s: float = 5.0) -> Settings:
    """Settings naming the fake replicas as the static fleet (no MLflow, no Prefect)."""
    return Settings(home=home, s3_endpoint=s3_endpoint, bucket=BUCKET,
                    repository_prefix=REPOSITORY_PREFIX, aws_access_key_id=access_key,
                    aws_secret_access_key=SecretStr(secret_key),
                    manifest_signing_key=SecretStr(signing_key),
                    mlflow_tracking_uri=None, prefect_api_url=None,
                    triton_replicas=[TritonEndpoint(**e) for e in fleet.endpoints],
                    http_timeout_s=timeout_s, control_timeout_s=60.0)


def faulty_replicas(names: Sequence[str], count: int = FAULTY) -> list[str]:
    """``count`` replicas spread over the fleet (first, middle, last for 3)."""
    k = min(count, len(names))
    if k <= 0:
        return []
    step = (len(names) - 1) / max(1, k - 1)
    return sorted({names[round(i * step)] for i in range(k)})


def swap_once(bench: Bench, *, target: int = C) -> tuple[dict[str, Any], bool, float]:
    """One real swap: (its report, whether it aborted, its wall time in s)."""
    clients = build_clients(bench.settings)  # fresh channels: a revived replica is new
    began = time.monotonic()
    try:
        report = swap_unlocked(bench.settings, clients, bench.policy, model=MODEL,
                               target=target)
        aborted = False
    except SwapAborted as exc:
        report, aborted = dict(exc.details["report"]), True
    finally:
        clients.close()
    return report, aborted, time.monotonic() - began


def _process_cpu_s(pid: int | None) -> float:
    """User + system CPU time of a process, in s (0 when it cannot be read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(stat[11]) + int(stat[12])) / CLOCK_TICKS


def _spread_ms(times: Sequence[float]) -> float | None:
    return round((max(times) - min(times)) * 1000, 1) if times else None


def measure(bench: Bench, scenario: str, *, load_s: float, slow_s: float) -> dict[str, Any]:
    """One swap of ``scenario`` on a fleet reset to P; the figures of it."""
    fleet = bench.fleet
    fleet.reset(MODEL, P, load_s=load_s)
    faulty = faulty_replicas(fleet.names) if scenario != "clean" else []
    if scenario == "dead":
        fleet.set_faults(faulty, die_on_load=C, die_after_s=0.05)
    elif scenario == "slow":
        fleet.set_faults(faulty, slow_versions={str(C): slow_s})
    elif scenario == "fail":
        fleet.set_faults(faulty, fail_load=[C])
    elif scenario == "hung":
        fleet.set_faults(faulty, hang_on_load=C)
    fake_cpu = _process_cpu_s(fleet.pid)
    cpu = time.process_time()
    report, aborted, wall_s = swap_once(bench)
    cpu = time.process_time() - cpu
    fake_cpu = _process_cpu_s(fleet.pid) - fake_cpu
    calls = fleet.calls()
    state = fleet.state()
    want = C if scenario == "clean" else P

    def on(name: str, version: int) -> bool:
        replica = state[name]
        serving = replica["models"].get(MODEL, {})
        return bool(replica["alive"] and serving.get("versions") == [version]
                    and serving.get("dynamic_batching"))

    # the truth, read from the fake: the healthy replicas end on one version, batching on,
    # and every faulty replica that did not make it back to P is reported as such
    converged = all(on(name, want) for name in state if name not in faulty)
    final = report.get("final_states", {})
    stranded = [name for name in faulty if not on(name, P)]
    honest = all(not final.get(name, {}).get("ok", True) for name in stranded)
    first_loads: dict[str, float] = {}  # each replica's first load of C: the switch
    for call in calls:
        if call["call"] == "load" and call.get("versions") == [C]:
            first_loads.setdefault(call["replica"], float(call["t"]))
    switch_loads = list(first_loads.values())
    switches = [t for _, t in iter_switches(calls, MODEL, C)]
    phases = {p["name"]: p for p in report.get("phases", [])}
    abort_s = detect_s = None
    if aborted and "abort" in phases:
        failing = [p for p in report["phases"] if p["name"] != "abort"][-1]
        abort = phases["abort"]
        abort_s = round(abort["started_at"] + abort["seconds"] - failing["started_at"], 3)
        detect_s = max((failing["replicas"][name]["seconds"] for name in faulty
                        if name in failing["replicas"]), default=None)
    return {
        "scenario": scenario, "replicas": len(fleet.names), "faulty": faulty,
        "aborted": aborted, "wall_s": round(wall_s, 3), "swap_s": report.get("total_s"),
        "skew_ms": report.get("skew_ms"), "server_skew_ms": _spread_ms(switches),
        "dispatch_ms": _spread_ms(switch_loads), "abort_s": abort_s, "detect_s": detect_s,
        "converged": converged, "faulty_stranded": len(stranded), "honest": honest,
        "coordinator_cpu_s": round(cpu, 3), "fake_cpu_s": round(fake_cpu, 3),
        "cpu_ms_per_replica": round(cpu * 1000 / max(1, len(fleet.names) * len(phases)), 2),
        "phases": {name: round(p["seconds"], 3) for name, p in phases.items()},
        "reason": report.get("reason"),
    }


def _median(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def _max(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(max(values), 3) if values else None


def summarise(runs: Sequence[dict[str, Any]], limits: Limits) -> list[dict[str, Any]]:
    """Median (and max) of each figure per (N, scenario), and the cell's bound."""
    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["replicas"], run["scenario"]), []).append(run)
    out = []
    for (n, scenario), rows in sorted(cells.items(), key=lambda kv: (kv[0][0],
                                                                      SCENARIOS.index(kv[0][1]))):
        out.append({"replicas": n, "scenario": scenario, "runs": len(rows),
                    "aborted": sum(r["aborted"] for r in rows),
                    "converged": sum(r["converged"] for r in rows),
                    "honest": sum(r["honest"] for r in rows),
                    "faulty_stranded_max": max(r["faulty_stranded"] for r in rows),
                    **{f"{k}_median": _median(rows, k) for k in FIGURES},
                    **{f"{k}_max": _max(rows, k) for k in FIGURES}})
        cell = out[-1]
        figure, value, formula = bound(scenario, n, limits,
                                       dispatch_ms=cell["dispatch_ms_max"] or 0.0,
                                       cpu_ms=cell["cpu_ms_per_replica_max"] or 0.0)
        worst = cell[f"{figure}_max"]
        cell["bound"] = {"figure": figure, "value": value, "formula": formula,
                         "held": worst is not None and worst <= value}
    return out


PROBE_MARGIN_S = 1.0  # readiness polls and probes of two phases, on a busy 2-core machine


@dataclass(frozen=True)
class Limits:
    """What a swap's timing depends on, besides N."""

    load_s: float
    slow_s: float
    deadline_s: float
    probe_rtt_ms: float


def bound(scenario: str, n: int, limits: Limits, *, dispatch_ms: float, cpu_ms: float
          ) -> tuple[str, float, str]:
    """The stated bound of a cell (pure): (figure it bounds, value, formula).

    ``dispatch_ms`` is the measured spread of the switch loads' arrival and ``cpu_ms`` the
    coordinator's measured CPU per replica and phase: the two N-dependent inputs.
    """
    serial_s = n * cpu_ms / 1000  # one phase's per-replica work, run one at a time (GIL)
    if scenario == "clean":
        value = dispatch_ms + POLL_INTERVAL_S * 1000 + limits.probe_rtt_ms + serial_s * 1000
        return ("skew_ms", round(value, 1),
                "dispatch + readiness poll + probe RTT + N x CPU per replica")
    if scenario in ("dead", "fail"):
        return ("abort_s", round(2 * limits.load_s + PROBE_MARGIN_S + 2 * serial_s, 3),
                "in-flight load + revert load + probes + 2 x N x CPU per replica")
    grace = limits.deadline_s + JOIN_GRACE_S
    if scenario == "slow":
        gives_up = min(limits.slow_s, grace)
        ends = max(gives_up + limits.load_s, min(limits.slow_s + limits.load_s, gives_up + grace))
        return ("abort_s", round(ends + PROBE_MARGIN_S + 2 * serial_s, 3),
                "min(slow load, deadline + grace) + revert queued behind the slow load "
                "+ probes + 2 x N x CPU per replica")
    return ("abort_s", round(2 * grace + PROBE_MARGIN_S, 3),
            "2 x (deadline + grace): both phases give up on the hung replicas")


@contextmanager
def fake_bench(n: int, *, storage_env: SimpleNamespace, workdir: Path, load_s: float,
               deadline_s: float, probe_timeout_s: float) -> Iterator[Bench]:
    """A fake fleet of ``n`` replicas and the settings and policy the swap runs with."""
    with FakeFleet(n, models=[MODEL], versions=(P, C), features=FEATURES,
                   load_s=load_s) as fleet:
        settings = fleet_settings(fleet, home=workdir / f"home-{n}",
                                  s3_endpoint=storage_env.endpoint,
                                  access_key=storage_env.access_key,
                                  secret_key=storage_env.secret_key,
                                  signing_key=storage_env.signing_key)
        policy = Policy(swap=SwapPolicy(deadline_s=deadline_s, probe_timeout_s=probe_timeout_s))
        yield Bench(fleet, settings, policy)


def run(sizes: Sequence[int], *, repeats: int, load_s: float, slow_s: float,
        deadline_s: float, scenarios: Sequence[str] = SCENARIOS,
        progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every scenario ``repeats`` times at every size; the figures."""
    signing_key = generate_key()
    runs: list[dict[str, Any]] = []
    startups: dict[str, float] = {}
    probe_rtts: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as tmp:
        workdir = Path(tmp)
        with seaweed(workdir / "seaweedfs") as server:
            storage = server.storage(StagingPolicy())
            stage_fake_versions(storage, workdir, model=MODEL, versions=(P, C),
                                signing_key=key_bytes(signing_key))
            env = SimpleNamespace(endpoint=server.endpoint, access_key=server.access_key,
                                  secret_key=server.secret_key, signing_key=signing_key)
            for n in sizes:
                with fake_bench(n, storage_env=env, workdir=workdir, load_s=load_s,
                                deadline_s=deadline_s, probe_timeout_s=2.0) as bench:
                    startups[str(n)] = bench.fleet.startup_s
                    probe_rtts.append(_probe_rtt_ms(bench.fleet))
                    for round_ in range(repeats):
                        for scenario in scenarios:
                            row = measure(bench, scenario, load_s=load_s, slow_s=slow_s)
                            row["round"] = round_
                            runs.append(row)
                            progress(f"N={n} {scenario} #{round_ + 1}: swap {row['swap_s']} s, "
                                     f"skew {row['skew_ms']} ms (server "
                                     f"{row['server_skew_ms']} ms, dispatch "
                                     f"{row['dispatch_ms']} ms), abort {row['abort_s']} s, "
                                     f"converged {row['converged']}")
    probe_rtt = round(statistics.median(probe_rtts), 2) if probe_rtts else 0.0
    limits = Limits(load_s, slow_s, deadline_s, probe_rtt)
    return {
        "setup": {"load_s": load_s, "slow_s": slow_s, "deadline_s": deadline_s,
                  "faulty_replicas": FAULTY, "repeats": repeats, "pause_batching": True,
                  "fake_fleet": "one process, one grpc.aio server per replica, one aiohttp "
                                "app on every replica's HTTP port",
                  "fleet_startup_s": startups, "probe_rtt_ms": probe_rtt},
        "summary": summarise(runs, limits),
        "runs": runs,
    }


def _probe_rtt_ms(fleet: FakeFleet) -> float:
    """Median of 20 golden-probe-sized requests to one idle replica, in ms."""
    fleet.reset(MODEL, P)
    inference = TritonInference(fleet.endpoints[0]["http"], timeout_s=5.0)
    feed = {"input": np.zeros((4, FEATURES), dtype=np.float32)}
    times = []
    try:
        for _ in range(20):
            began = time.monotonic()
            inference.infer(MODEL, feed, outputs=["label", "probabilities"])
            times.append((time.monotonic() - began) * 1000)
    finally:
        inference.close()
    return statistics.median(times)


def print_summary(figures: dict[str, Any]) -> None:
    rows = []
    for cell in figures["summary"]:
        limit = cell["bound"]
        rows.append([
            cell["replicas"], cell["scenario"], f"{cell['converged']}/{cell['runs']}",
            f"{cell['faulty_stranded_max']}, {cell['honest']}/{cell['runs']}",
            cell["swap_s_median"], cell["skew_ms_median"] if cell["scenario"] == "clean" else "",
            cell["server_skew_ms_median"] if cell["scenario"] == "clean" else "",
            cell["dispatch_ms_median"], cell["detect_s_median"] or "",
            cell["abort_s_median"] or "", cell["abort_s_max"] or "",
            cell["cpu_ms_per_replica_median"],
            f"{limit['figure']} <= {limit['value']}: {'held' if limit['held'] else 'BROKEN'}"])
    print_table("fleet swap against the fake fleet (medians; the bound is checked on the max)",
                ["N", "scenario", "converged", "stranded, reported", "swap s", "skew ms",
                 "server skew ms", "dispatch ms", "detect s", "abort s", "abort max s",
                 "cpu ms/replica", "bound"], rows)
    setup = figures["setup"]
    print(f"\nload {setup['load_s']} s, slow load {setup['slow_s']} s, deadline "
          f"{setup['deadline_s']} s (+{JOIN_GRACE_S:g} s grace), {setup['faulty_replicas']} "
          f"faulty replicas, probe RTT {setup['probe_rtt_ms']} ms.\nconverged: every healthy "
          "replica ends on one version (C, or P after an abort) with batching on, read from "
          "the fake; stranded: faulty replicas not back on P with batching on (dead, or "
          "hung with batching paused); reported: runs where the swap's report said so for "
          "each of them")
    for scenario in SCENARIOS:
        cell = next((c for c in figures["summary"] if c["scenario"] == scenario), None)
        if cell is not None:
            print(f"bound, {scenario}: {cell['bound']['figure']} <= "
                  f"{cell['bound']['formula']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,30,100",
                        help="fleet sizes, comma-separated (default 10,30,100)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load-s", type=float, default=0.5,
                        help="build time of one load on a healthy replica, in s")
    parser.add_argument("--slow-s", type=float, default=8.0,
                        help="build time of C on a slow replica, in s (past the deadline)")
    parser.add_argument("--deadline-s", type=float, default=4.0,
                        help="the swap policy's per-phase deadline, in s")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    figures = run([int(n) for n in args.sizes.split(",")], repeats=args.repeats,
                  load_s=args.load_s, slow_s=args.slow_s, deadline_s=args.deadline_s,
                  scenarios=[s for s in args.scenarios.split(",") if s])
    path = write_results("fleet_scale", figures)
    print_summary(figures)
    print(f"\nfigures: {path}")


if __name__ == "__main__":
    main()
