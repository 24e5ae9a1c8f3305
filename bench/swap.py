"""The fleet swap under load: plain reload against pause-batching, plus injected faults.

Run: ``.venv/bin/python -m bench.swap [--replicas 3] [--rounds 3]``. It starts the embedded
stack (``modelship.stack.manager.up``) in a temporary home, registers, checks and stages two
versions of a small sklearn model, first-deploys P on every replica, then:

1. **Swaps under load.** For each protocol (``plain reload`` = ``pause_batching: false``,
   ``pause-batching`` = the default), ``--rounds`` swaps each, alternating P->C and C->P and
   interleaving the protocols (ABBA), so both run side by side in one run on one stack.
   An async gRPC load generator (:func:`modelship.loadgen.run_load`, 32 clients, unversioned
   requests round-robin over every replica, the version read from each answer) starts
   ``PRE_S`` before the swap, runs through it and ``POST_S`` after. From the request log:
   requests, failed, stale answers (an answer from the old version by a replica to a request
   sent after that replica's first answer as the new one), each replica's switch time
   (its first answer as the new version, from the swap start), the skew (first to last
   replica), the time to 100% new (the last replica's switch), and latency before the swap
   (p99, max) against during it (p99, max). Medians over rounds are reported.
2. **Where the pause-batching time goes.** Every replica is wrapped so that each gRPC load
   call is timed; each phase's wall time is split into the slowest load call and the rest
   (readiness polls, the probe, thread joins).
3. **Faults, each under load, with the default protocol** (the replica-kill one last, since
   the killed replica is not restarted):
   - ``simulated load failure``: the swap's ``fault`` hook raises for one replica at
     ``switch`` (no server is harmed: it stands for a load that failed there);
   - ``real load failure``: one replica's switch really fails in Triton. The hook holds
     that replica until the others report C ready, then overwrites C's ``model.onnx`` in
     S3 with garbage, so that replica's reload downloads a corrupt graph and Triton refuses
     it, while the others already serve C. The original object (bytes and metadata) is put
     back before the abort phase and, whatever happens, at the end;
   - ``replica killed``: the hook arms a timer at one replica's ``switch`` that SIGKILLs
     its ``tritonserver`` (PID from ``stack.json``) while the load call is in flight.
   Each reports whether every surviving replica ends on P (``fleet_status``) and the time
   the abort took (``SwapAborted``'s report).

Figures go to ``bench/results/swap.json``. The stack is always stopped, and so are the
killed replica's leftovers (its Python backend stubs and their /dev/shm regions).
Runtime: about 2.5 minutes with 3 replicas and 3 rounds on 2 CPUs (stack start included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import print_table, write_results
from flows.check import run_check
from modelship.clients import Clients, build_clients
from modelship.errors import SwapAborted
from modelship.loadgen import LoadReport, LoadSpec, RequestRecord, percentiles_ms, run_load
from modelship.policy import Policy, SwapPolicy
from modelship.repository import read_verified, staged_config, version_prefix
from modelship.settings import Settings, load_settings
from modelship.signing import key_bytes
from modelship.stack import manager
from modelship.stack.process import group_members
from modelship.storage import S3Storage
from modelship.triton.client import TritonServer
from modelship.triton.model_config import example_request
from tasks.stage import stage_version
from tasks.swap import SwapOptions, SwapTarget, fleet_status, swap_fleet

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / ".venv-triton"
MODEL = "bench_swap"
CONCURRENCY = 32
PRE_S = 3.0  # load before the swap: the latency baseline
POST_S = 2.0  # load after the swap returned
WARMUP_S = 1.0  # first seconds of a load run, left out of the baseline (connections)
LOAD_TIMEOUT_S = 10.0  # per request
LOAD_MAX_S = 120.0  # hard bound of one load run, whatever happens
DEADLINE_S = 30.0  # per swap phase
KILL_DELAY_S = 0.4  # from the victim's switch call to its SIGKILL: the load is in flight
# name -> (swap.pause_batching, swap.pause_mode)
PROTOCOLS = {"plain reload": (False, "separate"), "pause-batching": (True, "separate"),
             "pause at switch": (True, "at_switch")}

GOALS = {
    "failed_requests": 0,
    "stale_answers": 0,
    "skew_ms_max": 250.0,
    "pause_over_plain_t100_max": 1.5,
    "max_during_over_pre_p99_max": 2.0,
    "kill_c_max_s": 10.0,  # a SIGKILLed replica: survivors back on P within this (issue 10)
}


# --------------------------------------------------------------------------- timed replicas


@dataclass(frozen=True)
class LoadCall:
    """One gRPC load call as the swap made it; times in perf_counter seconds."""

    replica: str
    began: float
    ended: float
    ok: bool
    versions: tuple[int, ...]
    batching: bool


class TimedServer(TritonServer):
    """A replica whose load calls are timed, to split a phase into Triton's reload and the
    coordinator's own overhead (the swap sees an ordinary :class:`TritonServer`)."""

    def __init__(self, server: TritonServer, calls: list[LoadCall]) -> None:
        super().__init__(server.endpoint, timeout_s=server.timeout_s,
                         control_timeout_s=server.control_timeout_s)
        self.calls = calls
        # The fault injection (set by Rig.swap for one swap): called before each load with
        # the versions it serves; raising fails this replica's phase as a failed load would.
        self.before_load: Callable[[str, tuple[int, ...]], None] | None = None

    def load_model(self, name: str, *, config_json: str | None = None,
                   files: dict[str, bytes] | None = None) -> None:
        if self.before_load is not None:
            specific = (json.loads(config_json or "{}").get("version_policy") or {}) \
                .get("specific") or {}
            self.before_load(self.name, tuple(int(v) for v in specific.get("versions", [])))
        began = time.perf_counter()
        ok = False
        try:
            super().load_model(name, config_json=config_json, files=files)
            ok = True
        finally:
            config = json.loads(config_json) if config_json else {}
            versions = tuple(int(v) for v in config.get("version_policy", {})
                             .get("specific", {}).get("versions", []))
            self.calls.append(LoadCall(self.name, began, time.perf_counter(), ok, versions,
                                       "dynamic_batching" in config))


# --------------------------------------------------------------------------- background load


class BackgroundLoad:
    """:func:`run_load` in its own thread and event loop, so the (synchronous) swap runs in
    the main thread meanwhile. ``t0`` is the load's time origin in perf_counter seconds
    (taken just before the engine starts its clock, so within about a millisecond)."""

    def __init__(self, urls: Sequence[str], payload: dict[str, np.ndarray]) -> None:
        self.urls = list(urls)
        self.payload = payload
        self.t0 = 0.0
        self.report: LoadReport | None = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-load", daemon=True)

    def _run(self) -> None:
        spec = LoadSpec(protocol="grpc", concurrency=CONCURRENCY, duration_s=LOAD_MAX_S,
                        warmup_s=0.0, window_s=1.0, timeout_s=LOAD_TIMEOUT_S)

        async def main() -> LoadReport:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.t0 = time.perf_counter()
            self._started.set()
            return await run_load(self.urls, MODEL, self.payload, spec, stop=self._stop)

        try:
            self.report = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread in stop()
            self.error = exc
        finally:
            self._started.set()

    def start(self) -> None:
        self._thread.start()
        self._started.wait(timeout=10)

    def now(self) -> float:
        """Seconds on the load's clock (the records' ``start_s`` origin)."""
        return time.perf_counter() - self.t0

    def stop(self) -> LoadReport:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop ended on its own (LOAD_MAX_S)
                pass
        self._thread.join(timeout=LOAD_TIMEOUT_S * 2 + 10)
        if self._thread.is_alive():
            raise RuntimeError("the load generator did not stop")
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report


@contextmanager
def load_through(rig: Rig) -> Iterator[BackgroundLoad]:
    """Load every replica from ``PRE_S`` before the body until ``POST_S`` after it; the
    load is stopped even if the body fails."""
    load = BackgroundLoad([s.endpoint.grpc for s in rig.replicas], rig.payload)
    load.start()
    try:
        time.sleep(PRE_S)
        yield load
        time.sleep(POST_S)
    except BaseException:
        with suppress(Exception):  # the body's own error is the one to report
            load.stop()
        raise
    load.stop()


# --------------------------------------------------------------------------- analysis (pure)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def analyse(records: Sequence[RequestRecord], *, servers: Sequence[str], swap_start_s: float,
            swap_end_s: float, old: int, new: int) -> dict[str, Any]:
    """Acceptance figures of one swap from its request log (times on the load's clock).

    A replica's switch is the completion of its first answer as ``new``; a stale answer is
    one from ``old`` by that replica to a request sent after its switch.
    """
    per_server: dict[str, dict[str, Any]] = {}
    switches: list[float] = []
    stale_total = 0
    for index, name in enumerate(servers):
        mine = [r for r in records if r.server == index]
        first_new = min((r.end_s for r in mine if r.ok and r.model_version == str(new)),
                        default=None)
        last_old = max((r.end_s for r in mine if r.ok and r.model_version == str(old)),
                       default=None)
        last_new = max((r.end_s for r in mine if r.ok and r.model_version == str(new)),
                       default=None)
        stale = 0 if first_new is None else sum(
            1 for r in mine if r.ok and r.model_version == str(old) and r.start_s > first_new)
        stale_total += stale
        switch = None if first_new is None else first_new - swap_start_s
        if switch is not None:
            switches.append(switch)
        per_server[name] = {
            "requests": len(mine),
            "failed": sum(1 for r in mine if not r.ok),
            "stale": stale,
            "switch_s": None if switch is None else round(switch, 3),
            "last_old_answer_s": None if last_old is None else round(last_old - swap_start_s, 3),
            "last_new_answer_s": None if last_new is None else round(last_new - swap_start_s, 3),
        }
    everyone = len(switches) == len(servers)
    pre = [r.latency_ms for r in records
           if r.ok and WARMUP_S <= r.start_s < swap_start_s]
    during = [r.latency_ms for r in records if r.ok and swap_start_s <= r.start_s <= swap_end_s]
    pre_p99 = percentiles_ms(pre)["p99"]
    during_p99 = percentiles_ms(during)["p99"]
    pre_max = max(pre, default=None)
    during_max = max(during, default=None)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "requests": len(records),
        "failed": sum(1 for r in records if not r.ok),
        "stale": stale_total,
        "answers": {v: sum(1 for r in records if r.ok and r.model_version == v)
                    for v in (str(old), str(new))},
        "skew_ms": round((max(switches) - min(switches)) * 1000, 1) if everyone else None,
        "t100_s": round(max(switches), 3) if everyone else None,
        "swap_s": round(swap_end_s - swap_start_s, 3),
        "pre_p99_ms": _ms(pre_p99),
        "pre_max_ms": _ms(pre_max),
        "during_p99_ms": _ms(during_p99),
        "during_max_ms": _ms(during_max),
        "max_during_over_pre_p99": round(during_max / pre_p99, 2)
        if during_max is not None and pre_p99 else None,
        "per_replica": per_server,
        "error_texts": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:3]),
    }


def phase_breakdown(report: dict[str, Any], calls: Sequence[LoadCall],
                    swap_start: float) -> list[dict[str, Any]]:
    """Each phase's wall time, split into the slowest gRPC load call and the rest.

    The n-th load call on a replica belongs to the n-th phase that replica ran (phases run
    one after the other and each sends exactly one load per replica).
    """
    by_replica: dict[str, list[LoadCall]] = {}
    for call in sorted(calls, key=lambda c: c.began):
        by_replica.setdefault(call.replica, []).append(call)
    rows: list[dict[str, Any]] = [{
        "phase": "observe (preflight)",
        "started_at": 0.0,
        "seconds": round(report["phases"][0]["started_at"], 3) if report["phases"] else None,
    }]
    seen: dict[str, int] = {}
    for phase in report["phases"]:
        loads = []
        for name in phase["replicas"]:
            index = seen.get(name, 0)
            seen[name] = index + 1
            mine = by_replica.get(name, [])
            if index < len(mine):
                loads.append(mine[index])
        slowest = max((c.ended - c.began for c in loads), default=None)
        last_load_end = max((c.ended - swap_start for c in loads), default=None)
        rows.append({
            "phase": phase["name"],
            "started_at": phase["started_at"],
            "seconds": phase["seconds"],
            "load_call_max_s": None if slowest is None else round(slowest, 3),
            "load_call_mean_s": round(statistics.mean(c.ended - c.began for c in loads), 3)
            if loads else None,
            "after_last_load_s": None if last_load_end is None
            else round(phase["started_at"] + phase["seconds"] - last_load_end, 3),
            "replica_seconds": {n: r["seconds"] for n, r in phase["replicas"].items()},
        })
    if report["phases"]:
        last = report["phases"][-1]
        rows.append({"phase": "record (config.pbtxt)",
                     "started_at": round(last["started_at"] + last["seconds"], 3),
                     "seconds": round(report["total_s"] - last["started_at"] - last["seconds"],
                                      3)})
    return rows


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def summarize_protocol(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds (counts are summed as well, since one failure is one too many)."""
    keys = ("skew_ms", "report_skew_ms", "t100_s", "report_t100_s", "swap_s", "pre_p99_ms",
            "pre_max_ms", "during_p99_ms", "during_max_ms", "max_during_over_pre_p99")
    summary: dict[str, Any] = {k: _median([r["load"].get(k, r.get(k)) for r in rounds])
                               for k in keys}
    summary.update({
        "rounds": len(rounds),
        "requests_median": _median([r["load"]["requests"] for r in rounds]),
        "failed_total": sum(r["load"]["failed"] for r in rounds),
        "stale_total": sum(r["load"]["stale"] for r in rounds),
        "skew_ms_max": max((r["load"]["skew_ms"] for r in rounds
                            if r["load"]["skew_ms"] is not None), default=None),
        "max_during_over_pre_p99_max": max(
            (r["load"]["max_during_over_pre_p99"] for r in rounds
             if r["load"]["max_during_over_pre_p99"] is not None), default=None),
        "verify": [{"verify_s": r["verify_s"], "verified_bytes": r["verified_bytes"]}
                   for r in rounds if r.get("verify_s") is not None],
    })
    return summary


def judge(protocols: dict[str, dict[str, Any]], faults: dict[str, dict[str, Any]],
          verify_cost: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each goal of the issue with its measured value and whether it is met (None: no data,
    which is never a pass)."""
    plain, pause = protocols.get("plain reload", {}), protocols.get("pause-batching", {})

    def row(goal: str, target: str, value: Any, met: bool | None) -> dict[str, Any]:
        return {"goal": goal, "target": target, "measured": value, "met": met}

    failed = sum(p.get("failed_total", 0) for p in protocols.values())
    stale = sum(p.get("stale_total", 0) for p in protocols.values())
    skews = [p.get("skew_ms_max") for p in protocols.values()]
    skew = None if any(s is None for s in skews) or not skews else max(s for s in skews if s)
    ratio = (pause["t100_s"] / plain["t100_s"]
             if pause.get("t100_s") and plain.get("t100_s") else None)
    at_switch = protocols.get("pause at switch", {})
    ratio_at_switch = (at_switch["t100_s"] / plain["t100_s"]
                       if at_switch.get("t100_s") and plain.get("t100_s") else None)
    lat = [p.get("max_during_over_pre_p99_max") for p in protocols.values()]
    lat_max = None if any(v is None for v in lat) or not lat else max(v for v in lat if v)
    aborts = [f.get("survivors_on_p") for f in faults.values()]
    kill = faults.get("replica killed", {})
    served_c = kill.get("survivors_served_c_s")
    verify = [r for p in protocols.values() for r in p.get("verify", [])]
    verify_s = statistics.median(v["verify_s"] for v in verify) if verify else None
    verify_bytes = verify[0]["verified_bytes"] if verify else None
    return [
        row("kill: time survivors served C before the abort", f"<= {GOALS['kill_c_max_s']} s",
            served_c, None if served_c is None else served_c <= GOALS["kill_c_max_s"]),
        row("kill: abort total (observation to every survivor on P)",
            f"<= {GOALS['kill_c_max_s']} s", kill.get("abort_total_s"),
            None if kill.get("abort_total_s") is None
            else kill["abort_total_s"] <= GOALS["kill_c_max_s"]),
        row("preflight: signature + streamed sha256 of C (median s, bytes)", "reported",
            None if verify_s is None else f"{verify_s:.3f} s for {verify_bytes} bytes",
            None if verify_s is None else True),
        row(f"preflight verification of a {VERIFY_MB} MB version (best of 3)", "reported",
            None if not verify_cost else
            f"{verify_cost['best_s']} s ({verify_cost['mb_per_s']} MB/s)",
            None if not verify_cost else True),
        row("failed requests (swaps)", "0", failed, failed == 0 if protocols else None),
        row("stale answers (swaps)", "0", stale, stale == 0 if protocols else None),
        row("skew across replicas, worst round", "<= 250 ms", skew,
            None if skew is None else skew <= GOALS["skew_ms_max"]),
        row("pause-batching / plain time to 100% new (medians)", "<= 1.5",
            None if ratio is None else round(ratio, 2),
            None if ratio is None else ratio <= GOALS["pause_over_plain_t100_max"]),
        row("pause at switch / plain time to 100% new (medians)", "<= 1.5",
            None if ratio_at_switch is None else round(ratio_at_switch, 2),
            None if ratio_at_switch is None
            else ratio_at_switch <= GOALS["pause_over_plain_t100_max"]),
        row("max latency during swap / pre-swap p99, worst round", "<= 2", lat_max,
            None if lat_max is None else lat_max <= GOALS["max_during_over_pre_p99_max"]),
        row("abort: every surviving replica on P", "all faults", aborts,
            None if not aborts else all(a is True for a in aborts)),
    ]


# --------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    """The stack, its clients and the model under test."""

    settings: Settings
    clients: Clients
    storage: S3Storage
    replicas: list[TimedServer]
    versions: tuple[int, int]  # P, C
    probe_feed: dict[str, np.ndarray]
    outputs: list[str]
    payload: dict[str, np.ndarray]
    calls: list[LoadCall] = field(default_factory=list)
    progress: list[str] = field(default_factory=list)

    def swap(self, target: int, *, pause_batching: bool, pause_mode: str = "separate",
             fault: Callable[[str, str], None] | None = None) -> dict[str, Any]:
        """One swap_fleet call; an abort comes back as its report with ``aborted``.

        ``fault(replica, phase)`` runs before a replica's switch (its first load of
        ``target``) and before each of its loads back to another version after it (the
        abort); raising fails that replica's phase."""
        policy = SwapPolicy(pause_batching=pause_batching, deadline_s=DEADLINE_S,
                            probe_timeout_s=5.0, pause_mode=pause_mode)  # type: ignore[arg-type]
        for replica in self.replicas:
            replica.before_load = None if fault is None else _phase_fault(target, fault)
        try:
            report = swap_fleet(
                list(self.replicas),
                SwapTarget.from_settings(self.settings, self.storage, model=MODEL,
                                         version=target, probe_feed=self.probe_feed,
                                         probe_outputs=self.outputs),
                SwapOptions(policy, http_timeout_s=self.settings.http_timeout_s),
                progress=self.progress.append)
        except SwapAborted as exc:
            aborted = dict(exc.details["report"])
            aborted["message"] = exc.message
            return aborted
        finally:
            for replica in self.replicas:
                replica.before_load = None
        return report.to_dict()

    def serving(self) -> set[int]:
        status = fleet_status(self.replicas, MODEL)
        return {v for r in status["replicas"] for v in r["ready_versions"]}


def _phase_fault(target: int, fault: Callable[[str, str], None]
                 ) -> Callable[[str, tuple[int, ...]], None]:
    """A fault(replica, phase) over the loads of one swap to ``target``: a replica's first
    load of ``target`` is its switch, a later load of another version is the abort."""
    switched: set[str] = set()

    def before_load(replica: str, versions: tuple[int, ...]) -> None:
        if versions == (target,) and replica not in switched:
            switched.add(replica)
            fault(replica, "switch")
        elif versions != (target,) and replica in switched:
            fault(replica, "abort")

    return before_load


def build_rig(settings: Settings, workdir: Path) -> Rig:
    """Register, check and stage two versions, and first-deploy the first on every replica."""
    # lazy: tests.models pulls pandas (~0.4 s); importing this module for its helpers does not
    from tests import models

    clients = build_clients(settings)
    assert clients.storage is not None and clients.replicas
    versions = []
    for seed in (0, 1):
        version = models.register_sklearn(str(settings.mlflow_tracking_uri), MODEL, seed=seed)
        report = run_check(settings, clients, Policy(), model=MODEL, version=version,
                           workdir=workdir / f"check-{version}", stage=True)
        if report.verdict != "passed":
            raise SystemExit(f"the check of {MODEL} v{version} did not pass: {report.verdict}")
        versions.append(version)
    config = staged_config(clients.storage, repository_prefix=settings.repository_prefix,
                           model=MODEL, version=versions[0])
    calls: list[LoadCall] = []
    rig = Rig(settings, clients, clients.storage,
              [TimedServer(s, calls) for s in clients.replicas], (versions[0], versions[1]),
              example_request(config), [o.name for o in config.output],
              example_request(config, rows=64, random=True), calls)
    first = rig.swap(versions[0], pause_batching=False)
    if first.get("aborted") or rig.serving() != {versions[0]}:
        raise SystemExit(f"the first deploy of v{versions[0]} failed: {first}")
    return rig


# --------------------------------------------------------------------------- one swap under load


def swap_under_load(rig: Rig, *, old: int, new: int, pause_batching: bool,
                    pause_mode: str = "separate",
                    fault: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    """Run one swap through a load and measure it from the request log."""
    rig.calls.clear()
    with load_through(rig) as load:
        began = time.perf_counter()
        swap_start = load.now()
        report = rig.swap(new, pause_batching=pause_batching, pause_mode=pause_mode,
                          fault=fault)
        swap_end = load.now()
    assert load.report is not None
    names = [s.name for s in rig.replicas]
    figures = analyse(load.report.records, servers=names, swap_start_s=swap_start,
                      swap_end_s=swap_end, old=old, new=new)
    timeline = report.get("timeline", {})
    return {
        "from": old, "to": new, "pause_batching": pause_batching, "pause_mode": pause_mode,
        "load": figures,
        "throughput_rps": round(load.report.throughput_rps, 1),
        "report_skew_ms": report.get("skew_ms"),
        "report_t100_s": round(max(timeline.values()), 3) if len(timeline) == len(names)
        else None,
        "report_timeline": timeline,
        "total_s": report.get("total_s"),
        "aborted": bool(report.get("aborted")),
        "reason": report.get("reason"),
        "phases": phase_breakdown(report, rig.calls, began),
        "final_states": report.get("final_states"),
        "verify_s": report.get("verify_s"),
        "verified_bytes": report.get("verified_bytes"),
    }


# --------------------------------------------------------------------------- faults


def _abort_figures(result: dict[str, Any], victim: str, *, old: int,
                   survivors: Sequence[TritonServer]) -> dict[str, Any]:
    """Where each survivor ended and how long the abort took."""
    status = fleet_status(list(survivors), MODEL)
    on_p = all(r.get("ready_versions") == [old] for r in status["replicas"]) \
        and status["consistent"]
    abort_phase = next((p for p in result["phases"] if p["phase"] == "abort"), None)
    per = result["load"]["per_replica"]
    served_c = [v["last_new_answer_s"] - v["switch_s"] for n, v in per.items()
                if n != victim and v.get("switch_s") is not None
                and v.get("last_new_answer_s") is not None]
    return {
        "victim": victim,
        # how long a survivor answered as C before the abort put it back on P (s); 0 when
        # none did
        "survivors_served_c_s": round(max(served_c), 3) if served_c else 0.0,
        "aborted": result["aborted"],
        "reason": result["reason"],
        "survivors_on_p": on_p,
        "survivor_status": {r["name"]: r.get("ready_versions", r.get("error"))
                            for r in status["replicas"]},
        "final_states": {n: s.get("state") for n, s in (result["final_states"] or {}).items()},
        "abort_total_s": result["total_s"],
        "abort_phase_s": abort_phase["seconds"] if abort_phase else None,
        "abort_started_at_s": abort_phase["started_at"] if abort_phase else None,
        "phases": {p["phase"]: p["seconds"] for p in result["phases"]},
        "failed_survivors": sum(v["failed"] for n, v in per.items() if n != victim),
        "failed_victim": per.get(victim, {}).get("failed"),
        "requests": result["load"]["requests"],
        "answers": result["load"]["answers"],
        "during_max_ms": result["load"]["during_max_ms"],
        "pre_p99_ms": result["load"]["pre_p99_ms"],
        "error_texts": result["load"]["error_texts"],
    }


def fault_simulated(rig: Rig) -> dict[str, Any]:
    """The hook raises for one replica at switch: a stand-in for a load that failed there."""
    old, new = rig.versions
    victim = rig.replicas[1].name

    def fault(replica: str, phase: str) -> None:
        if replica == victim and phase == "switch":
            raise RuntimeError("injected: simulated load failure")

    result = swap_under_load(rig, old=old, new=new, pause_batching=True, fault=fault)
    return {"kind": "simulated (fault hook raises)", **_abort_figures(
        result, victim, old=old, survivors=rig.replicas)}


@dataclass
class _Corruption:
    """C's graph in S3, overwritten for one replica's load and put back exactly."""

    storage: S3Storage
    key: str
    original: bytes
    metadata: dict[str, str]
    lock: threading.Lock = field(default_factory=threading.Lock)
    corrupted: bool = False
    corrupted_at: float | None = None

    def corrupt(self) -> None:
        with self.lock:
            self.storage.put_bytes(self.key, b"\x08\x07not an ONNX graph" * 8,
                                   metadata=self.metadata)
            self.corrupted = True
            self.corrupted_at = time.perf_counter()

    def restore(self) -> None:
        with self.lock:
            if self.corrupted:
                self.storage.put_bytes(self.key, self.original, metadata=self.metadata)
                self.corrupted = False


def fault_real_load_failure(rig: Rig) -> dict[str, Any]:
    """One replica's reload of C really fails in Triton, after the others loaded C."""
    old, new = rig.versions
    victim_index = 1
    victim = rig.replicas[victim_index].name
    prefix = version_prefix(rig.settings.repository_prefix, MODEL, new)
    key = next(k for k in rig.storage.list_keys(prefix + "/") if k.endswith(".onnx"))
    head = rig.storage.head(key) or {}
    corruption = _Corruption(rig.storage, key, rig.storage.get_bytes(key),
                             dict(head.get("metadata", {})))
    # Own clients for the watch: the swap's threads use the replicas' own gRPC clients.
    others = [TritonServer(s.endpoint, timeout_s=5.0, control_timeout_s=30.0)
              for i, s in enumerate(rig.replicas) if i != victim_index]
    held = {"seconds": 0.0, "others_ready": False}

    def fault(replica: str, phase: str) -> None:
        if phase == "abort":
            corruption.restore()  # before any abort load reads the repository
        if replica != victim or phase != "switch":
            return
        began = time.perf_counter()
        while time.perf_counter() - began < DEADLINE_S / 2:
            if all(o.is_model_ready(MODEL, str(new)) for o in others):
                held["others_ready"] = True
                break
            time.sleep(0.05)
        held["seconds"] = round(time.perf_counter() - began, 3)
        corruption.corrupt()

    try:
        result = swap_under_load(rig, old=old, new=new, pause_batching=True, fault=fault)
    finally:
        corruption.restore()
        for other in others:
            other.close()
    figures = _abort_figures(result, victim, old=old, survivors=rig.replicas)
    return {"kind": "real (C's model.onnx corrupt in S3 for the victim's reload only)",
            "victim_held_until_others_ready_s": held["seconds"],
            "others_had_c_ready": held["others_ready"], "corrupted_key": key, **figures}


@dataclass
class Victim:
    """A replica to SIGKILL: its PID and, at kill time, its process group's /dev/shm regions
    (so the benchmark can clean up exactly what that server left behind)."""

    name: str
    pid: int
    killed_at: float | None = None
    shm: set[str] = field(default_factory=set)

    def kill(self) -> None:
        self.shm = _shm_regions(group_members(self.pid))
        self.killed_at = time.perf_counter()
        os.kill(self.pid, signal.SIGKILL)

    def clean_up(self) -> dict[str, Any]:
        """Reap the server, kill its orphaned backend stubs, remove its shm regions."""
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        leftovers = [p for p in group_members(self.pid) if p != self.pid]
        if leftovers:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 5
        while [p for p in group_members(self.pid) if p != self.pid] and time.monotonic() < end:
            time.sleep(0.1)
        removed = []
        for path in sorted(self.shm):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        return {"stubs_killed": len(leftovers), "shm_removed": len(removed)}


def _shm_regions(pids: Sequence[int]) -> set[str]:
    regions = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split()[-1] if line.split() else ""
            if path.startswith("/dev/shm/"):
                regions.add(path)
    return regions


def replica_pid(settings: Settings, name: str) -> int:
    state = json.loads(settings.stack_file.read_text())
    return int(next(p["pid"] for p in state["processes"] if p["name"] == name))


def fault_kill(rig: Rig, victim: Victim) -> dict[str, Any]:
    """SIGKILL one replica while its switch load is in flight (run last: it stays dead)."""
    old, new = rig.versions
    timer: list[threading.Timer] = []

    def fault(replica: str, phase: str) -> None:
        if replica == victim.name and phase == "switch" and not timer:
            timer.append(threading.Timer(KILL_DELAY_S, victim.kill))
            timer[0].start()

    try:
        result = swap_under_load(rig, old=old, new=new, pause_batching=True, fault=fault)
    finally:
        for t in timer:
            if victim.killed_at is None:
                t.cancel()
            t.join(timeout=5)
    survivors = [s for s in rig.replicas if s.name != victim.name]
    figures = _abort_figures(result, victim.name, old=old, survivors=survivors)
    return {"kind": f"SIGKILL of tritonserver {KILL_DELAY_S:g} s into the victim's switch load",
            "killed": victim.killed_at is not None, **figures}


VERIFY_MB = 64  # size of the synthetic version whose preflight verification is timed


def preflight_verify_cost(rig: Rig, workdir: Path) -> dict[str, Any]:
    """Time the swap preflight's verification (signature + streamed sha256 of every byte)
    on a synthetic version of VERIFY_MB MB staged next to the real ones (never loaded)."""
    key = key_bytes(rig.settings.manifest_signing_key)
    folder = workdir / "verify-cost"
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "model.onnx.data"
    weights.write_bytes(os.urandom(VERIFY_MB * 1024 * 1024))
    (folder / "model.onnx").write_bytes(os.urandom(4096))
    model = "bench_verify_cost"
    stage_version(rig.storage, model=model, version=1,
                  files={"model.onnx": folder / "model.onnx", "model.onnx.data": weights},
                  config_pbtxt=f'name: "{model}"\nbackend: "onnxruntime"\n', provenance={},
                  policy=Policy().staging, repository_prefix=rig.settings.repository_prefix,
                  signing_key=key)
    runs = []
    for _ in range(3):
        verified = read_verified(rig.storage, model=model, version=1,
                                 repository_prefix=rig.settings.repository_prefix, deep=True,
                                 signing_key=key)
        runs.append(verified.seconds)
    rig.storage.delete_prefix(f"{rig.settings.repository_prefix}/{model}/")
    best = min(runs)
    size = verified.bytes_hashed
    return {"bytes": size, "seconds": [round(r, 3) for r in runs],
            "best_s": round(best, 3), "mb_per_s": round(size / 1e6 / best, 1)}


# --------------------------------------------------------------------------- the run


def run(replicas: int, rounds: int, workdir: Path, settings: Settings) -> dict[str, Any]:
    """Everything after the stack is up; returns the figures."""
    rig = build_rig(settings, workdir)
    p, c = rig.versions
    order = list(PROTOCOLS)
    per_protocol: dict[str, list[dict[str, Any]]] = {name: [] for name in PROTOCOLS}
    current, other = p, c
    try:
        for i in range(rounds):
            for name in order if i % 2 == 0 else order[::-1]:  # ABBA: both directions each
                pause, mode = PROTOCOLS[name]
                result = swap_under_load(rig, old=current, new=other, pause_batching=pause,
                                         pause_mode=mode)
                per_protocol[name].append(result)
                figures = result["load"]
                print(f"  {name}: v{current} -> v{other}: {figures['requests']} requests, "
                      f"{figures['failed']} failed, {figures['stale']} stale, skew "
                      f"{figures['skew_ms']} ms, 100% new at {figures['t100_s']} s, max "
                      f"{figures['during_max_ms']} ms vs p99 {figures['pre_p99_ms']} ms"
                      + (f" ABORTED: {result['reason']}" if result["aborted"] else ""),
                      flush=True)
                if result["aborted"]:
                    raise SystemExit(f"a plain swap aborted: {result['reason']}")
                current, other = other, current
        if current != p:  # faults start from P = versions[0]
            rig.swap(p, pause_batching=False)
        faults: dict[str, dict[str, Any]] = {}
        print("  fault: simulated load failure", flush=True)
        faults["simulated load failure"] = fault_simulated(rig)
        print("  fault: real load failure", flush=True)
        faults["real load failure"] = fault_real_load_failure(rig)
        print("  fault: replica killed", flush=True)
        victim = Victim(rig.replicas[-1].name, replica_pid(settings, rig.replicas[-1].name))
        try:
            faults["replica killed"] = fault_kill(rig, victim)
        finally:
            if victim.killed_at is not None:
                faults.setdefault("replica killed", {})["cleanup"] = victim.clean_up()
        print("  preflight verification cost on a large staged version", flush=True)
        verify_cost = preflight_verify_cost(rig, workdir)
    finally:
        rig.clients.close()
        for server in rig.replicas:
            server.close()

    summaries = {name: summarize_protocol(rs) for name, rs in per_protocol.items()}
    pause_phases = [r["phases"] for r in per_protocol["pause-batching"]]
    plain_phases = [r["phases"] for r in per_protocol["plain reload"]]
    return {
        "replicas": replicas,
        "rounds_per_protocol": rounds,
        "concurrency": CONCURRENCY,
        "load": {"protocol": "grpc", "pre_s": PRE_S, "post_s": POST_S,
                 "warmup_excluded_s": WARMUP_S, "requests": "unversioned, round-robin"},
        "versions": {"P": p, "C": c},
        "protocols": summaries,
        "phase_medians": {"pause-batching": _phase_medians(pause_phases),
                          "pause at switch": _phase_medians(
                              [r["phases"] for r in per_protocol["pause at switch"]]),
                          "plain reload": _phase_medians(plain_phases)},
        "rounds": per_protocol,
        "faults": faults,
        "preflight_verify": verify_cost,
        "goals": judge(summaries, faults, verify_cost),
    }


def _phase_medians(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    if not runs:
        return []
    names = [row["phase"] for row in runs[0]]
    medians = []
    for name in names:
        rows = [row for phases in runs for row in phases if row["phase"] == name]
        medians.append({"phase": name, **{
            key: _median([row.get(key) for row in rows])
            for key in ("started_at", "seconds", "load_call_max_s", "load_call_mean_s",
                        "after_last_load_s")}})
    return medians


def _print(figures: dict[str, Any]) -> None:
    protocols = figures["protocols"]
    print_table(
        f"swap under load ({figures['replicas']} replicas, {CONCURRENCY} gRPC clients; "
        f"medians over {figures['rounds_per_protocol']} rounds; failed/stale are totals)",
        ["protocol", "requests", "failed", "stale", "skew ms", "skew ms (report)",
         "100% new s", "100% new s (report)", "swap s", "pre p99 ms", "pre max ms",
         "during p99 ms", "during max ms", "max/pre p99"],
        [(name, s["requests_median"], s["failed_total"], s["stale_total"], s["skew_ms"],
          s["report_skew_ms"], s["t100_s"], s["report_t100_s"], s["swap_s"], s["pre_p99_ms"],
          s["pre_max_ms"], s["during_p99_ms"], s["during_max_ms"],
          s["max_during_over_pre_p99"]) for name, s in protocols.items()])
    for name, rows in figures["phase_medians"].items():
        print_table(
            f"where the time goes: {name} (median s from the swap start; load call = the "
            "gRPC reload on one replica)",
            ["phase", "starts at", "seconds", "slowest load call", "mean load call",
             "after last load"],
            [(r["phase"], r["started_at"], r["seconds"], r.get("load_call_max_s") or "-",
              r.get("load_call_mean_s") or "-", r.get("after_last_load_s") or "-")
             for r in rows])
    print_table(
        "faults under load (pause-batching protocol)",
        ["fault", "victim", "aborted", "survivors on P", "abort total s", "abort phase s",
         "failed (survivors)", "failed (victim)", "reason"],
        [(name, f["victim"], f["aborted"], f["survivors_on_p"], f["abort_total_s"],
          f["abort_phase_s"], f["failed_survivors"], f["failed_victim"],
          (f["reason"] or "")[:70]) for name, f in figures["faults"].items()])
    print_table("goals", ["goal", "target", "measured", "met"],
                [(g["goal"], g["target"], g["measured"], g["met"]) for g in figures["goals"]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.swap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3, help="Triton replicas (default 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="swaps per protocol, directions alternating (default 3)")
    args = parser.parse_args(argv)
    for key, value in {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "GX_ANALYTICS_ENABLED": "false",
                       "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}.items():
        os.environ.setdefault(key, value)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ms-bench-swap-") as tmp:
        home = Path(tmp) / ".modelship"
        base = Settings(home=home, triton_runtime=RUNTIME)
        try:
            print(f"starting the stack with {args.replicas} replicas in {home}", flush=True)
            manager.up(base, replicas=args.replicas)
            settings = load_settings(home=home, triton_runtime=RUNTIME)
            figures = run(args.replicas, args.rounds, Path(tmp), settings)
        finally:
            manager.down(base)
    figures["runtime_s"] = round(time.monotonic() - started, 1)
    path = write_results("swap", figures)
    _print(figures)
    print(f"\nwritten to {path} ({figures['runtime_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
