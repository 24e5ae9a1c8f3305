"""The fleet swap (DESIGN §4) as data: a plan, and a run that walks it. Pure, no I/O.

Why pure: the protocol's guarantees (refuse before anything changes, never leave the fleet
mixed) live in which step follows which outcome. Written as a plan plus a state machine,
they are table-tested without servers; :mod:`tasks.swap` only performs the I/O that
:func:`next_action` asks for and feeds the outcomes back through :func:`record`.

:func:`plan_swap` reads what every replica serves and either refuses with one
:class:`~modelship.errors.PreflightError` that lists every surprise, or returns a plan:

- ``noop``: every replica serves exactly the target, with the candidate's serving config.
- ``first_deploy``: no replica serves any version; one ``deploy`` phase loads the
  candidate's production config (``specific [C]``). Its abort unloads the model again,
  which costs nothing because nothing was served before.
- ``swap``: every replica serves the same single version P with the same serving digest.
  With ``pause_batching``: ``pause_batching`` (P without dynamic batching, ``[P]``),
  ``switch`` (C without dynamic batching, ``[C]``, probed), ``resume_batching`` (C's full
  production config, ``[C]``). Without it: one probed ``switch`` with C's full config. The
  abort phase restores P's production config (``[P]``). P may equal C: a fleet that serves
  the target with another config (say, stuck with batching paused after a crash) is
  reconfigured by the same phases instead of being reported as a no-op.
- ``converge`` (only with ``converge=True``): the fleet is mixed (a crashed coordinator
  left some replicas on V and some on P, or with other configs). One probed ``converge``
  phase loads C's full production config (``specific [C]``) on every *reachable*
  replica; unreachable ones are listed as skipped (reconcile brings them over when they
  come back). A mixed fleet has no single version to go back to, so its abort phase
  re-sends the same config everywhere and reports who still failed.

The run::

    running(phase i) --every replica ok--> running(phase i+1) --last phase ok--> done
        | any failure or timeout
        v
    aborting --abort phase recorded on every replica (ok or not)--> aborted

Every replica runs the abort phase, including those that had not moved, so the fleet ends
on one version; a replica whose abort failed is reported as such, never silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NoReturn

from modelship.errors import PreflightError
from modelship.triton.model_config import (
    ModelConfig,
    serving_digest,
    to_json,
    with_versions,
    without_dynamic_batching,
)

__all__ = [
    "ABORT",
    "CONVERGE",
    "DEPLOY",
    "PAUSE",
    "RESUME",
    "SWITCH",
    "AbortPhase",
    "Aborted",
    "Action",
    "Done",
    "Phase",
    "PlanKind",
    "ReplicaState",
    "ReplicaView",
    "RunPhase",
    "RunStatus",
    "StepRecord",
    "SwapPlan",
    "SwapRun",
    "expire",
    "next_action",
    "plan_swap",
    "record",
    "replica_states",
    "start",
]

PlanKind = Literal["noop", "first_deploy", "swap", "converge"]
RunStatus = Literal["running", "aborting", "done", "aborted"]

PAUSE, SWITCH, RESUME, DEPLOY, CONVERGE, ABORT = (
    "pause_batching", "switch", "resume_batching", "deploy", "converge", "abort")


# --------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class ReplicaView:
    """What one replica serves, as observed just before planning.

    Attributes:
        name: The replica's name (unique in the fleet).
        live: It answered its health check.
        ready_versions: Versions of the model it reports READY, ascending.
        serving_digest: :func:`~modelship.triton.model_config.serving_digest` of its live
            config; None when it serves nothing.
        problem: Why it is not live, for the refusal message.
    """

    name: str
    live: bool
    ready_versions: tuple[int, ...]
    serving_digest: str | None
    problem: str | None = None


@dataclass(frozen=True)
class Phase:
    """One step that every replica performs in parallel.

    Attributes:
        name: ``pause_batching``, ``switch``, ``resume_batching``, ``deploy`` or ``abort``.
        config: The full config to load as an override (it replaces, never merges); None
            means unload the model (the abort of a first deploy).
        expect_version: The version the replica must report READY afterwards; None when it
            must serve nothing.
        probe: An unversioned request must also be answered by ``expect_version``.
    """

    name: str
    config: ModelConfig | None
    expect_version: int | None
    probe: bool

    def describe(self) -> str:
        """One line for the plan printout."""
        if self.config is None:
            return f"{self.name}: unload the model"
        batching = "on" if self.config.HasField("dynamic_batching") else "off"
        versions = list(self.config.version_policy.specific.versions)
        probe = f", a probe must answer as v{self.expect_version}" if self.probe else ""
        return f"{self.name}: load specific {versions}, dynamic batching {batching}{probe}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config_json": to_json(self.config) if self.config is not None else None,
            "expect_version": self.expect_version,
            "probe": self.probe,
        }


@dataclass(frozen=True)
class SwapPlan:
    """What the swap will do, decided before anything changes.

    Attributes:
        model: Triton model name.
        kind: ``noop``, ``first_deploy`` or ``swap``.
        replicas: Every replica's name, in fleet order.
        from_version: P, the version served now (None on a first deploy).
        to_version: C, the target.
        pause_batching: Dynamic batching is off around the switch.
        phases: The forward phases, in order (empty for ``noop``).
        abort: The phase that undoes them on every replica (None for ``noop``).
        skipped: Replicas left out because they are unreachable (``converge`` only).
        mixed: What each replica served before, when the fleet was mixed (``converge``).
    """

    model: str
    kind: PlanKind
    replicas: tuple[str, ...]
    from_version: int | None
    to_version: int
    pause_batching: bool
    phases: tuple[Phase, ...] = ()
    abort: Phase | None = None
    skipped: tuple[str, ...] = ()
    mixed: tuple[str, ...] = ()

    def describe(self) -> list[str]:
        """Human lines: what will happen, phase by phase."""
        head = f"{self.model}: {self.kind}"
        skipped = [f"  skipped (unreachable; reconcile brings them to production when they "
                   f"are back): {', '.join(self.skipped)}"] if self.skipped else []
        if self.kind == "noop":
            which = "every reachable replica" if self.skipped else "every replica"
            return [f"{head}: {which} already serves v{self.to_version}; nothing to do",
                    *skipped]
        if self.kind == "converge":
            lines = [f"{head}: the fleet is mixed ({'; '.join(self.mixed)}); every reachable "
                     f"replica ({', '.join(self.replicas)}) converges to v{self.to_version}",
                     *skipped]
            lines += [f"  {p.describe()}" for p in self.phases]
            if self.abort is not None:
                lines.append(f"  on any failure, {self.abort.describe()} (a mixed fleet has "
                             "no single version to go back to)")
            return lines
        source = f"v{self.from_version}" if self.from_version is not None else "nothing"
        lines = [f"{head} {source} -> v{self.to_version} on {', '.join(self.replicas)}"]
        lines += [f"  {p.describe()}" for p in self.phases]
        if self.abort is not None:
            lines.append(f"  on any failure, {self.abort.describe()}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "kind": self.kind,
            "replicas": list(self.replicas),
            "from_version": self.from_version,
            "to_version": self.to_version,
            "pause_batching": self.pause_batching,
            "phases": [p.to_dict() for p in self.phases],
            "abort": self.abort.to_dict() if self.abort is not None else None,
            "skipped": list(self.skipped),
            "mixed": list(self.mixed),
        }


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "none"


def _served(view: ReplicaView) -> str:
    if not view.ready_versions:
        return "nothing"
    return ", ".join(f"v{v}" for v in view.ready_versions)


def _hard_surprises(model: str, replicas: Sequence[ReplicaView]) -> list[str]:
    """Problems no plan can work around, converge or not."""
    if not replicas:
        return [f"no Triton replicas are configured to serve {model}"]
    names = [r.name for r in replicas]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        return [f"replica names are not unique: {dupes}"]
    if not any(r.live for r in replicas):
        return [f"no replica of {model} is live: "
                + "; ".join(f"{r.name}: {r.problem or 'not live'}" for r in replicas)]
    return []


def _fleet_surprises(model: str, replicas: Sequence[ReplicaView]) -> list[str]:
    problems: list[str] = []
    if not replicas:
        return [f"no Triton replicas are configured to serve {model}"]
    names = [r.name for r in replicas]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"replica names are not unique: {dupes}")
    for view in replicas:
        if not view.live:
            why = f": {view.problem}" if view.problem else ""
            problems.append(f"replica {view.name} is not live{why}")
    live = [r for r in replicas if r.live]
    for view in live:
        if len(view.ready_versions) > 1:
            problems.append(f"replica {view.name} serves {len(view.ready_versions)} versions of "
                            f"{model} ({_served(view)}); expected exactly one")
    if len({r.ready_versions for r in live}) > 1:
        served = "; ".join(f"{r.name} serves {_served(r)}" for r in live)
        problems.append(f"replicas disagree on the version of {model}: {served}")
    serving = [r for r in live if r.ready_versions]
    if len({r.serving_digest for r in serving}) > 1:
        digests = "; ".join(f"{r.name} {_short(r.serving_digest)}" for r in serving)
        problems.append(f"replicas serve {model} with different configs (serving digest): "
                        f"{digests}")
    return problems


def plan_swap(
    model: str,
    replicas: Sequence[ReplicaView],
    *,
    target: int,
    candidate_config: ModelConfig,
    production_config: ModelConfig | None,
    pause_batching: bool,
    candidate_verified: bool,
    candidate_problem: str | None = None,
    pause_at_switch: bool = False,
    converge: bool = False,
) -> SwapPlan:
    """Decide the swap from what the fleet serves, or refuse before anything changes.

    Args:
        model: Triton model name.
        replicas: What each replica serves (see :class:`ReplicaView`).
        target: C, the version to serve.
        candidate_config: C's production config (as staged); its version policy is replaced.
        production_config: P's production config (from a replica's live config); None when
            nothing serves.
        pause_batching: Turn dynamic batching off around the switch (the policy default).
        candidate_verified: C's staged files match its manifest.
        candidate_problem: Why C did not verify, for the message.
        pause_at_switch: With ``pause_batching``, skip the separate pause phase: C comes up
            without batching straight from P (one reload fewer; P's instances drain their
            in-flight batches as in a plain reload), and batching resumes once every replica
            answers as C.
        converge: A mixed fleet (replicas not live, on several versions or configs) is
            not refused but converged: every reachable replica gets C's production config
            (a ``converge`` plan). A consistent fleet is planned as without it.

    Raises:
        PreflightError: a replica is not live, serves several versions, the replicas
            disagree on the version or the serving digest, P's config is unknown, or the
            candidate did not verify. Every problem is listed in one message
            (``details["problems"]``).
    """
    problems = _fleet_surprises(model, replicas)
    hard = _hard_surprises(model, replicas) if converge else []
    problems += [p for p in hard if p not in problems]
    if converge and problems and not hard:
        return _plan_converge(model, replicas, target=target,
                              candidate_config=candidate_config,
                              pause_batching=pause_batching,
                              candidate_verified=candidate_verified,
                              candidate_problem=candidate_problem)
    problems += _candidate_problems(model, target, candidate_config)
    names = tuple(r.name for r in replicas)
    served = {r.ready_versions for r in replicas}
    candidate_digest = serving_digest(candidate_config)
    if not problems and served == {(target,)} and \
            {r.serving_digest for r in replicas} == {candidate_digest}:
        return SwapPlan(model, "noop", names, target, target, pause_batching)

    problems += _verification_problems(model, target, candidate_verified, candidate_problem)
    current = next(iter(served)) if len(served) == 1 else ()
    from_version = current[0] if len(current) == 1 else None
    if from_version is not None and production_config is None:
        problems.append(f"the production config of {model}/{from_version} is unknown (no "
                        "live config was read)")
    if problems:
        _refuse("swap", model, target, problems, candidate_verified)

    production_c = with_versions(candidate_config, [target])
    if from_version is None:
        deploy = Phase(DEPLOY, production_c, target, probe=True)
        abort = Phase(ABORT, None, None, probe=False)
        return SwapPlan(model, "first_deploy", names, None, target, pause_batching,
                        (deploy,), abort)

    assert production_config is not None  # checked above
    production_p = with_versions(production_config, [from_version])
    phases = _swap_phases(production_c, production_p, from_version, target,
                          pause_batching=pause_batching, pause_at_switch=pause_at_switch)
    abort = Phase(ABORT, production_p, from_version, probe=True)
    return SwapPlan(model, "swap", names, from_version, target, pause_batching, phases, abort)


def _swap_phases(production_c: ModelConfig, production_p: ModelConfig, from_version: int,
                 target: int, *, pause_batching: bool, pause_at_switch: bool
                 ) -> tuple[Phase, ...]:
    """The forward phases P -> C: with paused batching, C comes up without it and batching
    resumes once every replica answers as C (P pauses first unless ``pause_at_switch``)."""
    if pause_batching and pause_at_switch:
        return (
            Phase(SWITCH, without_dynamic_batching(production_c), target, probe=True),
            Phase(RESUME, production_c, target, probe=False),
        )
    if pause_batching:
        return (
            Phase(PAUSE, without_dynamic_batching(production_p), from_version, probe=False),
            Phase(SWITCH, without_dynamic_batching(production_c), target, probe=True),
            Phase(RESUME, production_c, target, probe=False),
        )
    return (Phase(SWITCH, production_c, target, probe=True),)


def _candidate_problems(model: str, target: int, candidate_config: ModelConfig) -> list[str]:
    """What is wrong with the target itself, whatever the fleet serves."""
    problems = []
    if isinstance(target, bool) or target < 1:
        problems.append(f"target version {target!r} is not a Triton version (an integer >= 1)")
    if candidate_config.name and candidate_config.name != model:
        problems.append(f"the candidate's config names model {candidate_config.name!r}, "
                        f"not {model!r}")
    return problems


def _verification_problems(model: str, target: int, candidate_verified: bool,
                           candidate_problem: str | None) -> list[str]:
    """The candidate's staged files did not match its manifest: checked only when there
    is something to do (a noop serves nothing new)."""
    if candidate_verified:
        return []
    why = f": {candidate_problem}" if candidate_problem else ""
    return [f"candidate {model}/{target} did not verify against its manifest{why}"]


def _refuse(action: str, model: str, target: int, problems: list[str],
            candidate_verified: bool) -> NoReturn:
    """Refuse the plan before anything changes, listing every problem in one message."""
    raise PreflightError(
        f"{action} of {model} to v{target} refused before changing anything: "
        + "; ".join(problems),
        hint=_refusal_hint(model, target, problems, candidate_verified),
        model=model, target=target, problems=problems,
    )


def _plan_converge(model: str, replicas: Sequence[ReplicaView], *, target: int,
                   candidate_config: ModelConfig, pause_batching: bool,
                   candidate_verified: bool, candidate_problem: str | None) -> SwapPlan:
    """The plan for a mixed fleet: every reachable replica to C's production config."""
    problems = _candidate_problems(model, target, candidate_config)
    reachable = [r for r in replicas if r.live]
    names = tuple(r.name for r in reachable)
    skipped = tuple(r.name for r in replicas if not r.live)
    mixed = tuple(f"{r.name} serves {_served(r)}" + (f" ({_short(r.serving_digest)})"
                                                     if r.ready_versions else "")
                  if r.live else f"{r.name} unreachable" for r in replicas)
    candidate_digest = serving_digest(candidate_config)
    if not problems and all(r.ready_versions == (target,) and
                            r.serving_digest == candidate_digest for r in reachable):
        return SwapPlan(model, "noop", names, target, target, pause_batching,
                        skipped=skipped, mixed=mixed)
    problems += _verification_problems(model, target, candidate_verified, candidate_problem)
    if problems:
        _refuse("converge", model, target, problems, candidate_verified)
    production_c = with_versions(candidate_config, [target])
    return SwapPlan(model, "converge", names, None, target, pause_batching,
                    (Phase(CONVERGE, production_c, target, probe=True),),
                    Phase(ABORT, production_c, target, probe=True),
                    skipped=skipped, mixed=mixed)


def _refusal_hint(model: str, target: int, problems: list[str], verified: bool) -> str:
    fleet = [p for p in problems if "did not verify" not in p]
    steps = []
    if fleet:
        steps.append("bring every replica back to one version with one config (start any "
                     "stopped replica; `modelship status "
                     f"{model} --json` shows what each serves), then retry; or converge the "
                     f"fleet on one version: `modelship swap {model} --to V --converge` or "
                     f"`modelship rollback {model}` bring every reachable replica to V")
    if not verified:
        steps.append(f"stage the candidate again (`modelship stage {model} --version {target}`)")
    return "; ".join(steps) or "fix the problems listed, then retry"


# --------------------------------------------------------------------------------------
# the run


@dataclass(frozen=True)
class StepRecord:
    """The outcome of one phase on one replica.

    Attributes:
        at: Seconds from the swap's start when the outcome was known; None if untimed.
    """

    replica: str
    phase: str
    ok: bool
    reason: str | None = None
    at: float | None = None


@dataclass(frozen=True)
class SwapRun:
    """A swap in progress; every update returns a new run.

    Attributes:
        plan: The plan being walked.
        status: ``running``, ``aborting``, ``done`` or ``aborted``.
        phase_index: Index of the current forward phase.
        records: Every outcome, in the order recorded.
        failed_phase: The phase whose failure started the abort.
    """

    plan: SwapPlan
    status: RunStatus
    phase_index: int = 0
    records: tuple[StepRecord, ...] = field(default_factory=tuple)
    failed_phase: str | None = None

    @property
    def current(self) -> Phase | None:
        """The forward phase being run, or None once past the last one."""
        if self.status != "running" or self.phase_index >= len(self.plan.phases):
            return None
        return self.plan.phases[self.phase_index]

    def recorded(self, phase: str) -> dict[str, StepRecord]:
        """The outcomes of ``phase``, by replica."""
        return {r.replica: r for r in self.records if r.phase == phase}

    @property
    def first_failure(self) -> StepRecord | None:
        return next((r for r in self.records if not r.ok), None)


@dataclass(frozen=True)
class RunPhase:
    """Run ``phase`` on these replicas, in parallel."""

    phase: Phase
    replicas: tuple[str, ...]


@dataclass(frozen=True)
class AbortPhase:
    """Run the abort phase on these replicas, in parallel."""

    phase: Phase
    replicas: tuple[str, ...]


@dataclass(frozen=True)
class Done:
    """Every phase succeeded on every replica."""


@dataclass(frozen=True)
class ReplicaState:
    """Where one replica ended, as far as the recorded outcomes show.

    Attributes:
        version: The version it serves, when known; None when unknown or nothing.
        last_phase: The last phase recorded for it ("" when none).
        ok: That phase succeeded.
        reason: Why it failed, when it did.
    """

    name: str
    version: int | None
    last_phase: str
    ok: bool
    reason: str | None

    def describe(self) -> str:
        if not self.last_phase:
            served = f"v{self.version}" if self.version is not None else "nothing"
            return f"{self.name}: untouched, serves {served}"
        if self.ok:
            served = f"v{self.version}" if self.version is not None else "nothing"
            verb = "restored, serves" if self.last_phase == ABORT else \
                f"{self.last_phase} ok, serves"
            return f"{self.name}: {verb} {served}"
        if self.last_phase == ABORT:
            return f"{self.name}: ABORT FAILED ({self.reason}); its state is unknown, check it"
        return f"{self.name}: {self.last_phase} failed ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "last_phase": self.last_phase, "ok": self.ok,
                "reason": self.reason, "state": self.describe()}


@dataclass(frozen=True)
class Aborted:
    """The run ended after the abort phase; ``states`` says where each replica is."""

    reason: str
    states: Mapping[str, ReplicaState]


Action = RunPhase | AbortPhase | Done | Aborted


def start(plan: SwapPlan) -> SwapRun:
    """A run at its first phase; a ``noop`` plan is done at once."""
    return SwapRun(plan, "done" if not plan.phases else "running")


def _check_replica(run: SwapRun, replica: str) -> None:
    if replica not in run.plan.replicas:
        raise ValueError(f"{replica!r} is not a replica of this swap ({run.plan.replicas})")


def record(run: SwapRun, replica: str, phase: str, ok: bool, reason: str | None = None,
           at: float | None = None) -> SwapRun:
    """The run after one replica's outcome of one phase.

    A failure moves the run to ``aborting``. Outcomes of the failed phase that arrive later
    (the phase ran in parallel) are still kept, for the report.

    Raises:
        ValueError: the run is over, the replica is unknown, the phase is not the one
            being run, or this outcome was already recorded (all are coordinator bugs).
    """
    _check_replica(run, replica)
    if run.status in ("done", "aborted"):
        raise ValueError(f"the swap is {run.status}; no outcome can be recorded")
    if replica in run.recorded(phase):
        raise ValueError(f"{phase} on {replica} is already recorded")
    step = StepRecord(replica, phase, ok, None if ok else (reason or "failed"), at)
    if run.status == "running":
        current = run.current
        assert current is not None  # a running run always has a phase
        if phase != current.name:
            raise ValueError(f"phase {phase!r} is not the current phase {current.name!r}")
        run = replace(run, records=(*run.records, step))
        if not ok:
            return replace(run, status="aborting", failed_phase=phase)
        if len(run.recorded(phase)) == len(run.plan.replicas):
            index = run.phase_index + 1
            status: RunStatus = "done" if index >= len(run.plan.phases) else "running"
            return replace(run, phase_index=index, status=status)
        return run
    # aborting
    if phase not in (ABORT, run.failed_phase):
        raise ValueError(f"the swap is aborting; only {run.failed_phase!r} (late outcomes) "
                         f"and {ABORT!r} can be recorded, not {phase!r}")
    run = replace(run, records=(*run.records, step))
    if phase == ABORT and len(run.recorded(ABORT)) == len(run.plan.replicas):
        return replace(run, status="aborted")
    return run


def expire(run: SwapRun, at: float | None = None) -> SwapRun:
    """The run after its deadline passed: every replica still pending fails with a timeout.

    While running, that starts the abort; while aborting, the replicas whose abort did not
    finish are recorded as failed, which ends the run ``aborted``.
    """
    action = next_action(run)
    if isinstance(action, RunPhase | AbortPhase):
        for replica in action.replicas:
            # after the first one, the rest are late outcomes of the phase that failed
            run = record(run, replica, action.phase.name, False,
                         reason=f"timed out in {action.phase.name}", at=at)
    return run


def next_action(run: SwapRun) -> Action:
    """What the coordinator must do next."""
    if run.status == "done":
        return Done()
    if run.status == "running":
        phase = run.current
        assert phase is not None
        seen = run.recorded(phase.name)
        return RunPhase(phase, tuple(r for r in run.plan.replicas if r not in seen))
    failure = run.first_failure
    reason = f"{failure.phase} failed on {failure.replica}: {failure.reason}" if failure \
        else "aborted"
    if run.status == "aborted":
        return Aborted(reason, replica_states(run))
    abort = run.plan.abort
    assert abort is not None  # only plans with phases can abort, and those have one
    seen = run.recorded(ABORT)
    return AbortPhase(abort, tuple(r for r in run.plan.replicas if r not in seen))


def replica_states(run: SwapRun) -> dict[str, ReplicaState]:
    """Where each replica is, from its last recorded outcome."""
    phases = {p.name: p for p in run.plan.phases}
    if run.plan.abort is not None:
        phases[ABORT] = run.plan.abort
    before = run.plan.from_version if run.plan.kind != "noop" else run.plan.to_version
    if run.plan.kind == "converge":
        before = None  # mixed: no one version describes them
    states: dict[str, ReplicaState] = {}
    for name in run.plan.replicas:
        mine = [r for r in run.records if r.replica == name]
        if not mine:
            states[name] = ReplicaState(name, before, "", True, None)
            continue
        last = mine[-1]
        version = phases[last.phase].expect_version if last.ok else None
        states[name] = ReplicaState(name, version, last.phase, last.ok, last.reason)
    return states
