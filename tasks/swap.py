"""Stage 8, swap: move every replica from P to C at once, or leave every replica on P.

The protocol (DESIGN §4) is decided by :mod:`modelship.triton.swap_plan`, which is pure;
this module performs its I/O, through the clients passed in:

1. **Observe** every replica in parallel (live, the versions it reports READY, its live
   config), read C's staged config from ``P/<model>/<C>/config.pbtxt`` and verify C's
   manifest. :func:`~modelship.triton.swap_plan.plan_swap` refuses any surprise here,
   before anything changes. Then the **GPU headroom**: every replica's metrics are read,
   and on each GPU C's instances will use, the free memory must hold C's footprint plus
   ``triton.gpu.headroom_bytes`` next to P (Triton builds C before it drops P). The
   footprint is the canary's measurement when the caller passes one, else the estimate
   from C's ONNX initializers; the plan says which (:func:`modelship.triton.gpu.plan_headroom`).
   Replicas without ``nv_gpu_*`` metrics (CPU servers) are skipped with a plan line. A
   shortfall refuses the swap with :class:`~modelship.errors.PreflightError` (exit 1) and
   the numbers; a ``converge`` (repair, rollback) only reports it, since a load that does
   not fit fails and leaves the replica on what it served. The same scrape tells the
   fleet's **serving form**: C's staged config (rendered for the policy's target, say
   ``KIND_GPU`` with accelerators and warmup) is loaded in the fleet's form, its CPU
   derivation on CPU servers (:mod:`modelship.triton.target`), and the plan compares the
   replicas' live configs with that form.
2. **Phases**: each runs on every replica in parallel, with the policy's deadline. A load is
   a full-config override over gRPC (RECIPES: overrides replace, HTTP control calls stall
   serving); the replica must then report the expected version READY and, for probed
   phases, answer an unversioned request *as* that version.
3. **Abort** on any failure or timeout: the abort phase runs on every replica in parallel
   and each is checked back on P; :class:`~modelship.errors.SwapAborted` lists every
   replica's state. Never unload-then-load: that is an outage (RECIPES).
4. **Record**: after success ``P/<model>/config.pbtxt`` becomes C's production config in
   the fleet's form, so a later plain load (which drops any override), a restarted replica
   and reconcile load what the swap left serving.
"""

from __future__ import annotations

import hashlib
import hmac
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import numpy as np
import onnx

from modelship.errors import (
    ModelshipError,
    PreflightError,
    StagingError,
    SwapAborted,
    Unreachable,
)
from modelship.ledger import ReleaseRecord, same_candidate, sort_newest_first
from modelship.policy import GpuPolicy, SwapPolicy
from modelship.progress import Progress, quiet
from modelship.repository import (
    CONFIG_NAME,
    SHA256_METADATA,
    VerifiedVersion,
    model_prefix,
    read_verified,
    version_prefix,
)
from modelship.settings import Settings
from modelship.signals import deferred
from modelship.signing import key_bytes
from modelship.storage import S3Storage
from modelship.triton.client import TritonServer
from modelship.triton.gpu import (
    HeadroomPlan,
    check_headroom,
    initializer_bytes,
    plan_headroom,
)
from modelship.triton.infer import GoldenProbe, TritonInference, warm_http
from modelship.triton.metrics import scrape_text
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
from modelship.triton.target import FleetTarget, render_for_servers

__all__ = ["PIN_SIGNATURE_METADATA", "Observed", "PhaseReport", "Progress",
           "RecordedFootprint", "SwapOptions", "SwapReport", "SwapTarget", "apply_config",
           "fleet_status", "observe_fleet", "pin_signature", "ready_versions",
           "recorded_footprint", "swap_fleet"]


POLL_INTERVAL_S = 0.05
# Extra wait for a replica's thread past the phase deadline: its own checks end at the
# deadline, so only a load stuck in gRPC (bounded by control_timeout_s) outlives this.
JOIN_GRACE_S = 2.0
# A replica whose probes cannot connect for this long has failed its phase (it died or was
# restarted): the abort starts within seconds, not at the phase deadline.
UNREACHABLE_GRACE_S = 2.0


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
        verify_s: Preflight time spent verifying C (signature, streamed sha256 of every
            staged file), in s; None when C was not verified (a no-op).
        verified_bytes: Bytes of C streamed and hashed by the preflight.
        headroom: The GPU headroom preflight (footprint, measured or estimated, and every
            replica's check); None for a no-op.
        serving_form: The form C was loaded and pinned in (``target``, ``source``, per
            replica what its metrics said).
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
    verify_s: float | None = None
    verified_bytes: int = 0
    headroom: dict[str, Any] | None = None
    serving_form: dict[str, Any] | None = None

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
            "verify_s": None if self.verify_s is None else round(self.verify_s, 3),
            "verified_bytes": self.verified_bytes,
            "headroom": self.headroom,
            "serving_form": self.serving_form,
        }


# --------------------------------------------------------------------------------------
# observation


@dataclass(frozen=True)
class Observed:
    """One replica as observed: what it serves, and its live config (None if nothing)."""

    view: ReplicaView
    live_config: ModelConfig | None


def ready_versions(server: TritonServer, model: str) -> tuple[int, ...]:
    """The versions of ``model`` that ``server`` reports READY, ascending.

    Asked of the replica itself (model metadata, then per-version readiness), never of its
    repository index: the index lists the S3 repository, so it fails while S3 is down
    although the replica still serves from memory.
    """
    metadata = server.model_metadata(model)
    if metadata is None:
        return ()
    listed = {int(v) for v in metadata.get("versions", []) if str(v).isdigit()}
    return tuple(sorted(v for v in listed if server.is_model_ready(model, str(v))))


def _observe(server: TritonServer, model: str) -> Observed:
    try:
        server.ping()
        versions = ready_versions(server, model)
        live = from_live_json(server.model_config(model)) if versions else None
    except ModelshipError as exc:
        return Observed(ReplicaView(server.name, False, (), None, problem=exc.message), None)
    digest = serving_digest(live) if live is not None else None
    return Observed(ReplicaView(server.name, True, versions, digest), live)


def observe_fleet(replicas: Sequence[TritonServer], model: str) -> list[Observed]:
    """Observe every replica in parallel (a replica that fails to answer is not live)."""
    with ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
        return list(pool.map(lambda s: _observe(s, model), replicas))


def fleet_status(replicas: Sequence[TritonServer], model: str,
                 storage: S3Storage | None = None) -> dict[str, Any]:
    """What every replica serves, for ``modelship status MODEL --json``.

    Each replica is asked directly (model metadata and per-version readiness), so the
    answer holds while S3 is down; with ``storage`` the repository is pinged too and an
    outage is said (``repository`` and ``notes``).

    Returns:
        ``{"model", "replicas": [{"url", "name", "ready_versions", "config_digest"[,
        "error"]}], "consistent", "served", "summary", "notes", "readiness_source"[,
        "repository": {"reachable", "error"}]}``. ``consistent`` is true when every
        replica is reachable and serves exactly one and the same version with the same
        config digest; ``served`` is false when no reachable replica serves the model (an
        unknown model, or one never deployed); ``summary`` is one human line.
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

    with ThreadPoolExecutor(max_workers=max(1, len(replicas) + 1)) as pool:
        ping = pool.submit(storage.ping) if storage is not None else None
        rows = list(pool.map(one, replicas))
        repository: dict[str, Any] | None = None
        if ping is not None:
            try:
                ping.result()
                repository = {"reachable": True, "error": None}
            except ModelshipError as exc:
                repository = {"reachable": False, "error": exc.message}
    consistent = bool(rows) and all("error" not in r and len(r["ready_versions"]) == 1
                                    for r in rows) \
        and len({(tuple(r["ready_versions"]), r["config_digest"]) for r in rows}) == 1
    reachable = [r for r in rows if "error" not in r]
    served = any(r["ready_versions"] for r in reachable)
    notes: list[str] = []
    if repository is not None and not repository["reachable"]:
        notes.append("S3 (the model repository) is unreachable: the replicas answered from "
                     "memory and still serve; swaps, reconcile and replica restarts need S3 "
                     "back")
    if not rows:
        summary = f"no Triton replicas are configured for {model}"
    elif consistent:
        summary = f"{model} v{rows[0]['ready_versions'][0]} on every replica ({len(rows)})"
    elif not served and len(reachable) == len(rows):
        summary = (f"no replica serves {model}: an unknown model name, or one never deployed "
                   f"(`modelship swap {model} --to V` deploys a staged version)")
    else:
        parts = "; ".join(
            f"{r['name']} " + ("unreachable" if "error" in r else
                               "serves " + (", ".join(f"v{v}" for v in r["ready_versions"])
                                            or "nothing"))
            for r in rows)
        summary = (f"{model} is INCONSISTENT ({parts}): `modelship reconcile {model}` brings "
                   f"every reachable replica to the recorded production, or `modelship swap "
                   f"{model} --to V --converge` to V")
    document: dict[str, Any] = {"model": model, "replicas": rows, "consistent": consistent,
                                "served": served, "summary": summary, "notes": notes,
                                "readiness_source": "replicas (model metadata and "
                                "per-version readiness, no repository index)"}
    if repository is not None:
        document["repository"] = repository
    return document


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
    """Unversioned requests, sent over HTTP as real clients send them.

    Attributes:
        feed: The request of a version-only probe (the abort back to P).
        outputs: Output names of that request.
        timeout_s: Bound of one request, in s.
        golden: C's golden rows and recorded outputs; a probe that must answer as C
            sends these and must get the recorded outputs back within tolerance.
        target: C's version.
    """

    feed: dict[str, np.ndarray]
    outputs: list[str]
    timeout_s: float
    golden: GoldenProbe | None = None
    target: int | None = None

    def answer(self, inference: TritonInference, model: str,
               expected: int | None) -> tuple[str, list[str]]:
        """The version that answered, and how its outputs differ from those recorded."""
        if self.golden is not None and expected == self.target:
            answer = inference.infer(model, self.golden.inputs,
                                     outputs=self.golden.output_names)
            return answer.model_version, self.golden.mismatches(answer.outputs)
        return inference.infer(model, self.feed, outputs=self.outputs).model_version, []


#: Why a replica stops when another one failed the phase (a forward phase stops them all).
_CANCELLED = "stopped: the phase failed on another replica"


@dataclass(frozen=True)
class _PhaseClock:
    """One replica's phase in time: its deadline, and when each outcome came.

    Attributes:
        swap_start: The swap's start (time.monotonic()), the origin of ``at_s``.
        began: When this replica's phase began (time.monotonic()).
        deadline: When the phase must be over (time.monotonic()).
    """

    swap_start: float
    began: float
    deadline: float

    def past_deadline(self) -> bool:
        return time.monotonic() > self.deadline

    def outcome(self, ok: bool, reason: str | None = None,
                answered_at: float | None = None) -> _Outcome:
        now = time.monotonic()
        return _Outcome(ok, reason, now - self.swap_start, now - self.began, answered_at)


def _run_phase_on(server: TritonServer, phase: Phase, *, model: str, swap_start: float,
                  deadline: float, probe: _Probe,
                  cancel: threading.Event | None = None) -> _Outcome:
    """Load the phase's config on one replica and check it serves the expected version.

    The HTTP inference client is made and closed in this thread, so no connection is
    shared between threads (tritonclient.http's clients are not meant to be).

    Fails fast: a replica that refuses connections fails at once (gRPC control) or after
    :data:`UNREACHABLE_GRACE_S` (probes); once ``cancel`` is set (another replica failed
    this phase) the replica sends nothing more and stops waiting.
    """
    stop = cancel or threading.Event()
    clock = _PhaseClock(swap_start, time.monotonic(), deadline)
    inference = TritonInference(server.endpoint.http, timeout_s=probe.timeout_s)
    try:
        if phase.config is None:
            return _unload_on(server, model, clock)
        return _load_on(server, phase, phase.config, model=model, clock=clock, stop=stop,
                        probe=probe, inference=inference)
    except ModelshipError as exc:
        return clock.outcome(False, exc.message)
    except Exception as exc:  # noqa: BLE001 - a client bug fails this replica, not the swap
        return clock.outcome(False, f"{type(exc).__name__}: {exc}")
    finally:
        inference.close()


def _unload_on(server: TritonServer, model: str, clock: _PhaseClock) -> _Outcome:
    """The unload phase (the abort of a first deploy): the replica must serve nothing."""
    if clock.past_deadline():
        return clock.outcome(False, "deadline passed before the unload was sent")
    server.unload_model(model)
    while server.is_model_ready(model):
        if clock.past_deadline():
            return clock.outcome(False, f"{model} still ready after the unload deadline")
        time.sleep(POLL_INTERVAL_S)
    return clock.outcome(True)


def _load_on(server: TritonServer, phase: Phase, config: ModelConfig, *, model: str,
             clock: _PhaseClock, stop: threading.Event, probe: _Probe,
             inference: TritonInference) -> _Outcome:
    """Send the phase's full config, wait until its version is READY, then probe it.

    Nothing is sent past the deadline or once ``stop`` is set, so a late thread never
    changes a replica after the abort began; a forward load that returns past the deadline
    fails (the abort's load is waited for: it brings P back).
    """
    if clock.past_deadline():  # a late thread must not change a replica any more
        return clock.outcome(False, f"deadline passed before {phase.name} was sent")
    if stop.is_set():
        return clock.outcome(False, f"{_CANCELLED}; {phase.name} was not sent")
    server.load_model(model, config_json=to_json(config))
    if clock.past_deadline() and phase.name != ABORT:
        return clock.outcome(False, f"the load took {time.monotonic() - clock.began:.1f} s, "
                             "past the deadline")
    expected = str(phase.expect_version)
    while not server.is_model_ready(model, expected):
        if clock.past_deadline():
            return clock.outcome(False, f"v{expected} not ready before the deadline")
        if stop.is_set():
            return clock.outcome(False, _CANCELLED)
        time.sleep(POLL_INTERVAL_S)
    if not phase.probe:
        return clock.outcome(True)
    return _await_answer(inference, probe, model=model, version=phase.expect_version,
                         clock=clock, stop=stop)


def _await_answer(inference: TritonInference, probe: _Probe, *, model: str,
                  version: int | None, clock: _PhaseClock, stop: threading.Event) -> _Outcome:
    """Probe until ``version`` answers an unversioned request, with C's recorded outputs.

    Another version answering, or an error, is retried until the deadline; a replica
    unreachable for :data:`UNREACHABLE_GRACE_S` fails at once (it died); the right version
    with other outputs fails for good (other bytes serve under that number).
    """
    expected = str(version)
    last = "no probe sent"
    unreachable_since: float | None = None
    while True:
        try:
            answered, mismatches = probe.answer(inference, model, version)
            unreachable_since = None
        except Unreachable as exc:
            answered, mismatches, last = "", [], exc.message
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since >= UNREACHABLE_GRACE_S:
                return clock.outcome(False, f"unreachable for {UNREACHABLE_GRACE_S:g} s: {last}")
        except ModelshipError as exc:
            answered, mismatches, last = "", [], exc.message
        if answered == expected and mismatches:
            return clock.outcome(False, f"v{expected} answered the golden probe with outputs "
                                 f"that differ from those recorded at staging: "
                                 f"{'; '.join(mismatches)}")
        if answered == expected:
            return clock.outcome(True, answered_at=time.monotonic() - clock.swap_start)
        if answered:
            last = f"a probe was answered by v{answered}, not v{expected}"
        if clock.past_deadline():
            return clock.outcome(False, f"{last} (deadline passed)")
        if stop.is_set():
            return clock.outcome(False, _CANCELLED)
        time.sleep(POLL_INTERVAL_S)


def apply_config(server: TritonServer, *, model: str, config: ModelConfig, version: int,
                 golden: GoldenProbe, timeout_s: float, probe_timeout_s: float,
                 name: str = "reconcile") -> tuple[bool, str | None, float]:
    """Load ``config`` on one replica, wait for ``version`` and check the golden probe.

    Returns:
        ``(ok, why not, seconds)``; the same checks as a swap phase (fast failure on an
        unreachable replica, recorded outputs within tolerance).
    """
    phase = Phase(name, config, version, probe=True)
    probe = _Probe({}, [], probe_timeout_s, golden=golden, target=version)
    _warm([server])  # the clock times the server, not our imports
    start = time.monotonic()
    outcome = _run_phase_on(server, phase, model=model, swap_start=start,
                            deadline=start + timeout_s, probe=probe)
    return outcome.ok, outcome.reason, outcome.seconds


def _warm(servers: Iterable[TritonServer]) -> None:
    """Import the HTTP probe's client and build each replica's gRPC client, with no I/O,
    before a phase's deadline starts: on a loaded machine that import alone took seconds,
    and a deadline meant for a replica's silence must not count it (a no-op once done)."""
    warm_http()
    for server in servers:
        server.warm()


def _run_phase(servers: dict[str, TritonServer], names: Sequence[str], phase: Phase, *,
               model: str, swap_start: float, policy: SwapPolicy,
               probe: _Probe, stop_on_failure: bool = True) -> dict[str, _Outcome]:
    """Run a phase on the named replicas in parallel; a replica past the deadline fails.

    With ``stop_on_failure`` (forward phases), the first failure stops the others: they
    send nothing more and stop waiting, so the abort starts as soon as their in-flight
    load call returns, not at the deadline. The abort phase runs to the end everywhere.
    The deadline starts once the local work is done (:func:`_warm`).
    """
    _warm([servers[name] for name in names])
    deadline = time.monotonic() + policy.deadline_s
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=max(1, len(names)),
                              thread_name_prefix=f"swap-{phase.name}")
    futures: dict[str, Future[_Outcome]] = {}
    pending: set[Future[_Outcome]] = set()
    join_by = deadline + JOIN_GRACE_S
    try:
        # A stop while the threads are handed out would leave a started one unwaited (its
        # late load could land after the abort's): held until all are out, then raised here.
        with deferred(f"the {phase.name} phase of {model} starts", say=None) as held:
            for name in names:
                futures[name] = pool.submit(
                    _run_phase_on, servers[name], phase, model=model, swap_start=swap_start,
                    deadline=deadline, probe=probe, cancel=cancel if stop_on_failure else None)
        for signum in held:
            signal.raise_signal(signum)
        pending = set(futures.values())
        while pending:
            done, pending = wait(pending, timeout=max(0.0, join_by - time.monotonic()),
                                 return_when=FIRST_COMPLETED)
            if not done:
                break
            if stop_on_failure and any(not _outcome_of(f, swap_start).ok for f in done):
                cancel.set()
    except BaseException:
        # Stopped (a signal, a cancel) while replicas work: they send nothing more, and the
        # loads in flight end before the caller's abort sends P, so no late C load lands
        # after it (bounded by the deadline, as always).
        cancel.set()
        with deferred(f"the {phase.name} phase of {model} stops", say=None):
            wait(set(futures.values()), timeout=max(0.0, join_by - time.monotonic()))
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=False, cancel_futures=True)  # a stuck gRPC load must not hold the abort
    results: dict[str, _Outcome] = {}
    for name, future in futures.items():
        if future.done():
            results[name] = _outcome_of(future, swap_start)
        else:
            at = time.monotonic() - swap_start
            results[name] = _Outcome(False, f"no outcome within the deadline "
                                     f"({policy.deadline_s:g} s)", at, policy.deadline_s)
    return results


# --------------------------------------------------------------------------------------
# the swap


@dataclass(frozen=True)
class _Candidate:
    config: ModelConfig
    verified: VerifiedVersion | None
    error: StagingError | None


def _read_candidate(storage: S3Storage, *, model: str, target: int, repository_prefix: str,
                    signing_key: bytes) -> _Candidate:
    """C's staged config, verified: signed manifest, every byte streamed and hashed.

    When C does not verify, its config is still read (unverified) so that the plan can
    tell a no-op, which changes nothing, from a swap, which is then refused.
    """
    try:
        verified = read_verified(storage, model=model, version=target,
                                 repository_prefix=repository_prefix, deep=True,
                                 signing_key=signing_key)
    except StagingError as exc:
        config = ModelConfig(name=model)
        key = f"{version_prefix(repository_prefix, model, target)}/{CONFIG_NAME}"
        try:
            config = from_pbtxt(storage.get_bytes(key).decode())
        except ModelshipError:
            pass
        return _Candidate(config, None, exc)
    if verified.probe is None:
        error = StagingError(
            f"{model}/{target} was staged without a golden probe (the outputs recorded at "
            "staging that every replica must reproduce), so what serves could not be checked",
            hint=f"stage it again with this modelship (delete s3://{storage.bucket}/"
            f"{version_prefix(repository_prefix, model, target)}/ if it is not serving, "
            f"then `modelship stage {model} --version {target}`)",
            model=model, version=target,
        )
        return _Candidate(from_pbtxt(verified.config_pbtxt), None, error)
    return _Candidate(from_pbtxt(verified.config_pbtxt), verified, None)


PIN_SIGNATURE_METADATA = "modelship-pin-signature"


def pin_signature(body: bytes, signing_key: bytes) -> str:
    """HMAC-SHA256 (hex) of a production pin's bytes, kept in its S3 metadata."""
    return hmac.new(signing_key, b"modelship-pin:" + body, hashlib.sha256).hexdigest()


def _write_model_config(storage: S3Storage, *, model: str, config: ModelConfig,
                        repository_prefix: str, signing_key: bytes) -> bool:
    """Pin production: ``P/<model>/config.pbtxt`` becomes the config that serves, signed.

    Its ``version_policy`` names the production version; reconcile reads it back, and
    refuses it unless the signature (S3 metadata) verifies with the same key.

    Returns:
        False when the same pin, validly signed, was already there.
    """
    key = f"{model_prefix(repository_prefix, model)}/{CONFIG_NAME}"
    body = to_pbtxt(config).encode()
    signature = pin_signature(body, signing_key)
    head = storage.head(key)
    if head is not None and head["metadata"].get(PIN_SIGNATURE_METADATA) == signature \
            and storage.get_bytes(key) == body:
        return False
    storage.put_bytes(key, body, metadata={SHA256_METADATA: hashlib.sha256(body).hexdigest(),
                                           PIN_SIGNATURE_METADATA: signature})
    return True


def _metrics_texts(replicas: Sequence[TritonServer], timeout_s: float) -> dict[str, str | None]:
    """Every replica's metrics text, in parallel; None where the scrape failed."""

    def one(server: TritonServer) -> str | None:
        try:
            return scrape_text(server.endpoint.metrics, timeout_s)
        except ModelshipError:
            return None

    with ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
        return dict(zip([s.name for s in replicas], pool.map(one, replicas), strict=True))


def _weights_reader(storage: S3Storage, *, model: str, target: int, repository_prefix: str,
                    config: ModelConfig) -> Callable[[], int]:
    """Reads C's ONNX initializer bytes from its staged model file (the estimate's input;
    called only on a GPU fleet without a canary measurement)."""
    def read() -> int:
        name = config.default_model_filename or "model.onnx"
        key = f"{version_prefix(repository_prefix, model, target)}/{name}"
        graph = onnx.load_from_string(storage.get_bytes(key))
        return initializer_bytes(graph)

    return read


@dataclass(frozen=True)
class RecordedFootprint:
    """C's GPU footprint for the headroom preflight of a swap outside a release.

    Attributes:
        bytes_per_gpu: What C's canary measured (rise of ``nv_gpu_memory_used_bytes`` when
            C loaded next to P), bytes; None: the swap estimates it from C's initializers.
        source: ``canary`` (read from a release record) or ``estimate``.
        release_id: The release record the measurement was read from.
        detail: Why, in words (which record, or why none was usable).
    """

    bytes_per_gpu: int | None
    source: Literal["canary", "estimate"]
    release_id: str | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_per_gpu": self.bytes_per_gpu, "source": self.source,
                "release_id": self.release_id, "detail": self.detail}


def _measured_bytes(record: ReleaseRecord) -> int | None:
    gpu = (record.gates or {}).get("gpu") or {}
    value = gpu.get("candidate_bytes") if isinstance(gpu, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return None
    return int(value)


def recorded_footprint(records: Iterable[ReleaseRecord], *,
                       digest: Mapping[str, Any]) -> RecordedFootprint:
    """C's footprint as its canary measured it, from the release ledger (pure).

    Takes the newest record of C (same model and version) whose canary measured a GPU
    footprint (``gates.gpu.candidate_bytes`` > 0; a CPU canary measures none), whatever
    its verdict: a measurement is a fact about C's bytes. It is used only when that
    record's candidate digest is the staged one (:func:`modelship.ledger.same_candidate`,
    manifest sha256 included): a re-staged version is other bytes, so the swap estimates.

    Args:
        records: The model's ledger records (any order).
        digest: C's staged digest (:func:`tasks.evidence.read_candidate_digest`).
    """
    model, version = digest.get("model"), digest.get("version")
    for entry in sort_newest_first(records):
        bytes_ = _measured_bytes(entry)
        candidate = entry.candidate or {}
        if bytes_ is None or candidate.get("model") != model \
                or candidate.get("version") != version:
            continue
        if not same_candidate(candidate, dict(digest)):
            return RecordedFootprint(
                None, "estimate", None,
                f"the newest canary measurement of {model} v{version} (release {entry.id}, "
                f"{bytes_} B) is of other bytes (manifest "
                f"{str(candidate.get('manifest_sha256'))[:12]}, staged "
                f"{str(digest.get('manifest_sha256'))[:12]}): estimated from the initializers")
        return RecordedFootprint(
            bytes_, "canary", entry.id,
            f"measured by the canary of release {entry.id} (rise of nv_gpu_memory_used_bytes "
            f"when v{version} loaded; manifest {str(digest.get('manifest_sha256'))[:12]})")
    return RecordedFootprint(None, "estimate", None,
                             f"no canary of {model} v{version} measured a GPU footprint (none "
                             "on record, or it ran on a CPU canary): estimated from the "
                             "initializers")


def _states_dict(states: dict[str, ReplicaState]) -> dict[str, dict[str, Any]]:
    return {name: state.to_dict() for name, state in states.items()}


@dataclass(frozen=True)
class SwapTarget:
    """The version to serve on every replica: where it is staged, and how a replica shows
    that it serves it.

    Attributes:
        model: Triton model name.
        version: C, a staged version.
        storage: The S3 client of the repository Triton serves.
        repository_prefix: The repository prefix inside the bucket.
        signing_key: The manifest signing key (:func:`modelship.signing.key_bytes`); C's
            manifest must be signed with it.
        probe_feed: One small valid request (input name to array, batch first), for the
            version-only probe of the abort back to P. Probes that must answer as C send
            C's golden rows from its signed manifest and check the recorded outputs.
        probe_outputs: Output names the probe asks for.
        footprint_bytes: C's GPU footprint per GPU measured by the canary
            (``CanaryResult.candidate_bytes``, or read back from the ledger by
            :func:`recorded_footprint`), bytes; None: estimate it from C's initializers.
        footprint_detail: Where ``footprint_bytes`` comes from, for the plan and report.
    """

    model: str
    version: int
    storage: S3Storage
    repository_prefix: str
    signing_key: bytes
    probe_feed: dict[str, np.ndarray]
    probe_outputs: list[str]
    footprint_bytes: int | None = None
    footprint_detail: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, storage: S3Storage, *, model: str,
                      version: int, probe_feed: dict[str, np.ndarray],
                      probe_outputs: list[str], footprint_bytes: int | None = None,
                      footprint_detail: str | None = None) -> SwapTarget:
        """C staged in the settings' repository, verified with the settings' signing key."""
        return cls(model=model, version=version, storage=storage,
                   repository_prefix=settings.repository_prefix,
                   signing_key=key_bytes(settings.manifest_signing_key),
                   probe_feed=probe_feed, probe_outputs=probe_outputs,
                   footprint_bytes=footprint_bytes, footprint_detail=footprint_detail)


@dataclass(frozen=True)
class SwapOptions:
    """How the swap runs: the policy's timing, and what the caller asks of it.

    Attributes:
        policy: ``pause_batching``, ``pause_mode``, the per-phase ``deadline_s`` and
            ``probe_timeout_s``.
        gpu: The policy's GPU settings (``headroom_bytes`` for the headroom preflight);
            None takes their defaults.
        http_timeout_s: Upper bound of one probe request, in s (the policy's
            ``probe_timeout_s`` applies when lower).
        dry_run: Observe the fleet, verify the candidate and return the plan; change
            nothing.
        converge: Repair a mixed fleet (a crashed coordinator left replicas on different
            versions or configs, or some are unreachable) instead of refusing it: every
            reachable replica gets C's full production config and must answer the golden
            probe (plan kind ``converge``; unreachable replicas are listed as skipped).
    """

    policy: SwapPolicy
    gpu: GpuPolicy | None = None
    http_timeout_s: float = 10.0
    dry_run: bool = False
    converge: bool = False


def swap_fleet(replicas: list[TritonServer], target: SwapTarget, options: SwapOptions, *,
               progress: Progress = quiet) -> SwapReport:
    """Serve ``target``'s version on every replica, or on none of them.

    With ``options.dry_run`` it observes the fleet, verifies the candidate and returns the
    plan without changing anything.

    C's staged config is loaded (and pinned) in the fleet's form: the CPU form of a GPU
    config on a CPU fleet (:func:`modelship.triton.target.render_for_servers`); the report's
    ``serving_form`` says which and how it was decided. A fleet of GPU and CPU servers is
    refused (PreflightError) before anything changes.

    Args:
        replicas: The production fleet (not the canary).
        target: C, where it is staged, and its probes and GPU footprint.
        options: The policy's timing, ``dry_run`` and ``converge``.
        progress: Receives one human line per step.

    Returns:
        The report; ``kind == "noop"`` when every replica already served C.

    Raises:
        StagingError: C's manifest is missing, unsigned or forged, a staged byte differs
            from it, or it records no golden probe (exit 3); nothing was changed.
        PreflightError: a surprise in the fleet, or C does not fit next to P on some
            replica's GPU (exit 1, with every replica's free and needed bytes); nothing was
            changed.
        SwapAborted: a phase failed or timed out; every replica ran the abort phase. The
            message lists each replica's state; ``details["report"]`` is the report.
    """
    swap_start = time.monotonic()
    model = target.model
    pre = _preflight(replicas, target, options, progress)
    report = _preflight_report(model, pre, dry_run=options.dry_run)
    if options.dry_run or pre.plan.kind == "noop":
        if not options.dry_run and pre.read.verified is not None:
            _pin_production(target, pre.candidate)  # a no-op still (re)signs the pin
        report.final_states = _states_dict(replica_states(start(pre.plan)))
        report.total_s = time.monotonic() - swap_start
        return report

    assert pre.read.verified is not None  # plan_swap refused an unverified candidate
    probe = _Probe(target.probe_feed, target.probe_outputs,
                   min(options.policy.probe_timeout_s, options.http_timeout_s),
                   golden=pre.read.verified.probe, target=target.version)
    run = _execute(pre.plan, {s.name: s for s in replicas}, report, model=model,
                   swap_start=swap_start, policy=options.policy, probe=probe,
                   progress=progress)
    states = replica_states(run)
    report.final_states = _states_dict(states)
    answered = list(report.timeline.values())
    report.skew_ms = (max(answered) - min(answered)) * 1000 if answered else None
    action = next_action(run)
    if isinstance(action, Aborted):
        _raise_aborted(report, pre.plan, states, action.reason, target=target,
                       swap_start=swap_start, progress=progress)
    assert isinstance(action, Done)
    _pin_production(target, pre.candidate)
    report.total_s = time.monotonic() - swap_start
    skew = f"{report.skew_ms:.0f} ms" if report.skew_ms is not None else "n/a"
    progress(f"{model}: every replica serves v{target.version} ({report.total_s:.1f} s, "
             f"skew {skew})")
    return report


@dataclass(frozen=True)
class _Preflight:
    """What the swap decided before changing anything (DESIGN §4, step 1).

    Attributes:
        read: C as read from the repository: its config, and verified or why not.
        candidate: C's staged config in the fleet's form: what serves and gets pinned.
        form: How that form was decided (per replica, what its metrics said).
        headroom: The GPU headroom preflight; None for a no-op.
        lines: The plan in words (each also went to ``progress``).
    """

    plan: SwapPlan
    read: _Candidate
    candidate: ModelConfig
    form: FleetTarget
    headroom: HeadroomPlan | None
    lines: list[str]


def _preflight(replicas: list[TritonServer], target: SwapTarget, options: SwapOptions,
               progress: Progress) -> _Preflight:
    """Observe the fleet, verify C and plan: every surprise, and a GPU where C does not fit
    next to P, refuses the swap here, before anything changes."""
    model, version = target.model, target.version
    progress(f"{model}: observing {len(replicas)} replica(s) and candidate v{version}")
    observed = observe_fleet(replicas, model)
    # One scrape per replica: it tells the fleet's form (cpu/gpu) and feeds the headroom.
    texts = _metrics_texts(replicas, options.http_timeout_s)
    progress(f"{model}: verifying v{version} (manifest signature, sha256 of every staged byte)")
    read = _read_candidate(target.storage, model=model, target=version,
                           repository_prefix=target.repository_prefix,
                           signing_key=target.signing_key)
    # What the fleet serves and what gets pinned is the staged config in the fleet's form,
    # so digests compare like with like (a no-op stays a no-op) and a restarted replica
    # loads what it can run.
    candidate, form = render_for_servers(read.config, replicas,
                                         timeout_s=options.http_timeout_s, texts=texts)
    plan = _plan_or_refuse(observed, target, options, read=read, candidate=candidate)
    headroom = None if plan.kind == "noop" else _plan_headroom(target, options, texts,
                                                               candidate)
    lines = [*plan.describe(), f"{model}: {form.describe()}",
             *(headroom.lines if headroom is not None else [])]
    if headroom is not None and not headroom.fits and plan.kind == "converge":
        lines.append(f"{model}: GPU headroom is short, but a converge goes ahead: a load "
                     "that does not fit fails and leaves the replica on what it served")
    for line in lines:
        progress(line)
    if headroom is not None and headroom.footprint is not None and plan.kind != "converge":
        check_headroom(model, version, headroom.checks, headroom.footprint)
    return _Preflight(plan, read, candidate, form, headroom, lines)


def _plan_or_refuse(observed: Sequence[Observed], target: SwapTarget, options: SwapOptions,
                    *, read: _Candidate, candidate: ModelConfig) -> SwapPlan:
    """The swap's plan (:func:`plan_swap`). When C did not verify, a refusal is a
    StagingError (exit 3): a rejection by validation, whatever else the fleet shows."""
    model, policy = target.model, options.policy
    production = next((o.live_config for o in observed if o.live_config is not None), None)
    try:
        return plan_swap(model, [o.view for o in observed], target=target.version,
                         candidate_config=candidate, production_config=production,
                         pause_batching=policy.pause_batching,
                         candidate_verified=read.error is None,
                         pause_at_switch=policy.pause_mode == "at_switch",
                         candidate_problem=read.error.message if read.error else None,
                         converge=options.converge)
    except PreflightError as exc:
        if read.error is None:
            raise
        others = [p for p in exc.details.get("problems", []) if "did not verify" not in p]
        also = f" (also: {'; '.join(others)})" if others else ""
        raise StagingError(
            f"swap of {model} to v{target.version} refused before changing anything: "
            f"{read.error.message}{also}",
            hint=read.error.hint, model=model, target=target.version,
            problems=exc.details.get("problems", []),
        ) from read.error


def _plan_headroom(target: SwapTarget, options: SwapOptions, texts: Mapping[str, str | None],
                   candidate: ModelConfig) -> HeadroomPlan:
    """The GPU headroom preflight: C's footprint (the canary's measurement, else estimated
    from its initializers) plus the policy's headroom, against every GPU's free memory."""
    return plan_headroom(
        target.model, target.version, texts, cfg=candidate,
        measured_bytes=target.footprint_bytes, measured_detail=target.footprint_detail,
        weights_bytes=_weights_reader(target.storage, model=target.model,
                                      target=target.version,
                                      repository_prefix=target.repository_prefix,
                                      config=candidate),
        headroom_bytes=(options.gpu or GpuPolicy()).headroom_bytes)


def _preflight_report(model: str, pre: _Preflight, *, dry_run: bool) -> SwapReport:
    """The report as the preflight leaves it: the plan in words, the GPU headroom, the
    serving form and what verifying C took."""
    plan = pre.plan
    report = SwapReport(model, plan.kind, plan.from_version, plan.to_version,
                        plan.pause_batching, plan=pre.lines, dry_run=dry_run,
                        headroom=pre.headroom.to_dict() if pre.headroom is not None else None,
                        serving_form=pre.form.to_dict())
    if pre.read.verified is not None:
        report.verify_s = pre.read.verified.seconds
        report.verified_bytes = pre.read.verified.bytes_hashed
    return report


def _pin_production(target: SwapTarget, candidate: ModelConfig) -> None:
    """Pin C as production (:func:`_write_model_config`): what a restarted replica and
    reconcile load."""
    _write_model_config(target.storage, model=target.model,
                        config=with_versions(candidate, [target.version]),
                        repository_prefix=target.repository_prefix,
                        signing_key=target.signing_key)


def _raise_aborted(report: SwapReport, plan: SwapPlan, states: dict[str, ReplicaState],
                   reason: str, *, target: SwapTarget, swap_start: float,
                   progress: Progress) -> NoReturn:
    """Close the report of an aborted swap and raise SwapAborted with every replica's
    state, and the repair when some replica may not be back."""
    model, version = target.model, target.version
    report.aborted = True
    report.reason = reason
    report.total_s = time.monotonic() - swap_start
    lines = "; ".join(s.describe() for s in states.values())
    progress(f"{model}: swap aborted ({reason}); {lines}")
    stranded = [s.name for s in states.values() if not s.ok]
    back_to = f"v{plan.from_version}" if plan.kind != "converge" else f"v{version}"
    what = f"converge of {model} to v{version}" if plan.kind == "converge" else \
        f"swap of {model} v{plan.from_version} -> v{version}"
    raise SwapAborted(
        f"{what} aborted: {reason}. Replica states: {lines}",
        hint=(f"replicas {', '.join(stranded)} may not serve {back_to}: check them with "
              f"`modelship status {model} --json`; `modelship reconcile {model}` brings "
              "every reachable replica to the recorded production" if stranded else
              f"every replica serves {back_to} again; fix the cause and retry"),
        model=model, from_version=plan.from_version, to_version=version,
        report=report.to_dict(),
    )


def _outcome_of(future: Future[_Outcome], swap_start: float) -> _Outcome:
    """A finished replica's outcome; one that raised (any exception, a BaseException from
    the replica's client included) failed its phase."""
    error = None if future.cancelled() else future.exception()
    if future.cancelled() or error is not None:
        at = time.monotonic() - swap_start
        why = "cancelled" if error is None else f"{type(error).__name__}: {error}"
        return _Outcome(False, why, at, 0.0)
    return future.result()


def _execute(plan: SwapPlan, servers: dict[str, TritonServer], report: SwapReport, *,
             model: str, swap_start: float, policy: SwapPolicy, probe: _Probe,
             progress: Progress) -> SwapRun:
    """Walk the plan's run: ask next_action, perform it, record every outcome.

    Any way out of a forward phase (an exception of any type, SIGINT, SIGTERM, a Prefect
    cancel) aborts: the replicas still pending fail with the reason, the abort phase runs
    on every replica with signals held back (:func:`modelship.signals.deferred`), and the
    exception goes on up. The fleet never stays mixed because the coordinator was told to
    stop."""
    box = [start(plan)]  # the run as last recorded, for the abort
    try:
        return _walk(box, plan, servers, report, model=model, swap_start=swap_start,
                     policy=policy, probe=probe, progress=progress)
    except BaseException as exc:
        run = box[0]
        why = f"stopped: {type(exc).__name__}: {exc}".rstrip(": ")
        with deferred(f"the swap of {model} aborts", say=progress):
            progress(f"{model}: {why}; aborting the swap on every replica")
            action = next_action(run)
            if isinstance(action, RunPhase):
                at = time.monotonic() - swap_start
                for name in action.replicas:
                    run = record(run, name, action.phase.name, False, reason=why, at=at)
            box[0] = run
            if isinstance(next_action(run), AbortPhase):
                _walk(box, plan, servers, report, model=model, swap_start=swap_start,
                      policy=policy, probe=probe, progress=progress)
            report.aborted = True
            report.reason = why
        raise


def _walk(box: list[SwapRun], plan: SwapPlan, servers: dict[str, TritonServer],
          report: SwapReport, *, model: str, swap_start: float, policy: SwapPolicy,
          probe: _Probe, progress: Progress) -> SwapRun:
    """Perform next_action until the run is done or aborted. ``box[0]`` is the run as
    last recorded (read by the abort when an exception cuts the walk short)."""
    while True:
        run = box[0]
        action = next_action(run)
        if not isinstance(action, RunPhase | AbortPhase):
            return run
        phase = action.phase
        progress(f"{model}: {phase.describe()} on {', '.join(action.replicas)}")
        began = time.monotonic()
        outcomes = _run_phase(servers, action.replicas, phase, model=model,
                              swap_start=swap_start, policy=policy, probe=probe,
                              stop_on_failure=isinstance(action, RunPhase))
        report.phases.append(PhaseReport(
            phase.name, began - swap_start, time.monotonic() - began,
            {name: {"ok": o.ok, "reason": o.reason, "seconds": round(o.seconds, 3)}
             for name, o in outcomes.items()}))
        # failures first, so that the run starts aborting at the first failed outcome
        for name, outcome in sorted(outcomes.items(), key=lambda item: item[1].ok):
            if outcome.answered_at_s is not None and phase.expect_version == plan.to_version \
                    and name not in report.timeline and isinstance(action, RunPhase):
                report.timeline[name] = outcome.answered_at_s
            run = box[0] = record(run, name, phase.name, outcome.ok, outcome.reason,
                                  outcome.at_s)
            status = "ok" if outcome.ok else f"FAILED: {outcome.reason}"
            progress(f"{model}: {phase.name} on {name}: {status} ({outcome.seconds:.2f} s)")
