"""Stage 8, swap: move every replica from P to C at once, or leave every replica on P.

The protocol (DESIGN §4) is decided by :mod:`modelship.triton.swap_plan`, which is pure;
this module performs its I/O, through the clients passed in:

1. **Observe** every replica in parallel (live, the versions it reports READY, its live
   config), read C's staged config from ``P/<model>/<C>/config.pbtxt`` and verify C's
   manifest. :func:`~modelship.triton.swap_plan.plan_swap` refuses any surprise here,
   before anything changes.
2. **Phases**: each runs on every replica in parallel, with the policy's deadline. A load is
   a full-config override over gRPC (RECIPES: overrides replace, HTTP control calls stall
   serving); the replica must then report the expected version READY and, for probed
   phases, answer an unversioned request *as* that version.
3. **Abort** on any failure or timeout: the abort phase runs on every replica in parallel
   and each is checked back on P; :class:`~modelship.errors.SwapAborted` lists every
   replica's state. Never unload-then-load: that is an outage (RECIPES).
4. **Record**: after success ``P/<model>/config.pbtxt`` becomes C's production config, so a
   later plain load (which drops any override) serves what the swap left serving.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modelship.errors import ModelshipError, StagingError, SwapAborted
from modelship.policy import SwapPolicy
from modelship.storage import S3Storage
from modelship.triton.client import TritonServer
from modelship.triton.infer import TritonInference
from modelship.triton.model_config import (
    ModelConfig,
    config_digest,
    from_live_json,
    from_pbtxt,
    serving_digest,
    to_json,
    to_pbtxt,
    with_versions,
)
from modelship.triton.swap_plan import (
    ABORT,
    Aborted,
    AbortPhase,
    Done,
    Phase,
    ReplicaState,
    ReplicaView,
    RunPhase,
    SwapPlan,
    SwapRun,
    next_action,
    plan_swap,
    record,
    replica_states,
    start,
)
from tasks.stage import CONFIG_NAME, SHA256_METADATA, model_prefix, verify_staged, version_prefix

__all__ = ["Fault", "PhaseReport", "Progress", "SwapReport", "fleet_status", "ready_versions",
           "swap_fleet"]

Progress = Callable[[str], None]
Fault = Callable[[str, str], None]

POLL_INTERVAL_S = 0.05
# Extra wait for a replica's thread past the phase deadline: its own checks end at the
# deadline, so only a load stuck in gRPC (bounded by control_timeout_s) outlives this.
JOIN_GRACE_S = 2.0


def _quiet(_: str) -> None:
    """The default progress sink: say nothing."""


# --------------------------------------------------------------------------------------
# report


@dataclass
class PhaseReport:
    """One phase on the whole fleet.

    Attributes:
        started_at: Seconds from the swap's start when the phase began.
        seconds: Wall time until every replica finished it, in s.
        replicas: Per replica ``{"ok", "reason", "seconds"}``.
    """

    name: str
    started_at: float
    seconds: float
    replicas: dict[str, dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "started_at": round(self.started_at, 3),
                "seconds": round(self.seconds, 3), "replicas": self.replicas}


@dataclass
class SwapReport:
    """What the swap did, for the release record and ``--json`` output.

    Attributes:
        timeline: Per replica, seconds from the swap's start when it first answered a probe
            as C.
        skew_ms: Time between the first and the last replica answering as C, in ms; None
            when fewer than one replica did.
        total_s: Wall time of the whole swap, observation included, in s.
        final_states: Per replica: the version it serves, its last phase and outcome.
    """

    model: str
    kind: str
    from_version: int | None
    to_version: int
    pause_batching: bool
    phases: list[PhaseReport] = field(default_factory=list)
    timeline: dict[str, float] = field(default_factory=dict)
    skew_ms: float | None = None
    total_s: float = 0.0
    aborted: bool = False
    final_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    reason: str | None = None
    plan: list[str] = field(default_factory=list)
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "plan": self.plan,
            "model": self.model,
            "kind": self.kind,
            "from_version": self.from_version,
            "to_version": self.to_version,
            "pause_batching": self.pause_batching,
            "phases": [p.to_dict() for p in self.phases],
            "timeline": {k: round(v, 3) for k, v in self.timeline.items()},
            "skew_ms": None if self.skew_ms is None else round(self.skew_ms, 1),
            "total_s": round(self.total_s, 3),
            "aborted": self.aborted,
            "final_states": self.final_states,
            "reason": self.reason,
        }


# --------------------------------------------------------------------------------------
# observation


@dataclass(frozen=True)
class _Observed:
    view: ReplicaView
    live_config: ModelConfig | None


def ready_versions(server: TritonServer, model: str) -> tuple[int, ...]:
    """The versions of ``model`` that ``server`` reports READY, ascending.

    The repository index names the candidates; each is confirmed with a readiness call,
    because the index of a model being reloaded can lag.
    """
    listed = {
        int(entry["version"])
        for entry in server.repository_index()
        if entry.get("name") == model and entry.get("state") == "READY"
        and str(entry.get("version", "")).isdigit()
    }
    return tuple(sorted(v for v in listed if server.is_model_ready(model, str(v))))


def _observe(server: TritonServer, model: str) -> _Observed:
    try:
        server.ping()
        versions = ready_versions(server, model)
        live = from_live_json(server.model_config(model)) if versions else None
    except ModelshipError as exc:
        return _Observed(ReplicaView(server.name, False, (), None, problem=exc.message), None)
    digest = serving_digest(live) if live is not None else None
    return _Observed(ReplicaView(server.name, True, versions, digest), live)


def _observe_fleet(replicas: Sequence[TritonServer], model: str) -> list[_Observed]:
    with ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
        return list(pool.map(lambda s: _observe(s, model), replicas))


def fleet_status(replicas: Sequence[TritonServer], model: str) -> dict[str, Any]:
    """What every replica serves, for ``modelship status MODEL --json``.

    ``consistent`` is true when every replica is reachable and serves exactly one and the
    same version with the same config digest (version policy included).
    """

    def one(server: TritonServer) -> dict[str, Any]:
        row: dict[str, Any] = {"url": server.endpoint.http, "name": server.name,
                               "ready_versions": [], "config_digest": None}
        try:
            versions = ready_versions(server, model)
            row["ready_versions"] = list(versions)
            if versions:
                row["config_digest"] = config_digest(from_live_json(server.model_config(model)))
        except ModelshipError as exc:
            row["error"] = exc.message
        return row

    with ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
        rows = list(pool.map(one, replicas))
    consistent = bool(rows) and all("error" not in r and len(r["ready_versions"]) == 1
                                    for r in rows) \
        and len({(tuple(r["ready_versions"]), r["config_digest"]) for r in rows}) == 1
    return {"model": model, "replicas": rows, "consistent": consistent}


# --------------------------------------------------------------------------------------
# one phase on one replica


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    reason: str | None
    at_s: float
    seconds: float
    answered_at_s: float | None = None


@dataclass(frozen=True)
class _Probe:
    """One unversioned request, sent over HTTP as real clients send it."""

    feed: dict[str, np.ndarray]
    outputs: list[str]
    timeout_s: float

    def answered_version(self, inference: TritonInference, model: str) -> str:
        return inference.infer(model, self.feed, outputs=self.outputs).model_version


def _run_phase_on(server: TritonServer, phase: Phase, *, model: str, swap_start: float,
                  deadline: float, probe: _Probe, fault: Fault | None) -> _Outcome:
    """Load the phase's config on one replica and check it serves the expected version.

    The HTTP inference client is made and closed in this thread, so no connection is
    shared between threads (tritonclient.http's clients are not meant to be).
    """
    began = time.monotonic()
    inference = TritonInference(server.endpoint.http, timeout_s=probe.timeout_s)

    def outcome(ok: bool, reason: str | None = None,
                answered_at: float | None = None) -> _Outcome:
        now = time.monotonic()
        return _Outcome(ok, reason, now - swap_start, now - began, answered_at)

    try:
        if fault is not None:
            fault(server.name, phase.name)
        if phase.config is None:
            if time.monotonic() > deadline:
                return outcome(False, "deadline passed before the unload was sent")
            server.unload_model(model)
            while server.is_model_ready(model):
                if time.monotonic() > deadline:
                    return outcome(False, f"{model} still ready after the unload deadline")
                time.sleep(POLL_INTERVAL_S)
            return outcome(True)
        if time.monotonic() > deadline:  # a late thread must not change a replica any more
            return outcome(False, f"deadline passed before {phase.name} was sent")
        server.load_model(model, config_json=to_json(phase.config))
        if time.monotonic() > deadline and phase.name != ABORT:
            return outcome(False, f"the load took {time.monotonic() - began:.1f} s, past the "
                           "deadline")
        expected = str(phase.expect_version)
        while not server.is_model_ready(model, expected):
            if time.monotonic() > deadline:
                return outcome(False, f"v{expected} not ready before the deadline")
            time.sleep(POLL_INTERVAL_S)
        if not phase.probe:
            return outcome(True)
        last = "no probe sent"
        while True:
            try:
                answered = probe.answered_version(inference, model)
            except ModelshipError as exc:
                answered, last = "", exc.message
            if answered == expected:
                return outcome(True, answered_at=time.monotonic() - swap_start)
            if answered:
                last = f"a probe was answered by v{answered}, not v{expected}"
            if time.monotonic() > deadline:
                return outcome(False, f"{last} (deadline passed)")
            time.sleep(POLL_INTERVAL_S)
    except ModelshipError as exc:
        return outcome(False, exc.message)
    except Exception as exc:  # noqa: BLE001 - a fault hook or a client bug fails this replica
        return outcome(False, f"{type(exc).__name__}: {exc}")
    finally:
        inference.close()


def _run_phase(servers: dict[str, TritonServer], names: Sequence[str], phase: Phase, *,
               model: str, swap_start: float, policy: SwapPolicy,
               probe: _Probe, fault: Fault | None) -> dict[str, _Outcome]:
    """Run a phase on the named replicas in parallel; a replica past the deadline fails."""
    deadline = time.monotonic() + policy.deadline_s
    pool = ThreadPoolExecutor(max_workers=max(1, len(names)),
                              thread_name_prefix=f"swap-{phase.name}")
    futures: dict[str, Future[_Outcome]] = {
        name: pool.submit(_run_phase_on, servers[name], phase, model=model,
                          swap_start=swap_start, deadline=deadline, probe=probe,
                          fault=fault)
        for name in names
    }
    wait(futures.values(), timeout=policy.deadline_s + JOIN_GRACE_S)
    pool.shutdown(wait=False, cancel_futures=True)  # a stuck gRPC load must not hold the abort
    results: dict[str, _Outcome] = {}
    for name, future in futures.items():
        if future.done():
            results[name] = future.result()
        else:
            at = time.monotonic() - swap_start
            results[name] = _Outcome(False, f"no outcome within the deadline "
                                     f"({policy.deadline_s:g} s)", at, policy.deadline_s)
    return results


# --------------------------------------------------------------------------------------
# the swap


def _read_candidate(storage: S3Storage, *, model: str, target: int,
                    repository_prefix: str) -> tuple[ModelConfig, bool, str | None]:
    """C's staged config and whether its manifest verifies (with why not)."""
    problems: list[str] = []
    try:
        verify_staged(storage, model=model, version=target, repository_prefix=repository_prefix)
    except StagingError as exc:
        problems.append(exc.message)
    config = ModelConfig(name=model)
    key = f"{version_prefix(repository_prefix, model, target)}/{CONFIG_NAME}"
    try:
        config = from_pbtxt(storage.get_bytes(key).decode())
    except ModelshipError as exc:
        if not problems:
            problems.append(f"its config {key} could not be read: {exc.message}")
    return config, not problems, "; ".join(problems) or None


def _write_model_config(storage: S3Storage, *, model: str, config: ModelConfig,
                        repository_prefix: str) -> bool:
    """Make ``P/<model>/config.pbtxt`` the config that serves; False when it already was."""
    key = f"{model_prefix(repository_prefix, model)}/{CONFIG_NAME}"
    body = to_pbtxt(config).encode()
    if storage.exists(key) and storage.get_bytes(key) == body:
        return False
    storage.put_bytes(key, body, metadata={SHA256_METADATA: hashlib.sha256(body).hexdigest()})
    return True


def _states_dict(states: dict[str, ReplicaState]) -> dict[str, dict[str, Any]]:
    return {name: state.to_dict() for name, state in states.items()}


def swap_fleet(
    replicas: list[TritonServer],
    *,
    model: str,
    target: int,
    storage: S3Storage,
    repository_prefix: str,
    policy: SwapPolicy,
    probe_feed: dict[str, np.ndarray],
    probe_outputs: list[str],
    progress: Progress = _quiet,
    http_timeout_s: float = 10.0,
    fault: Fault | None = None,
    dry_run: bool = False,
) -> SwapReport:
    """Serve ``model`` version ``target`` on every replica, or on none of them.

    With ``dry_run`` it observes the fleet, verifies the candidate and returns the plan
    without changing anything.

    Args:
        replicas: The production fleet (not the canary).
        model: Triton model name.
        target: C, a staged version.
        storage: The S3 client of the repository Triton serves.
        repository_prefix: The repository prefix inside the bucket.
        policy: ``pause_batching``, the per-phase ``deadline_s`` and ``probe_timeout_s``.
        probe_feed: One small valid request (input name to array, batch first).
        probe_outputs: Output names the probe asks for.
        progress: Receives one human line per step.
        http_timeout_s: Upper bound of one probe request, in s (the policy's
            ``probe_timeout_s`` applies when lower).
        fault: Test hook, called as ``fault(replica, phase)`` before each replica's phase;
            raising fails that replica's phase (fault injection for the abort path).

    Returns:
        The report; ``kind == "noop"`` when every replica already served C.

    Raises:
        PreflightError: a surprise in the fleet or the candidate; nothing was changed.
        SwapAborted: a phase failed or timed out; every replica ran the abort phase. The
            message lists each replica's state; ``details["report"]`` is the report.
    """
    swap_start = time.monotonic()
    progress(f"{model}: observing {len(replicas)} replica(s) and candidate v{target}")
    observed = _observe_fleet(replicas, model)
    candidate, verified, problem = _read_candidate(
        storage, model=model, target=target, repository_prefix=repository_prefix)
    production = next((o.live_config for o in observed if o.live_config is not None), None)
    plan = plan_swap(model, [o.view for o in observed], target=target,
                     candidate_config=candidate, production_config=production,
                     pause_batching=policy.pause_batching, candidate_verified=verified,
                     pause_at_switch=policy.pause_mode == "at_switch",
                     candidate_problem=problem)
    for line in plan.describe():
        progress(line)
    report = SwapReport(model, plan.kind, plan.from_version, plan.to_version,
                        plan.pause_batching, plan=plan.describe(), dry_run=dry_run)
    if dry_run:
        report.final_states = _states_dict(replica_states(start(plan)))
        report.total_s = time.monotonic() - swap_start
        return report
    if plan.kind == "noop":
        _write_model_config(storage, model=model, config=with_versions(candidate, [target]),
                            repository_prefix=repository_prefix)
        report.final_states = _states_dict(replica_states(start(plan)))
        report.total_s = time.monotonic() - swap_start
        return report

    servers = {s.name: s for s in replicas}
    probe = _Probe(probe_feed, probe_outputs, min(policy.probe_timeout_s, http_timeout_s))
    run = _execute(plan, servers, report, model=model, swap_start=swap_start, policy=policy,
                   probe=probe, fault=fault, progress=progress)

    states = replica_states(run)
    report.final_states = _states_dict(states)
    answered = list(report.timeline.values())
    report.skew_ms = (max(answered) - min(answered)) * 1000 if answered else None
    action = next_action(run)
    if isinstance(action, Aborted):
        report.aborted = True
        report.reason = action.reason
        report.total_s = time.monotonic() - swap_start
        lines = "; ".join(s.describe() for s in states.values())
        progress(f"{model}: swap aborted ({action.reason}); {lines}")
        stranded = [s.name for s in states.values() if not s.ok]
        raise SwapAborted(
            f"swap of {model} v{plan.from_version} -> v{target} aborted: {action.reason}. "
            f"Replica states: {lines}",
            hint=(f"replicas {', '.join(stranded)} may not serve v{plan.from_version}: check "
                  f"them with `modelship status {model} --json`" if stranded else
                  f"every replica serves v{plan.from_version} again; fix the cause and retry"),
            model=model, from_version=plan.from_version, to_version=target,
            report=report.to_dict(),
        )
    assert isinstance(action, Done)
    _write_model_config(storage, model=model, config=with_versions(candidate, [target]),
                        repository_prefix=repository_prefix)
    report.total_s = time.monotonic() - swap_start
    skew = f"{report.skew_ms:.0f} ms" if report.skew_ms is not None else "n/a"
    progress(f"{model}: every replica serves v{target} ({report.total_s:.1f} s, skew {skew})")
    return report


def _execute(plan: SwapPlan, servers: dict[str, TritonServer], report: SwapReport, *,
             model: str, swap_start: float, policy: SwapPolicy, probe: _Probe,
             fault: Fault | None, progress: Progress) -> SwapRun:
    """Walk the plan's run: ask next_action, perform it, record every outcome."""
    run = start(plan)
    while True:
        action = next_action(run)
        if not isinstance(action, RunPhase | AbortPhase):
            return run
        phase = action.phase
        progress(f"{model}: {phase.describe()} on {', '.join(action.replicas)}")
        began = time.monotonic()
        outcomes = _run_phase(servers, action.replicas, phase, model=model,
                              swap_start=swap_start, policy=policy, probe=probe,
                              fault=fault)
        report.phases.append(PhaseReport(
            phase.name, began - swap_start, time.monotonic() - began,
            {name: {"ok": o.ok, "reason": o.reason, "seconds": round(o.seconds, 3)}
             for name, o in outcomes.items()}))
        # failures first, so that the run starts aborting at the first failed outcome
        for name, outcome in sorted(outcomes.items(), key=lambda item: item[1].ok):
            if outcome.answered_at_s is not None and phase.expect_version == plan.to_version \
                    and name not in report.timeline and isinstance(action, RunPhase):
                report.timeline[name] = outcome.answered_at_s
            run = record(run, name, phase.name, outcome.ok, outcome.reason, outcome.at_s)
            status = "ok" if outcome.ok else f"FAILED: {outcome.reason}"
            progress(f"{model}: {phase.name} on {name}: {status} ({outcome.seconds:.2f} s)")
