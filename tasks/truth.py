"""What ``modelship status`` says: the fleet compared with what was meant (pure).

A release is true when every source says the same version (DESIGN §2 item 10):

- the **replicas**: the versions each one reports READY and its live serving config
  (dynamic batching included; :func:`~modelship.triton.model_config.serving_digest`);
- the **pin** (``P/<model>/config.pbtxt``, signed by the swap): what reconcile restores;
- the ``production`` **alias** in MLflow;
- the **ledger**: its newest records, and whether a ``running`` one still has a process;
- the **release lock** (an S3 object) and its holder.

:func:`truth` takes an :class:`Observation` (what was read from each source, and which
sources could not be read) and returns a :class:`Truth`: every disagreement with the
command that repairs it, a release in progress (not an error), and the version that
should serve with the source that says so. Reading the sources is the caller's job
(``tasks.status.status_report``); nothing here does I/O.

What should serve is decided by the ledger first: the newest record that changed the
fleet (released or noop: its ``to_version``; rolled back, or failed after it touched the
fleet: its ``from_version``). A record that stopped before touching the fleet says
nothing about it and is skipped. A dead run that touched the fleet, or an ``incomplete``
record, leaves that question to the command that finishes or undoes it. Without a record
the pin decides.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from modelship.ledger import ReleaseRecord

__all__ = ["Disagreement", "Expected", "LockSeen", "Observation", "PinSeen", "RecordSeen",
           "ReplicaSeen", "Truth", "expected_version", "liveness", "record_seen", "truth"]

Kind = Literal["no_replicas", "replica_unreachable", "dead_release", "incomplete_release",
               "pin_invalid", "fleet_mixed", "fleet_version", "config_drift",
               "pin_version", "alias"]
Process = Literal["alive", "dead", "unknown"]
Source = Literal["mlflow", "s3", "prefect"]

#: Kinds of record that change the fleet (canary and unlock records do not).
FLEET_KINDS = frozenset({"promote", "swap", "rollback"})
#: Promote stages that run under the release lock.
LOCKED_STAGES = frozenset({"recover", "canary", "gates", "approve", "baseline", "swap",
                           "bake", "record"})
#: Promote stages after which the fleet may have changed.
FLEET_STAGES = frozenset({"recover", "swap", "bake", "record"})
#: Statuses after which the record's ``to_version`` serves.
TO_VERSION_STATUSES = frozenset({"released", "noop"})
#: Statuses of a record that ended (its process is done with it).
ENDED_STATUSES = frozenset({"released", "noop", "rolled_back", "failed", "rejected",
                            "interrupted", "cancelled", "planned", "passed"})


# --------------------------------------------------------------------------------------
# what was observed


@dataclass(frozen=True)
class ReplicaSeen:
    """One production replica as observed.

    Attributes:
        reachable: It answered.
        ready_versions: The versions it reports READY, ascending.
        serving_digest: The digest of its live config without the version policy (None
            when it serves nothing).
        dynamic_batching: Its live config has dynamic batching (None: serves nothing).
        problem: Why it did not answer.
    """

    name: str
    reachable: bool
    ready_versions: tuple[int, ...] = ()
    serving_digest: str | None = None
    dynamic_batching: bool | None = None
    problem: str | None = None


@dataclass(frozen=True)
class PinSeen:
    """The production pin, rendered in the fleet's form (as reconcile renders it)."""

    version: int
    serving_digest: str
    dynamic_batching: bool


@dataclass(frozen=True)
class RecordSeen:
    """One ledger record, reduced to what status needs.

    Attributes:
        stages: The names of the stages it began, in order.
        host: The host its process ran on.
        pid: Its process id there.
        pid_running: What this host says of ``pid`` now (None: not asked, another host).
        reason: Why it ended as it did; for ``incomplete``, what is missing.
    """

    id: str
    kind: str
    status: str
    from_version: int | None = None
    to_version: int | None = None
    stages: tuple[str, ...] = ()
    host: str | None = None
    pid: int | None = None
    pid_running: bool | None = None
    reason: str | None = None

    @property
    def held_lock(self) -> bool:
        """It took the model's release lock (swap and rollback record inside it)."""
        return self.kind in ("swap", "rollback") or bool(LOCKED_STAGES & set(self.stages))

    @property
    def touched_fleet(self) -> bool:
        """It may have changed what the replicas, the pin or the aliases say."""
        return self.kind in ("swap", "rollback") or bool(FLEET_STAGES & set(self.stages))

    def describe(self) -> str:
        where = f"v{self.from_version}" if self.from_version is not None else "nothing"
        to = f"v{self.to_version}" if self.to_version is not None else "?"
        stage = f", last stage {self.stages[-1]}" if self.stages else ""
        return f"{self.kind} {self.id} ({where} -> {to}{stage})"


@dataclass(frozen=True)
class LockSeen:
    """The model's release lock.

    Attributes:
        held: The lock's slot is taken.
        release_id: The holder's release id (None: no holder is recorded).
        holder_alive: Whether the holder still runs (None: no holder is recorded).
        holder: One line naming the holder.
    """

    held: bool
    release_id: str | None = None
    kind: str | None = None
    holder_alive: bool | None = None
    holder: str | None = None


@dataclass(frozen=True)
class Observation:
    """Everything status read, and what it could not read.

    Attributes:
        here: This host's name (a record's pid is only meaningful on its own host).
        pin: The production pin; None when there is none (or S3 was not read).
        pin_problem: The pin exists but does not verify or parse.
        alias: The ``production`` alias; None when it is not set (or MLflow was not read).
        records: The model's records of fleet-changing kinds, newest first (not dry runs).
        lock: The release lock (an S3 object); None when nothing holds it (or S3 was not
            read).
        unread: Sources that were not read (down, or not configured): ``s3`` hides the
            pin, the ledger and the lock, ``mlflow`` the alias; ``prefect`` hides nothing
            status compares (it is only noted).
    """

    model: str
    here: str
    replicas: tuple[ReplicaSeen, ...]
    pin: PinSeen | None = None
    pin_problem: str | None = None
    alias: int | None = None
    records: tuple[RecordSeen, ...] = ()
    lock: LockSeen | None = None
    unread: frozenset[Source] = frozenset()


# --------------------------------------------------------------------------------------
# what status says


@dataclass(frozen=True)
class Disagreement:
    """Two sources that say different things, and the command that makes them agree."""

    kind: Kind
    detail: str
    repair: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "detail": self.detail, "repair": self.repair}


@dataclass(frozen=True)
class Expected:
    """The version that should serve (None: nothing), and the source that says so."""

    version: int | None
    basis: str
    source: Literal["ledger", "pin"] = "ledger"

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "basis": self.basis, "source": self.source}


@dataclass(frozen=True)
class Truth:
    """The verdict of :func:`truth`.

    Attributes:
        disagreements: Most fundamental first; the first one's repair is :attr:`next`.
        expected: What should serve and why; None when no source can say (or a release is
            changing the fleet right now).
        in_progress: A live release or lock holder, in words (not an error).
        processes: Liveness of every ``running`` record, by release id.
        notes: What could not be compared, and why.
    """

    disagreements: tuple[Disagreement, ...]
    expected: Expected | None = None
    in_progress: str | None = None
    processes: dict[str, Process] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def consistent(self) -> bool:
        return not self.disagreements

    @property
    def next(self) -> str | None:
        """The repair to run first."""
        return self.disagreements[0].repair if self.disagreements else None


# --------------------------------------------------------------------------------------
# the decisions


def record_seen(record: ReleaseRecord, *, pid_running: bool | None) -> RecordSeen:
    """Reduce a ledger record to what status needs (``pid_running``: what this host says
    of the record's pid, None when not asked)."""
    pid = record.holder.get("pid")
    return RecordSeen(id=record.id, kind=record.kind, status=record.status,
                      from_version=record.from_version, to_version=record.to_version,
                      stages=tuple(s.name for s in record.stages),
                      host=record.holder.get("host"), pid=pid if isinstance(pid, int) else None,
                      pid_running=pid_running, reason=_reason(record))


def _reason(record: ReleaseRecord) -> str | None:
    """Why the record ended as it did; for ``incomplete``, its goal and what is missing."""
    incomplete = getattr(record, "incomplete", None) or {}
    if record.status != "incomplete" or not incomplete:
        return record.reason
    missing = [str(m) for m in incomplete.get("missing") or []]
    parts = [f"goal {incomplete['goal']}" if incomplete.get("goal") else "",
             f"missing: {'; '.join(missing)}" if missing else "",
             str(incomplete.get("error") or "")]
    return "; ".join(p for p in parts if p) or record.reason


def liveness(record: RecordSeen, *, here: str, lock: LockSeen | None,
             lock_read: bool) -> Process:
    """Whether a ``running`` record's process still runs.

    The lock decides when it names the record (its holder check tells a recycled pid from
    the holder). Otherwise, on the record's own host, its pid decides. On another host,
    only the lock can tell: a record that took the lock and no longer holds it is dead;
    one that never took it (a promote still checking) cannot be told.
    """
    if lock_read and lock is not None and lock.release_id == record.id \
            and lock.holder_alive is not None:
        return "alive" if lock.holder_alive else "dead"
    if record.host == here and record.pid is not None and record.pid_running is not None:
        return "alive" if record.pid_running else "dead"
    if lock_read and record.held_lock:
        return "dead"
    return "unknown"


def expected_version(records: Sequence[RecordSeen],
                     processes: dict[str, Process]) -> tuple[Expected | None,
                                                            RecordSeen | None]:
    """What the ledger says should serve, or the record that leaves it open.

    Returns:
        ``(expected, None)`` from the newest record that changed the fleet;
        ``(None, record)`` when a dead run that touched the fleet, or an ``incomplete``
        record, is newer (the command that finishes or undoes it decides);
        ``(None, None)`` when no record says.
    """
    for record in records:
        if record.status == "incomplete":
            return None, record
        if record.status == "running":
            if processes.get(record.id) == "dead" and record.touched_fleet:
                return None, record
            continue  # nothing changed yet, or a live run (the caller handles it)
        basis = f"the ledger (release {record.id}, {record.status})"
        if record.status in TO_VERSION_STATUSES:
            return Expected(record.to_version, basis), None
        if record.status == "rolled_back" or (record.status in ENDED_STATUSES
                                              and record.touched_fleet):
            return Expected(record.from_version, basis), None
    return None, None


def _versions(versions: Iterable[int]) -> str:
    return ", ".join(f"v{v}" for v in versions) or "nothing"


def _v(version: int | None) -> str:
    return f"v{version}" if version is not None else "nothing"


def _finish_repair(model: str, record: RecordSeen) -> str:
    """The repair of a dead or incomplete run: any next command finishes or undoes it."""
    return (f"`modelship reconcile {model}` (the next modelship command on {model} "
            f"finishes or undoes release {record.id})")


def truth(obs: Observation) -> Truth:
    """Compare what each source says; every disagreement comes with its repair."""
    model = obs.model
    found: list[Disagreement] = []
    notes: list[str] = []
    s3 = "s3" not in obs.unread
    lock_read = s3  # the release lock is an object in the bucket
    records = obs.records if s3 else ()
    running = [r for r in records if r.status == "running"]
    processes = {r.id: liveness(r, here=obs.here, lock=obs.lock, lock_read=lock_read)
                 for r in running}
    live = [r for r in running if processes[r.id] != "dead"]
    dead = [r for r in running if processes[r.id] == "dead"]

    in_progress, flux = None, False
    if live:
        newest = live[0]
        sure = processes[newest.id] == "alive"
        in_progress = (f"{newest.describe()} is running" if sure else
                       f"{newest.describe()} says running; whether its process lives cannot "
                       f"be told from here ({newest.host})")
        flux = newest.touched_fleet
    elif obs.lock is not None and obs.lock.held and obs.lock.holder_alive:
        in_progress = f"the release lock is held by {obs.lock.holder}"
        flux = obs.lock.kind != "canary"

    # -- the ledger and the lock -----------------------------------------------------------
    lock = obs.lock
    if lock_read and lock is not None and lock.held and not lock.holder_alive \
            and lock.release_id not in {r.id for r in dead}:
        # Not a disagreement: the lock is an S3 object with a lease, and the next release
        # takes over a holder shown gone (modelship/locks.py); say so, for `locks`.
        who = lock.holder or "an unreadable holder document"
        notes.append(f"the release lock of {model} still names {who}, whose process is "
                     f"gone: the next release takes it over (or `modelship unlock {model}`)")

    for record in dead:
        held = obs.lock is not None and obs.lock.release_id == record.id
        found.append(Disagreement(
            "dead_release",
            f"{record.describe()} says running, but its process is gone"
            + (f" (pid {record.pid} on {record.host})" if record.pid is not None else "")
            + ("; it still holds the release lock" if held else ""),
            _finish_repair(model, record)))
    for record in records:
        if record.status == "incomplete":
            found.append(Disagreement(
                "incomplete_release",
                f"{record.describe()} could not finish"
                + (f": {record.reason}" if record.reason else ""),
                _finish_repair(model, record)))
    # -- the fleet answers? ----------------------------------------------------------------
    if not obs.replicas:
        found.append(Disagreement(
            "no_replicas", f"no Triton replicas are configured for {model}",
            "`modelship stack up`, or set MODELSHIP_TRITON_REPLICAS"))
    for replica in obs.replicas:
        if not replica.reachable:
            found.append(Disagreement(
                "replica_unreachable",
                f"{replica.name} did not answer: {replica.problem or 'no answer'}",
                f"restart {replica.name} (`modelship stack up` restarts the embedded "
                f"stack's servers), then `modelship reconcile {model}`"))

    if not s3:
        notes.append("the pin and the ledger are in S3, which was not read: the replicas "
                     "were compared with the alias only")
    if "mlflow" in obs.unread:
        notes.append("MLflow was not read: the production alias was not compared")
    if flux:
        notes.append("a release is changing the fleet: versions, configs, the pin and the "
                     "alias are compared once it ends")
        return Truth(tuple(found), None, in_progress, processes, tuple(notes))

    # -- what should serve -------------------------------------------------------------------
    expected, unsettled = expected_version(records, processes) if s3 else (None, None)
    if expected is None and unsettled is None and s3 and obs.pin is not None:
        expected = Expected(obs.pin.version, "the production pin", "pin")
    if unsettled is not None:
        open_repair = _finish_repair(model, unsettled)
    elif not s3:
        open_repair = (f"once S3 answers, `modelship status {model}` names the repair (the "
                       "pin and the ledger say which version is meant)")
    else:
        open_repair = (f"`modelship swap {model} --to V` with the version that should "
                       "serve (no ledger record or pin says which)")

    def to_expected() -> str:
        assert expected is not None
        if expected.version is None:
            return (f"`modelship swap {model} --to V` if a version should serve ("
                    f"{expected.basis} says none does)")
        if obs.pin is not None and obs.pin.version == expected.version:
            return f"`modelship reconcile {model}` (brings every replica to the pin, " \
                   f"v{expected.version})"
        return f"`modelship swap {model} --to {expected.version}`"

    # -- the replicas --------------------------------------------------------------------------
    reachable = [r for r in obs.replicas if r.reachable]
    sets = {r.ready_versions for r in reachable}
    uniform = len(sets) == 1 and len(next(iter(sets))) <= 1
    fleet = next(iter(next(iter(sets))), None) if uniform else None
    if reachable and not uniform:
        parts = "; ".join(f"{r.name} serves {_versions(r.ready_versions)}" for r in reachable)
        found.append(Disagreement(
            "fleet_mixed", f"the replicas disagree: {parts}",
            to_expected() if expected is not None else
            f"`modelship reconcile {model}`" if s3 and obs.pin is not None else open_repair))
    elif reachable and expected is not None and fleet != expected.version:
        found.append(Disagreement(
            "fleet_version", f"every replica serves {_v(fleet)}, but {expected.basis} says "
            f"{_v(expected.version)} should", to_expected()))

    pin = obs.pin if s3 else None
    if pin is not None and (expected is None or expected.version == pin.version):
        drift = [r for r in reachable if r.ready_versions == (pin.version,)
                 and r.serving_digest != pin.serving_digest]
        if drift:
            names = ", ".join(r.name for r in drift)
            paused = pin.dynamic_batching and all(r.dynamic_batching is False for r in drift)
            how = ("with dynamic batching off; the pin has it on" if paused else
                   "with another config than the pin (instances, batching or I/O)")
            found.append(Disagreement(
                "config_drift", f"{names} serve{'s' if len(drift) == 1 else ''} "
                f"v{pin.version} {how}",
                f"`modelship reconcile {model}` (reloads the pin's config)"))
    elif pin is None:
        same = {r.serving_digest for r in reachable if r.ready_versions and uniform}
        if len(same) > 1:
            found.append(Disagreement(
                "config_drift", f"the replicas serve {_v(fleet)} with {len(same)} different "
                "configs", f"`modelship reconcile {model}`" if s3 else open_repair))

    # -- the pin -------------------------------------------------------------------------------
    if s3 and obs.pin_problem:
        target = expected.version if expected is not None and expected.version is not None \
            else fleet
        found.append(Disagreement(
            "pin_invalid", f"the production pin cannot be used: {obs.pin_problem}",
            f"`modelship swap {model} --to {target if target is not None else 'V'}` "
            "(re-pins production)"))
    elif s3 and expected is not None and expected.source == "ledger":
        have = obs.pin.version if obs.pin is not None else None
        if have != expected.version:
            what = f"says v{have}" if have is not None else "is missing"
            found.append(Disagreement(
                "pin_version", f"the production pin (what reconcile restores) {what}, but "
                f"{expected.basis} says {_v(expected.version)}",
                f"`modelship swap {model} --to {expected.version}` (re-pins production)"
                if expected.version is not None else to_expected()))
    elif s3 and unsettled is not None and obs.pin is not None and uniform \
            and fleet is not None and obs.pin.version != fleet:
        found.append(Disagreement(
            "pin_version", f"the production pin says v{obs.pin.version}, the replicas serve "
            f"v{fleet}", open_repair))

    # -- the alias -----------------------------------------------------------------------------
    if "mlflow" not in obs.unread:
        said = f"the production alias says v{obs.alias}" if obs.alias is not None else \
            "there is no production alias"
        if expected is not None and obs.alias != expected.version:
            found.append(Disagreement(
                "alias", f"{said}, but {expected.basis} says {_v(expected.version)}",
                f"`modelship swap {model} --to {expected.version}` (moves the aliases to "
                "what serves)" if expected.version is not None else to_expected()))
        elif expected is None and uniform and obs.alias != fleet:
            found.append(Disagreement(
                "alias", f"{said}, but every replica serves {_v(fleet)}", open_repair))
    return Truth(tuple(found), expected, in_progress, processes, tuple(notes))
