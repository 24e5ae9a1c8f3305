"""Every way out is a way home: finish or undo what a release left, decided in pure code.

A release that changes the fleet writes its **intent** first
(:func:`modelship.ledger.release_intent`: from, to, the pin, the aliases, the tag).
From then on it can only end in one of two states:

- **released**: the fleet and the pin serve ``to``; ``to`` carries the release's
  ``modelship.release_id`` tag; ``previous`` says ``from``; ``production`` says ``to``;
- **undone**: the fleet and the pin serve ``from`` (nothing on a first release);
  ``production`` says ``from``; ``previous`` says what it said before.

Which one is decided by :func:`decide`, a pure function of the record and the observed
:class:`Seen` (what the fleet, the pin and MLflow say now), in the shape of
:mod:`modelship.triton.swap_plan`:

- a record whose run chose its way out (``incomplete`` in the record, or the running
  process's own ``closing``) keeps that goal;
- else a record past its point of no return (``intent.committed_at``: the bake passed;
  a plain swap or rollback switched), or whose version already carries its release tag
  (its MLflow commit happened, even if the record could not say so), is **released**;
- else it is **undone**: a swap that was not baked is put back;
- a record without an intent never changed the fleet: it only ends (``interrupted``).

:func:`steps_to` lists what is left to reach the goal from what is seen (fleet and pin, then
the tag, then ``previous``, then ``production`` last), and :func:`carry_out` performs them
through an :class:`Effects` port; the first step that fails leaves the record
``incomplete`` with the rest named (``missing``), and the next command of any kind
(:func:`recover`) finishes it: promote, swap, rollback and reconcile call it under the
model's lock before anything else; ``status`` reports it (:func:`unfinished`).

Also here: which ``running`` records belong to dead runs (:func:`dead_runs`), and the
canary leftovers of a dead run (:func:`unload_leftovers`).
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from model_registry.client import PREVIOUS_ALIAS, PRODUCTION_ALIAS
from modelship.errors import InfrastructureError, ModelshipError, ReleaseIncomplete
from modelship.ledger import (
    RELEASE_ID_TAG,
    ReleaseRecord,
    holder_process_alive,
    now_iso,
    sort_newest_first,
)
from modelship.progress import Progress, quiet
from modelship.signals import deferred, exit_code_for, stop_signal
from tasks.reconcile import read_pin
from tasks.swap import fleet_status

__all__ = ["KEEP", "UNKNOWN", "Closing", "Decision", "Effects", "FleetTo", "SetAlias",
           "Seen", "Step", "TagRelease", "Target", "apply", "carry_out", "close", "closing_for",
           "committed", "dead_runs",
           "decide", "intent_of", "loaded_models", "mark_found", "recover", "repair_target",
           "steps_to", "unfinished", "unload_leftovers"]

Goal = Literal["released", "undone", "nothing"]

#: A value that could not be observed (its server is down): every step that would set it
#: is taken, since setting is idempotent.
UNKNOWN = "unknown"
#: A target alias that is left as it is.
KEEP = "keep"
FLEET_KINDS = ("promote", "swap", "rollback")


# --------------------------------------------------------------------------------------
# the pure plan


@dataclass(frozen=True)
class Seen:
    """What serves and what the registry says, observed now.

    Attributes:
        fleet: The version every replica serves with one config; None: no replica serves
            the model; ``"mixed"``: they disagree or some are unreachable; ``UNKNOWN``.
        pin: The version of the signed production pin; None: no pin.
        production: The ``production`` alias; None: not set.
        previous: The ``previous`` alias; None: not set.
        tag: The ``modelship.release_id`` tag of the version the record is about.
        problems: What could not be observed, in words.
    """

    fleet: int | None | str
    pin: int | None | str
    production: int | None | str
    previous: int | None | str
    tag: str | None = None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """The state a goal means: the fleet and the pin on ``version``, the aliases, the tag.

    Attributes:
        previous: The ``previous`` alias wanted, None to remove it, :data:`KEEP` to leave it.
        tag: ``(version, release id)`` the version's release tag must name; None: no tag.
    """

    version: int | None
    production: int | None
    previous: int | None | str
    tag: tuple[int, str] | None = None


@dataclass(frozen=True)
class FleetTo:
    """Every reachable replica to ``version`` (a converging swap, which pins it), or the
    model withdrawn and unpinned when None."""

    version: int | None

    def describe(self) -> str:
        if self.version is None:
            return "fleet and pin: withdraw the model (nothing served before)"
        return f"fleet and pin: every replica on v{self.version}"


@dataclass(frozen=True)
class SetAlias:
    """Point ``alias`` at ``version``; None removes it."""

    alias: str
    version: int | None

    def describe(self) -> str:
        to = "removed" if self.version is None else f"-> v{self.version}"
        return f"alias {self.alias} {to}"


@dataclass(frozen=True)
class TagRelease:
    """Tag ``version`` with the release that put it in production."""

    version: int
    release_id: str

    def describe(self) -> str:
        return f"tags of v{self.version}: {RELEASE_ID_TAG}={self.release_id}"


Step = FleetTo | SetAlias | TagRelease


@dataclass(frozen=True)
class Closing:
    """How a run that is still alive chose to end, before it converges.

    Attributes:
        goal: ``released`` or ``undone``.
        status, exit_code, reason: The record's end once the state is reached.
    """

    goal: Goal
    status: str
    exit_code: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"goal": self.goal, "status": self.status, "exit_code": self.exit_code,
                "reason": self.reason}


@dataclass(frozen=True)
class Decision:
    """What to do about one record: the goal, the steps left, and how the record ends."""

    record_id: str
    goal: Goal
    steps: tuple[Step, ...]
    status: str
    exit_code: int
    reason: str
    target: Target | None = None

    def describe(self) -> list[str]:
        return [s.describe() for s in self.steps]


def intent_of(record: ReleaseRecord) -> dict[str, Any]:
    """The record's intent; a record written before intents existed that reached its swap
    gets one derived from its versions (``previous`` then kept as it is)."""
    if record.intent:
        return record.intent
    if record.kind in FLEET_KINDS and record.to_version is not None \
            and record.stage("swap") is not None:
        return {"from_version": record.from_version, "to_version": record.to_version,
                "aliases": {"production": {"from": record.from_version,
                                           "to": record.to_version},
                            "previous": {"from": KEEP, "to": KEEP}},
                "tag": {"version": record.to_version, "release_id": record.id},
                "committed_at": None, "derived": True}
    return {}


def committed(record: ReleaseRecord, seen: Seen) -> bool:
    """Past the point of no return: the record says so, or the registry already carries
    this release's tag on its version (the MLflow commit happened)."""
    intent = intent_of(record)
    return bool(intent.get("committed_at")) or (seen.tag is not None
                                                and seen.tag == record.id)


def _target(record: ReleaseRecord, goal: Goal) -> Target | None:
    intent = intent_of(record)
    if not intent or goal == "nothing":
        return None
    aliases = intent.get("aliases") or {}
    previous = aliases.get("previous") or {}
    if goal == "released":
        to = int(intent["to_version"])
        return Target(to, to, previous.get("to", KEEP), (to, record.id))
    back = intent.get("from_version")
    return Target(back, back, previous.get("from", KEEP))


def steps_to(target: Target, seen: Seen) -> tuple[Step, ...]:
    """What is left to do to reach ``target`` from ``seen``: the fleet and the pin, the
    tag, ``previous``, then ``production`` last (pure). An ``UNKNOWN`` never equals a
    wanted value, so its step is taken."""
    steps: list[Step] = []
    if seen.fleet != target.version or seen.pin != target.version:
        steps.append(FleetTo(target.version))
    if target.tag is not None and seen.tag != target.tag[1]:
        steps.append(TagRelease(*target.tag))
    if target.previous != KEEP and seen.previous != target.previous:
        steps.append(SetAlias(PREVIOUS_ALIAS, target.previous
                              if isinstance(target.previous, int) else None))
    if seen.production != target.production:
        steps.append(SetAlias(PRODUCTION_ALIAS, target.production))
    return tuple(steps)


def _last_stage(record: ReleaseRecord) -> str:
    return next((s.name for s in reversed(record.stages)), "start")


def _v(version: Any) -> str:
    return "nothing" if version is None else f"v{version}"


def decide(record: ReleaseRecord, seen: Seen, *, closing: Closing | None = None,
           by: str | None = None) -> Decision:
    """What to do about ``record`` given ``seen`` (pure; see the module docstring).

    Args:
        record: A ``running`` record whose process is gone, an ``incomplete`` one, or the
            caller's own record on its way out.
        seen: What serves and what the registry says now.
        closing: The goal and ending the caller's own run chose; None for a record found
            by a later command (its ``incomplete`` field, else the rules above).
        by: The id of the release (or command) that found it, for the reason.
    """
    finder = f"release {by}" if by else "a later command"
    intent = intent_of(record)
    stage = _last_stage(record)
    chosen = closing.to_dict() if closing is not None else (record.incomplete or None)
    if chosen is not None and not intent:
        return Decision(record.id, "nothing", (), chosen["status"],
                        int(chosen["exit_code"]), chosen["reason"])
    if chosen is not None and chosen.get("goal") in ("released", "undone"):
        goal: Goal = chosen["goal"]
        status, code, reason = chosen["status"], int(chosen["exit_code"]), chosen["reason"]
    elif not intent:
        return Decision(record.id, "nothing", (), "interrupted", 1,
                        f"the run stopped during {stage} (its process died); {finder} "
                        "found it; it had not changed the fleet")
    elif committed(record, seen):
        goal, status, code = "released", "released", 0
        reason = (f"its process stopped during {stage}, past its point of no return; "
                  f"{finder} finished it: {_v(intent.get('to_version'))} serves")
    else:
        goal, status, code = "undone", "interrupted", 1
        reason = (f"the run stopped during {stage} (its process died); {finder} undid "
                  f"it: {_v(intent.get('from_version'))} serves again")
    target = _target(record, goal)
    assert target is not None  # an intent and a goal always give one
    return Decision(record.id, goal, steps_to(target, seen), status, code, reason, target)


def repair_target(version: int, *, previous: int | None, release_id: str) -> Target:
    """A no-op's truth (``version`` serves on every replica): the pin, the tag and the
    aliases say so too. ``previous`` None keeps the alias as it is."""
    return Target(version, version, KEEP if previous is None else previous,
                  (version, release_id))


def apply(seen: Seen, step: Step) -> Seen:
    """What is seen after ``step`` succeeded (pure)."""
    if isinstance(step, FleetTo):
        return replace(seen, fleet=step.version, pin=step.version)
    if isinstance(step, TagRelease):
        return replace(seen, tag=step.release_id)
    if step.alias == PRODUCTION_ALIAS:
        return replace(seen, production=step.version)
    return replace(seen, previous=step.version)


# --------------------------------------------------------------------------------------
# the executor


class Effects(Protocol):
    """The I/O of the steps (:class:`tasks.fleet.FleetEffects` binds it to the real fleet
    and MLflow)."""

    def fleet_to(self, version: int | None) -> None:
        """Converge every reachable replica to ``version`` and pin it (None: withdraw);
        raise a ModelshipError when it could not."""

    def set_alias(self, alias: str, version: int | None) -> None:
        """Point ``alias`` at ``version`` (None: remove it)."""

    def tag_release(self, version: int, release_id: str) -> None:
        """Tag ``version`` with the release that put it in production."""


@dataclass
class Ending:
    """How the record ends after :func:`carry_out`.

    Attributes:
        done: The steps performed, in words.
        incomplete: Empty when the goal was reached; else the ``incomplete`` field.
    """

    status: str
    exit_code: int
    reason: str
    done: list[str] = field(default_factory=list)
    incomplete: dict[str, Any] = field(default_factory=dict)

    @property
    def reached(self) -> bool:
        return not self.incomplete

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "exit_code": self.exit_code, "reason": self.reason,
                "done": self.done, "incomplete": self.incomplete}


def _perform(effects: Effects, step: Step) -> None:
    if isinstance(step, FleetTo):
        effects.fleet_to(step.version)
    elif isinstance(step, TagRelease):
        effects.tag_release(step.version, step.release_id)
    else:
        effects.set_alias(step.alias, step.version)


def carry_out(decision: Decision, effects: Effects, *,
              progress: Progress = quiet) -> Ending:
    """Perform the decision's steps in order; the first failure stops them.

    Any Exception of a step (a vendor error included) is caught here: the record then
    ends ``incomplete`` with the steps left. A BaseException (a signal) goes on up; run
    this inside :func:`modelship.signals.deferred`.
    """
    done: list[str] = []
    for index, step in enumerate(decision.steps):
        progress(f"{decision.record_id}: {step.describe()}")
        try:
            _perform(effects, step)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the rest missing
            why = exc.message if isinstance(exc, ModelshipError) else \
                f"{type(exc).__name__}: {exc}"
            missing = [s.describe() for s in decision.steps[index:]]
            progress(f"{decision.record_id}: could not {step.describe()}: {why}")
            return Ending("incomplete", 1,
                          f"{decision.reason}; NOT finished: {'; '.join(missing)} ({why}); "
                          "the next modelship command finishes it",
                          done, {"goal": decision.goal, "missing": missing, "error": why,
                                 "status": decision.status,
                                 "exit_code": decision.exit_code,
                                 "reason": decision.reason, "at": now_iso()})
        done.append(step.describe())
    return Ending(decision.status, decision.exit_code, decision.reason, done)


def end_record(record: ReleaseRecord, ending: Ending) -> None:
    """Put ``ending`` on the record (the caller writes it)."""
    record.incomplete = dict(ending.incomplete)
    record.finish(ending.status, ending.exit_code, ending.reason)


def closing_for(record: ReleaseRecord, exc: BaseException | None) -> Closing:
    """How a run that still lives ends, from why it ends (pure).

    Past the point of no return (``intent.committed_at``) it finishes the release whatever
    happened (a stop request, an outage in the record stage): the commit is done or not
    done, never half. Before it, it undoes: ``cancelled`` for a stop request (exit
    128 + signal), ``rolled_back`` when the bake rolled back (exit 4 on a breach),
    ``rejected``/``failed`` with the error's exit code otherwise.
    """
    to, back = record.to_version, record.from_version
    if intent_of(record).get("committed_at"):
        note = "" if exc is None else (
            f" (after {type(exc).__name__} past the point of no return: finished, not "
            "undone)")
        return Closing("released", "released", 0,
                       f"{record.model} {_v(to)} serves on every replica{note}")
    signum = None if exc is None else stop_signal(exc)
    stage = _last_stage(record)
    if signum is not None:
        name = signal.Signals(signum).name
        return Closing("undone", "cancelled", exit_code_for(signum),
                       f"stopped by {name} during {stage}; undone: {_v(back)} serves again")
    code = exc.exit_code if isinstance(exc, ModelshipError) else 1
    message = exc.message if isinstance(exc, ModelshipError) else \
        f"{type(exc).__name__}: {exc}" if exc is not None else "stopped"
    if record.bake.get("rolled_back"):
        return Closing("undone", "rolled_back", code, message)
    return Closing("undone", "failed" if code == 1 else "rejected", code, message)


def close(record: ReleaseRecord, closing: Closing, *, observe: Callable[[ReleaseRecord], Seen],
          effects: Effects, write: Callable[[ReleaseRecord], object],
          progress: Progress = quiet) -> Ending:
    """End the caller's own release on its way out: reach the closing's goal from what is
    seen, end the record and write it, with SIGINT/SIGTERM held back meanwhile.

    A failed step leaves the record ``incomplete`` (written, when the ledger answers); a
    ledger that cannot be written leaves the record ``running`` with its intent, and the
    next command decides from what it sees (:func:`recover`).
    """
    with deferred(f"release {record.id} ends ({closing.goal})", say=progress):
        decision = decide(record, observe(record), closing=closing)
        for line in decision.describe():
            progress(f"{record.id} ({closing.goal}): {line}")
        ending = carry_out(decision, effects, progress=progress)
        end_record(record, ending)
        write(record)
    return ending


# --------------------------------------------------------------------------------------
# which records are unfinished


def _process_gone(record: ReleaseRecord, here: str) -> bool | None:
    """True: the holder's process on this host is gone; False: it lives; None: another
    host (unknown from here)."""
    alive = holder_process_alive(record.holder, here)
    return None if alive is None else not alive


def dead_runs(ledger: Any, model: str, current: str) -> list[ReleaseRecord]:
    """Records of ``model`` still ``running`` whose process is gone, newest first.

    Same host: the holder's pid no longer exists. Another host: the record reached the
    canary, so it held the release lock, which the caller is about to take (a live holder
    keeps it, and the caller then stops with ReleaseLocked). A live run of the same model
    in another terminal (same host, its pid alive) is never one of them.
    """
    here = socket.gethostname()
    found = []
    for old in ledger.records(model):
        if old.id == current or old.status != "running" or old.dry_run \
                or old.kind not in FLEET_KINDS:
            continue
        gone = _process_gone(old, here)
        if gone or (gone is None and old.stage("canary") is not None):
            found.append(old)
    return found


def live_runs(records: Iterable[ReleaseRecord], current: str | None = None
              ) -> list[ReleaseRecord]:
    """``running`` fleet records of this host whose process lives (another terminal, a
    release in its bake), newest first; for naming them instead of guessing."""
    here = socket.gethostname()
    return [r for r in sort_newest_first(records)
            if r.id != current and r.status == "running" and not r.dry_run
            and r.kind in FLEET_KINDS and _process_gone(r, here) is False]


def unfinished(records: Iterable[ReleaseRecord], current: str | None = None
               ) -> list[ReleaseRecord]:
    """Records the next command must finish, newest first: ``incomplete`` ones, and
    ``running`` ones whose process on this host is gone (for ``status``: it does not
    take the lock, so a running record of another host is left to its lock's owner)."""
    here = socket.gethostname()
    return [r for r in sort_newest_first(records)
            if r.id != current and r.kind in FLEET_KINDS and not r.dry_run
            and (r.status == "incomplete"
                 or (r.status == "running" and _process_gone(r, here) is True))]


def mark_found(record: ReleaseRecord, by: str) -> None:
    """A pending approval of a run found dead is closed, so a late click is refused."""
    for entry in record.approvals:
        if entry.get("kind") == "request" and entry.get("status") == "pending":
            entry.update(status="interrupted", decided_at=now_iso(),
                         reason=f"the run died while it waited; release {by} found it")


# --------------------------------------------------------------------------------------
# the recovery every command runs first


def recover(ledger: Any, model: str, *, by: str, observe: Callable[[ReleaseRecord], Seen],
            effects: Effects, progress: Progress = quiet,
            traffic: Callable[[Sequence[ReleaseRecord]], dict[str, Any]] | None = None
            ) -> dict[str, Any]:
    """Finish or undo every unfinished record of ``model``; the caller holds the lock.

    Unfinished: ``running`` with its process gone (:func:`dead_runs`) or ``incomplete``.
    The newest one is converged (:func:`decide`, :func:`carry_out`); older ones are
    superseded by it and only end. Each is rewritten in the ledger.

    ``traffic`` (:func:`tasks.traffic_state.recovery_hook`), when a traffic router is
    configured, runs first, given the unfinished records: a killed release's split (or an
    orphaned one) goes back to 100 % production before the fleet is touched; a router that
    cannot be restored raises (InfrastructureError) and nothing else is done.

    Returns:
        ``{"interrupted": [ids of dead runs], "finished": [{"id", "goal", "status",
        "done"[, "missing"]}], "fleet": {"ok", "to_version", "goal"} or None}``: ``fleet``
        is the fleet step taken, None when the fleet was left as it was; ``traffic``
        (the router's report) with a ``traffic`` hook.

    Raises:
        ReleaseIncomplete: the newest could not be finished now (it stays ``incomplete``,
            with what is missing); the caller must not go on.
    """
    dead = dead_runs(ledger, model, by)
    dead_ids = {r.id for r in dead}
    stuck = [r for r in ledger.records(model)
             if r.status == "incomplete" and r.id != by and r.id not in dead_ids]
    todo = sort_newest_first([*dead, *stuck])
    report: dict[str, Any] = {"interrupted": [r.id for r in dead], "finished": [],
                              "fleet": None}
    if traffic is not None:
        report["traffic"] = traffic(todo)
    if not todo:
        return report
    newest, older = todo[0], todo[1:]
    for old in older:
        mark_found(old, by)
        old.incomplete = {}
        old.finish("interrupted", 1, f"the run stopped during {_last_stage(old)} (its "
                   f"process died); release {by} found it, after a newer run "
                   f"({newest.id}) had started")
        ledger.write(old)
        report["finished"].append({"id": old.id, "goal": "nothing",
                                   "status": old.status, "done": []})
    mark_found(newest, by)
    # a record without an intent never changed the fleet: nothing to look at
    seen = observe(newest) if intent_of(newest) else Seen(UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN)
    decision = decide(newest, seen, by=by)
    for line in decision.describe():
        progress(f"recovering {newest.id}: {line}")
    ending = carry_out(decision, effects, progress=progress)
    end_record(newest, ending)
    ledger.write(newest)
    report["finished"].append({"id": newest.id, "goal": decision.goal,
                               "status": ending.status, "done": ending.done,
                               **({"missing": ending.incomplete["missing"]}
                                  if ending.incomplete else {})})
    fleet_step = next((s for s in decision.steps if isinstance(s, FleetTo)), None)
    if fleet_step is not None:
        report["fleet"] = {"ok": fleet_step.describe() in ending.done,
                           "to_version": fleet_step.version, "goal": decision.goal}
    if not ending.reached:
        raise ReleaseIncomplete(
            f"release {newest.id} of {model} ({newest.kind} {_v(newest.from_version)} -> "
            f"{_v(newest.to_version)}) is incomplete and could not be finished now: "
            f"missing {'; '.join(ending.incomplete['missing'])} "
            f"({ending.incomplete['error']})",
            hint="bring back what is down (`modelship doctor`), then run any modelship "
            f"command for {model} again (`modelship reconcile {model}` finishes it)",
            model=model, release_id=newest.id, recovery=report)
    return report


# --------------------------------------------------------------------------------------
# observing what is there


def _alias_view(aliases: dict[str, int], name: str) -> int | None:
    return aliases.get(name)


def observe_seen(clients: Any, *, model: str, version: int | None, release_id: str | None,
                 repository_prefix: str, signing_key: bytes) -> Seen:
    """What the fleet, the pin and MLflow say now about ``model`` (and the release tag of
    ``version``); whatever cannot be read is :data:`UNKNOWN`, with the reason in
    ``problems``. Never raises for a server that is down."""
    problems: list[str] = []
    fleet: int | None | str = UNKNOWN
    if clients.replicas:
        doc = fleet_status(clients.replicas, model)
        rows = doc["replicas"]
        if doc["consistent"]:
            fleet = int(rows[0]["ready_versions"][0])
        elif rows and all("error" not in r and not r["ready_versions"] for r in rows):
            fleet = None
        else:
            fleet = "mixed"
            problems.append(f"the fleet: {doc['summary']}")
    pin: int | None | str = UNKNOWN
    if clients.storage is not None:
        try:
            found = read_pin(clients.storage, repository_prefix=repository_prefix,
                             model=model, signing_key=signing_key)
            pin = None if found is None else found.version
        except ModelshipError as exc:
            problems.append(f"the pin: {exc.message}")
    production: int | None | str = UNKNOWN
    previous: int | None | str = UNKNOWN
    tag: str | None = None
    if clients.registry is not None:
        try:
            aliases = clients.registry.aliases(model)
            production = _alias_view(aliases, PRODUCTION_ALIAS)
            previous = _alias_view(aliases, PREVIOUS_ALIAS)
            if version is not None and release_id is not None:
                tag = clients.registry.version_tags(model, version).get(RELEASE_ID_TAG)
        except Exception as exc:  # noqa: BLE001 - MLflow down: its values stay unknown
            why = exc.message if isinstance(exc, ModelshipError) else \
                f"{type(exc).__name__}: {exc}"
            problems.append(f"MLflow: {why}")
    return Seen(fleet, pin, production, previous, tag, tuple(problems))


# --------------------------------------------------------------------------------------
# canary leftovers


def loaded_models(server: Any) -> list[str]:
    """Every model a Triton server has loaded: the repository index lists repository models
    only, so a trial model loaded from files is found through the statistics of all ready
    models."""
    names = {str(m.get("name")) for m in server.repository_index()
             if m.get("state") in ("READY", "LOADING")}
    try:
        stats = server.grpc.get_inference_statistics(as_json=True,
                                                     client_timeout=server.timeout_s)
    except Exception as exc:  # noqa: BLE001 - translated: the server did not answer
        raise InfrastructureError(f"{server.name} did not list its models: {exc}",
                                  hint="check the canary Triton (`modelship doctor`)") from exc
    names.update(str(m.get("name")) for m in stats.get("model_stats", []))
    return sorted(names)


def unload_leftovers(canary: Any, model: str) -> list[str]:
    """Unload what dead runs of ``model`` left on the canary Triton (its canary pair and
    trial models); returns the names unloaded."""
    unloaded = []
    if canary is not None:
        for name in loaded_models(canary):
            if name == model or name.startswith(f"_trial_{model}_v"):
                canary.unload_model(name)
                unloaded.append(name)
    return unloaded


def newest_release_of(records: Sequence[ReleaseRecord], version: int) -> str | None:
    """The id of the newest record that put ``version`` in production (released), for the
    release tag a no-op repairs; None when the ledger has none."""
    return next((r.id for r in sort_newest_first(records)
                 if r.kind in FLEET_KINDS and r.status == "released"
                 and r.to_version == version), None)
