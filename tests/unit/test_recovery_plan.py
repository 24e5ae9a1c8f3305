"""Every way out ends released or undone: the recovery plan as tables, and its executor
against a fake world (fleet, pin, aliases, tags) that can be down."""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field

import pytest

from modelship.errors import (
    BakeBreached,
    GateFailed,
    InfrastructureError,
    ReleaseIncomplete,
    Unreachable,
)
from modelship.ledger import ReleaseRecord, StageEntry, now_iso, release_intent
from modelship.signals import StopRequested
from tasks.recovery import (
    KEEP,
    UNKNOWN,
    Closing,
    FleetTo,
    Seen,
    SetAlias,
    TagRelease,
    Target,
    apply,
    carry_out,
    closing_for,
    decide,
    end_record,
    recover,
    repair_target,
    steps_to,
)

P, C = 4, 5


def record(*, stages: tuple[str, ...] = ("resolve", "check", "stage", "canary", "swap"),
           intent: bool = True, committed: bool = False, kind: str = "promote",
           from_version: int | None = P, to_version: int = C,
           aliases: dict[str, int] | None = None) -> ReleaseRecord:
    rec = ReleaseRecord.start(kind, "m", from_version=from_version,  # type: ignore[arg-type]
                              to_version=to_version)
    rec.stages = [StageEntry(name, now_iso()) for name in stages]
    if intent:
        rec.intent = release_intent(
            from_version=from_version, to_version=to_version,
            aliases={"production": P, "previous": 3} if aliases is None else aliases,
            release_id=rec.id)
        if committed:
            rec.intent["committed_at"] = now_iso()
    return rec


def seen(fleet: object = P, pin: object = P, production: object = P, previous: object = 3,
         tag: str | None = None) -> Seen:
    return Seen(fleet, pin, production, previous, tag)  # type: ignore[arg-type]


ALIAS_P = SetAlias("production", P)
ALIAS_C = SetAlias("production", C)
PREV_P = SetAlias("previous", P)
PREV_3 = SetAlias("previous", 3)


def _tag(rec: ReleaseRecord) -> TagRelease:
    return TagRelease(C, rec.id)


# (case, record, what is seen) -> (goal, status, exit code, steps with TAG for the tag)
TAG = "TAG"
CASES = [
    ("died before the swap: nothing to undo",
     record(stages=("resolve", "check"), intent=False), seen(),
     ("nothing", "interrupted", 1, [])),
    ("died mid-swap: the mixed fleet goes back to P",
     record(), seen(fleet="mixed"), ("undone", "interrupted", 1, [FleetTo(P)])),
    ("died in the bake: C serves, not baked, so undone",
     record(stages=("swap", "bake")), seen(fleet=C, pin=C),
     ("undone", "interrupted", 1, [FleetTo(P)])),
    ("died after the swap aborted itself: all say P already",
     record(), seen(), ("undone", "interrupted", 1, [])),
    ("died in the record stage, baked: finished forward",
     record(stages=("bake", "record"), committed=True), seen(fleet=C, pin=C),
     ("released", "released", 0, [TAG, PREV_P, ALIAS_C])),
    ("died between tags and production (tag set, record not written): released",
     record(stages=("bake",)), seen(fleet=C, pin=C, previous=P, tag="SELF"),
     ("released", "released", 0, [ALIAS_C])),
    ("a replica restarted on P after commit: the fleet goes to C first",
     record(committed=True), seen(fleet="mixed", pin=C),
     ("released", "released", 0, [FleetTo(C), TAG, PREV_P, ALIAS_C])),
    ("MLflow unknown, committed: every MLflow step is taken",
     record(committed=True), seen(fleet=C, pin=C, production=UNKNOWN, previous=UNKNOWN),
     ("released", "released", 0, [TAG, PREV_P, ALIAS_C])),
    ("first release died in the bake: withdrawn, production removed",
     record(from_version=None, aliases={}), seen(fleet=C, pin=C, production=None,
                                                 previous=None),
     ("undone", "interrupted", 1, [FleetTo(None)])),
    ("first release whose production moved: the alias goes too",
     record(from_version=None, aliases={}), seen(fleet=None, pin=None, production=C,
                                                 previous=None),
     ("undone", "interrupted", 1, [SetAlias("production", None)])),
    ("rollback died after moving production first: fleet stays, alias back",
     record(kind="rollback", from_version=C, to_version=P,
            aliases={"production": C, "previous": P}),
     seen(fleet=C, pin=C, production=P, previous=P),
     ("undone", "interrupted", 1, [SetAlias("production", C)])),
    ("undo restores previous as it was",
     record(), seen(fleet=C, pin=C, previous=C), ("undone", "interrupted", 1,
                                                  [FleetTo(P), PREV_3])),
    ("a pin left on C with the fleet on P is re-pinned",
     record(), seen(pin=C), ("undone", "interrupted", 1, [FleetTo(P)])),
]


@pytest.mark.parametrize(("case", "rec", "now", "expected"), CASES, ids=[c[0] for c in CASES])
def test_dead_run_decisions(case: str, rec: ReleaseRecord, now: Seen,
                            expected: tuple[str, str, int, list[object]]) -> None:
    if now.tag == "SELF":
        now = Seen(now.fleet, now.pin, now.production, now.previous, rec.id)
    goal, status, code, steps = expected
    decision = decide(rec, now, by="R2")
    wanted = [_tag(rec) if s == TAG else s for s in steps]
    assert (decision.goal, decision.status, decision.exit_code) == (goal, status, code)
    assert list(decision.steps) == wanted
    assert "R2" in decision.reason


def test_a_legacy_record_without_intent_that_reached_its_swap_is_undone() -> None:
    rec = record(intent=False)
    decision = decide(rec, seen(fleet="mixed", previous=C))
    assert decision.goal == "undone" and decision.steps == (FleetTo(P),)  # previous kept


@pytest.mark.parametrize(("goal", "chosen_status", "now", "steps"), [
    ("released", "released", seen(fleet=C, pin=C), [TAG, PREV_P, ALIAS_C]),
    ("undone", "cancelled", seen(fleet=C, pin=C), [FleetTo(P)]),
])
def test_an_incomplete_record_keeps_the_goal_its_run_chose(goal: str, chosen_status: str,
                                                           now: Seen,
                                                           steps: list[object]) -> None:
    rec = record()
    rec.status = "incomplete"
    rec.incomplete = {"goal": goal, "status": chosen_status, "exit_code": 143,
                      "reason": "stopped by SIGTERM", "missing": ["..."]}
    decision = decide(rec, now)
    assert (decision.goal, decision.status, decision.exit_code) == (goal, chosen_status, 143)
    assert list(decision.steps) == [_tag(rec) if s == TAG else s for s in steps]


def test_a_no_op_repairs_the_pin_tag_and_aliases_to_what_serves() -> None:
    """Defect 4: v3 serves, production says 2, v3 has no release tags."""
    target = repair_target(3, previous=2, release_id="R1")
    steps = steps_to(target, seen(fleet=3, pin=3, production=2, previous=1))
    assert steps == (TagRelease(3, "R1"), SetAlias("previous", 2), SetAlias("production", 3))
    assert steps_to(target, Seen(3, 3, 3, 2, "R1")) == ()
    assert steps_to(repair_target(3, previous=None, release_id="R1"),
                    Seen(3, 3, 3, 7, "R1")) == ()  # previous unknown to the ledger: kept


@pytest.mark.parametrize(("exc", "committed", "expected"), [
    (None, True, ("released", "released", 0)),
    (StopRequested(signal.SIGTERM), False, ("undone", "cancelled", 143)),
    (StopRequested(signal.SIGINT), False, ("undone", "cancelled", 130)),
    (KeyboardInterrupt(), False, ("undone", "cancelled", 130)),
    (StopRequested(signal.SIGTERM), True, ("released", "released", 0)),
    (InfrastructureError("MLflow down"), True, ("released", "released", 0)),
    (InfrastructureError("S3 down"), False, ("undone", "failed", 1)),
    (GateFailed("no"), False, ("undone", "rejected", 4)),
    (ValueError("a bug"), False, ("undone", "failed", 1)),
    (SystemExit(3), False, ("undone", "failed", 1)),
])
def test_how_a_living_run_ends(exc: BaseException | None, committed: bool,
                               expected: tuple[str, str, int]) -> None:
    closing = closing_for(record(committed=committed), exc)
    assert (closing.goal, closing.status, closing.exit_code) == expected


def test_a_bake_breach_ends_rolled_back() -> None:
    rec = record(stages=("swap", "bake"))
    rec.bake = {"rolled_back": {"ok": True, "to_version": P}}
    closing = closing_for(rec, BakeBreached("p99 breached"))
    assert (closing.goal, closing.status, closing.exit_code) == ("undone", "rolled_back", 4)


# --------------------------------------------------------------------------------------
# the executor against a fake world


@dataclass
class World:
    """The fleet, the pin and MLflow, any of which can be down."""

    fleet: int | None = P
    pin: int | None = P
    aliases: dict[str, int] = field(default_factory=lambda: {"production": P, "previous": 3})
    tags: dict[int, str] = field(default_factory=dict)
    mlflow_down: bool = False
    triton_down: bool = False
    calls: list[str] = field(default_factory=list)

    def seen(self, rec: ReleaseRecord) -> Seen:
        mlflow: tuple[object, object] = (UNKNOWN, UNKNOWN) if self.mlflow_down else (
            self.aliases.get("production"), self.aliases.get("previous"))
        tag = None if self.mlflow_down else self.tags.get(rec.to_version or -1)
        return Seen(UNKNOWN if self.triton_down else self.fleet, self.pin,
                    mlflow[0], mlflow[1], tag)  # type: ignore[arg-type]

    def fleet_to(self, version: int | None) -> None:
        self.calls.append(f"fleet {version}")
        if self.triton_down:
            raise Unreachable("triton-0 did not answer")
        self.fleet = self.pin = version

    def set_alias(self, alias: str, version: int | None) -> None:
        self.calls.append(f"alias {alias} {version}")
        if self.mlflow_down:
            raise ConnectionRefusedError("[Errno 111] Connection refused")  # a raw vendor error
        if version is None:
            self.aliases.pop(alias, None)
        else:
            self.aliases[alias] = version

    def tag_release(self, version: int, release_id: str) -> None:
        self.calls.append(f"tag {version}")
        if self.mlflow_down:
            raise InfrastructureError("MLflow failed")
        self.tags[version] = release_id

    def says(self) -> tuple[object, object, object]:
        return self.fleet, self.pin, self.aliases.get("production")


class FakeLedger:
    def __init__(self, *records: ReleaseRecord) -> None:
        self.by_id = {r.id: r for r in records}
        self.written: list[tuple[str, str]] = []

    def records(self, model: str) -> list[ReleaseRecord]:
        return sorted(self.by_id.values(), key=lambda r: r.id, reverse=True)

    def write(self, rec: ReleaseRecord) -> None:
        self.written.append((rec.id, rec.status))


def test_mlflow_down_at_the_record_stage_ends_incomplete_and_the_next_command_finishes() -> None:
    """Defect 4 as a class: baked, MLflow refuses; the record says incomplete with what is
    missing; the next command (here: recover under its lock) finishes it once MLflow is
    back, and everything says v5."""
    world = World(fleet=C, pin=C, mlflow_down=True)
    rec = record(stages=("swap", "bake", "record"), committed=True)
    rec.holder["pid"] = -1  # not a live process of this host
    closing = closing_for(rec, InfrastructureError("MLflow at http://127.0.0.1:1 failed"))
    ending = carry_out(decide(rec, world.seen(rec), closing=closing), world)
    end_record(rec, ending)
    assert rec.status == "incomplete" and rec.exit_code == 1
    assert rec.incomplete["goal"] == "released"
    assert rec.incomplete["missing"] == [f"tags of v5: modelship.release_id={rec.id}",
                                         "alias previous -> v4", "alias production -> v5"]
    assert "Connection refused" in rec.incomplete["error"] or "MLflow" in rec.incomplete["error"]

    ledger = FakeLedger(rec)
    with pytest.raises(ReleaseIncomplete) as still:  # MLflow still down: stop, say so
        recover(ledger, "m", by="R2", observe=world.seen, effects=world)
    assert "could not be finished now" in still.value.message and rec.status == "incomplete"

    world.mlflow_down = False
    report = recover(ledger, "m", by="R3", observe=world.seen, effects=world)
    assert rec.status == "released" and rec.exit_code == 0 and rec.incomplete == {}
    assert world.says() == (C, C, C) and world.aliases["previous"] == P
    assert world.tags[C] == rec.id
    assert report["finished"][0]["goal"] == "released" and report["fleet"] is None


def test_a_stop_during_the_bake_undoes_the_swap() -> None:
    """Defect 2 as a class: SIGTERM in the bake; fleet and pin back on P, aliases untouched,
    the record cancelled with 143."""
    world = World(fleet=C, pin=C)
    rec = record(stages=("swap", "bake"))
    ending = carry_out(decide(rec, world.seen(rec),
                              closing=closing_for(rec, StopRequested(signal.SIGTERM))), world)
    end_record(rec, ending)
    assert (rec.status, rec.exit_code) == ("cancelled", 143)
    assert world.says() == (P, P, P) and world.calls == ["fleet 4"]


def test_a_fleet_that_cannot_be_put_back_ends_incomplete_and_aliases_stay() -> None:
    """The undo stops at the first step that fails: the aliases are not moved away from
    what serves."""
    world = World(fleet=C, pin=C, triton_down=True)
    rec = record(stages=("swap", "bake"))
    ending = carry_out(decide(rec, world.seen(rec),
                              closing=closing_for(rec, ValueError("bug"))), world)
    assert not ending.reached and ending.incomplete["goal"] == "undone"
    assert ending.incomplete["missing"] == ["fleet and pin: every replica on v4"]
    assert world.calls == ["fleet 4"] and world.aliases["production"] == P


def test_the_newest_unfinished_record_converges_older_ones_only_end() -> None:
    world = World(fleet="mixed")  # type: ignore[arg-type]
    older = record(stages=("canary", "swap"))
    older.id = "20000101T000000Z-aaaaaa"
    newer = record(stages=("canary", "swap"))
    for rec in (older, newer):
        rec.holder["pid"] = -1
        rec.holder["host"] = "elsewhere"  # reached its swap, so it held the lock: dead
    ledger = FakeLedger(older, newer)
    report = recover(ledger, "m", by="R9", observe=world.seen, effects=world)
    assert report["interrupted"] == [newer.id, older.id]
    assert older.status == "interrupted" and "newer run" in (older.reason or "")
    assert newer.status == "interrupted" and "undid" in (newer.reason or "")
    assert world.calls == ["fleet 4"] and report["fleet"] == {"ok": True, "to_version": P,
                                                             "goal": "undone"}


STATES: list[object] = [None, P, C, "mixed", UNKNOWN]


@pytest.mark.parametrize("goal", ["released", "undone"])
def test_from_any_state_the_steps_reach_the_target(goal: str) -> None:
    """Whatever the fleet, the pin and the aliases say, applying the planned steps gives
    exactly the target: released or undone, never in between."""
    rec = record(committed=goal == "released")
    closing = Closing(goal, "x", 0, "x")  # type: ignore[arg-type]
    for fleet, pin, production, previous in itertools.product(STATES, STATES, STATES,
                                                               STATES):
        for tag in (None, rec.id):
            now = Seen(fleet, pin, production, previous, tag)  # type: ignore[arg-type]
            decision = decide(rec, now, closing=closing)
            after = now
            for step in decision.steps:
                after = apply(after, step)
            target = decision.target
            assert isinstance(target, Target)
            assert (after.fleet, after.pin, after.production) == (target.version,) * 3
            if target.previous != KEEP:
                assert after.previous == target.previous
            if goal == "released":
                assert after.tag == rec.id and after.previous == P
            assert steps_to(target, after) == ()  # nothing left: converged
