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
    incomplete = record.incomplete
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
    """Compare what each source says; every disagreement comes with its repair.

    Disagreements come most fundamental first: a dead or incomplete run, a replica that
    does not answer, then (unless a release is changing the fleet now) the fleet, its
    config, the pin and the alias against what should serve.
    """
    s3 = "s3" not in obs.unread  # the pin, the ledger and the release lock are in S3
    records = obs.records if s3 else ()
    running = [r for r in records if r.status == "running"]
    processes = {r.id: liveness(r, here=obs.here, lock=obs.lock, lock_read=s3)
                 for r in running}
    dead = [r for r in running if processes[r.id] == "dead"]
    in_progress, flux = _in_progress(obs, running, processes)
    notes = [*_orphaned_lock(obs, dead), *_unread_notes(obs, flux=flux)]
    found = [*_unfinished_runs(obs, records, dead), *_unanswered(obs)]
    if flux:
        return Truth(tuple(found), None, in_progress, processes, tuple(notes))
    meant = _meant(obs, records, processes)
    fleet = _fleet(obs)
    found += [*_fleet_disagreements(obs, meant, fleet), *_config_drift(obs, meant, fleet),
              *_pin_disagreements(obs, meant, fleet), *_alias_disagreements(obs, meant, fleet)]
    return Truth(tuple(found), meant.expected, in_progress, processes, tuple(notes))


@dataclass(frozen=True)
class _Meant:
    """What should serve, as far as the sources say, and the repairs that follow.

    Attributes:
        expected: The version that should serve and its source; None when no source says.
        unsettled: A dead or ``incomplete`` run that leaves that question to the command
            that finishes or undoes it.
        open_repair: The repair when no source says what should serve.
    """

    model: str
    expected: Expected | None
    unsettled: RecordSeen | None
    open_repair: str
    pin: PinSeen | None

    def to_expected(self) -> str:
        """The command that makes the fleet serve :attr:`expected`."""
        assert self.expected is not None
        model, expected = self.model, self.expected
        if expected.version is None:
            return (f"`modelship swap {model} --to V` if a version should serve ("
                    f"{expected.basis} says none does)")
        if self.pin is not None and self.pin.version == expected.version:
            return f"`modelship reconcile {model}` (brings every replica to the pin, " \
                   f"v{expected.version})"
        return f"`modelship swap {model} --to {expected.version}`"


@dataclass(frozen=True)
class _Fleet:
    """The replicas that answered, and the one version they all serve (if they do).

    Attributes:
        uniform: Every reachable replica serves the same versions, at most one.
        version: That version (None: nothing, or the fleet is not uniform).
    """

    reachable: tuple[ReplicaSeen, ...]
    uniform: bool
    version: int | None


def _in_progress(obs: Observation, running: Sequence[RecordSeen],
                 processes: dict[str, Process]) -> tuple[str | None, bool]:
    """A live release or lock holder in words (not an error), and whether it may be
    changing the fleet right now (then versions, configs, the pin and the alias wait)."""
    live = [r for r in running if processes[r.id] != "dead"]
    if live:
        newest = live[0]
        sure = processes[newest.id] == "alive"
        said = (f"{newest.describe()} is running" if sure else
                f"{newest.describe()} says running; whether its process lives cannot "
                f"be told from here ({newest.host})")
        return said, newest.touched_fleet
    if obs.lock is not None and obs.lock.held and obs.lock.holder_alive:
        return f"the release lock is held by {obs.lock.holder}", obs.lock.kind != "canary"
    return None, False


def _orphaned_lock(obs: Observation, dead: Sequence[RecordSeen]) -> list[str]:
    """A note (not a disagreement) on a lock whose holder is gone and is no dead run: the
    lock is an S3 object with a lease, and the next release takes over a holder shown
    gone (modelship/locks.py)."""
    lock = obs.lock
    if "s3" in obs.unread or lock is None or not lock.held or lock.holder_alive \
            or lock.release_id in {r.id for r in dead}:
        return []
    who = lock.holder or "an unreadable holder document"
    return [f"the release lock of {obs.model} still names {who}, whose process is gone: "
            f"the next release takes it over (or `modelship unlock {obs.model}`)"]


def _unread_notes(obs: Observation, *, flux: bool) -> list[str]:
    """What could not be compared, and why."""
    notes: list[str] = []
    if "s3" in obs.unread:
        notes.append("the pin and the ledger are in S3, which was not read: the replicas "
                     "were compared with the alias only")
    if "mlflow" in obs.unread:
        notes.append("MLflow was not read: the production alias was not compared")
    if flux:
        notes.append("a release is changing the fleet: versions, configs, the pin and the "
                     "alias are compared once it ends")
    return notes


def _unfinished_runs(obs: Observation, records: Sequence[RecordSeen],
                     dead: Sequence[RecordSeen]) -> list[Disagreement]:
    """Runs that say running with their process gone, and ``incomplete`` records: the next
    command finishes or undoes each."""
    found: list[Disagreement] = []
    for record in dead:
        held = obs.lock is not None and obs.lock.release_id == record.id
        found.append(Disagreement(
            "dead_release",
            f"{record.describe()} says running, but its process is gone"
            + (f" (pid {record.pid} on {record.host})" if record.pid is not None else "")
            + ("; it still holds the release lock" if held else ""),
            _finish_repair(obs.model, record)))
    for record in records:
        if record.status == "incomplete":
            found.append(Disagreement(
                "incomplete_release",
                f"{record.describe()} could not finish"
                + (f": {record.reason}" if record.reason else ""),
                _finish_repair(obs.model, record)))
    return found


def _unanswered(obs: Observation) -> list[Disagreement]:
    """No replica configured, or replicas that did not answer."""
    model = obs.model
    if not obs.replicas:
        return [Disagreement("no_replicas", f"no Triton replicas are configured for {model}",
                             "`modelship stack up`, or set MODELSHIP_TRITON_REPLICAS")]
    return [Disagreement(
        "replica_unreachable",
        f"{replica.name} did not answer: {replica.problem or 'no answer'}",
        f"restart {replica.name} (`modelship stack up` restarts the embedded stack's "
        f"servers), then `modelship reconcile {model}`")
        for replica in obs.replicas if not replica.reachable]


def _meant(obs: Observation, records: Sequence[RecordSeen],
           processes: dict[str, Process]) -> _Meant:
    """What should serve: the ledger first, then the pin (both only when S3 was read)."""
    model, s3 = obs.model, "s3" not in obs.unread
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
    return _Meant(model, expected, unsettled, open_repair, obs.pin)


def _fleet(obs: Observation) -> _Fleet:
    reachable = tuple(r for r in obs.replicas if r.reachable)
    sets = {r.ready_versions for r in reachable}
    uniform = len(sets) == 1 and len(next(iter(sets))) <= 1
    return _Fleet(reachable, uniform, next(iter(next(iter(sets))), None) if uniform else None)


def _fleet_disagreements(obs: Observation, meant: _Meant, fleet: _Fleet) -> list[Disagreement]:
    """The replicas disagree with each other, or all serve another version than meant."""
    model, expected = obs.model, meant.expected
    if fleet.reachable and not fleet.uniform:
        parts = "; ".join(f"{r.name} serves {_versions(r.ready_versions)}"
                          for r in fleet.reachable)
        return [Disagreement(
            "fleet_mixed", f"the replicas disagree: {parts}",
            meant.to_expected() if expected is not None else
            f"`modelship reconcile {model}`" if "s3" not in obs.unread and obs.pin is not None
            else meant.open_repair)]
    if fleet.reachable and expected is not None and fleet.version != expected.version:
        return [Disagreement(
            "fleet_version", f"every replica serves {_v(fleet.version)}, but "
            f"{expected.basis} says {_v(expected.version)} should", meant.to_expected())]
    return []


def _config_drift(obs: Observation, meant: _Meant, fleet: _Fleet) -> list[Disagreement]:
    """Replicas that serve the meant version with another config than the pin (dynamic
    batching left off by a stopped swap, say), or with different configs when no pin
    can be compared."""
    model, s3, expected = obs.model, "s3" not in obs.unread, meant.expected
    pin = obs.pin if s3 else None
    if pin is not None and (expected is None or expected.version == pin.version):
        drift = [r for r in fleet.reachable if r.ready_versions == (pin.version,)
                 and r.serving_digest != pin.serving_digest]
        if not drift:
            return []
        names = ", ".join(r.name for r in drift)
        paused = pin.dynamic_batching and all(r.dynamic_batching is False for r in drift)
        how = ("with dynamic batching off; the pin has it on" if paused else
               "with another config than the pin (instances, batching or I/O)")
        return [Disagreement(
            "config_drift", f"{names} serve{'s' if len(drift) == 1 else ''} "
            f"v{pin.version} {how}", f"`modelship reconcile {model}` (reloads the pin's config)")]
    if pin is None:
        same = {r.serving_digest for r in fleet.reachable if r.ready_versions and fleet.uniform}
        if len(same) > 1:
            return [Disagreement(
                "config_drift", f"the replicas serve {_v(fleet.version)} with {len(same)} "
                "different configs", f"`modelship reconcile {model}`" if s3
                else meant.open_repair)]
    return []


def _pin_disagreements(obs: Observation, meant: _Meant, fleet: _Fleet) -> list[Disagreement]:
    """The pin (what reconcile restores) cannot be used, or names another version than
    the ledger, or than the fleet while a run leaves what should serve open."""
    if "s3" in obs.unread:
        return []
    model, expected, pin = obs.model, meant.expected, obs.pin
    if obs.pin_problem:
        target = expected.version if expected is not None and expected.version is not None \
            else fleet.version
        return [Disagreement(
            "pin_invalid", f"the production pin cannot be used: {obs.pin_problem}",
            f"`modelship swap {model} --to {target if target is not None else 'V'}` "
            "(re-pins production)")]
    if expected is not None and expected.source == "ledger":
        have = pin.version if pin is not None else None
        if have == expected.version:
            return []
        what = f"says v{have}" if have is not None else "is missing"
        return [Disagreement(
            "pin_version", f"the production pin (what reconcile restores) {what}, but "
            f"{expected.basis} says {_v(expected.version)}",
            f"`modelship swap {model} --to {expected.version}` (re-pins production)"
            if expected.version is not None else meant.to_expected())]
    if meant.unsettled is not None and pin is not None and fleet.uniform \
            and fleet.version is not None and pin.version != fleet.version:
        return [Disagreement(
            "pin_version", f"the production pin says v{pin.version}, the replicas serve "
            f"v{fleet.version}", meant.open_repair)]
    return []


def _alias_disagreements(obs: Observation, meant: _Meant, fleet: _Fleet
                         ) -> list[Disagreement]:
    """The ``production`` alias names another version than should serve (or than the
    fleet serves, when no source says what should)."""
    if "mlflow" in obs.unread:
        return []
    model, expected = obs.model, meant.expected
    said = f"the production alias says v{obs.alias}" if obs.alias is not None else \
        "there is no production alias"
    if expected is not None and obs.alias != expected.version:
        return [Disagreement(
            "alias", f"{said}, but {expected.basis} says {_v(expected.version)}",
            f"`modelship swap {model} --to {expected.version}` (moves the aliases to "
            "what serves)" if expected.version is not None else meant.to_expected())]
    if expected is None and fleet.uniform and obs.alias != fleet.version:
        return [Disagreement(
            "alias", f"{said}, but every replica serves {_v(fleet.version)}",
            meant.open_repair)]
    return []
