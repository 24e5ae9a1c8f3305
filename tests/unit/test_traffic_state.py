"""Router state is part of the release (issue 20 item 5): the pure decision as a table, and
its executor, recovery's and reconcile's hooks and status's field against an in-memory
router (tests/fake_router.py) that can be dead or stuck."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from modelship.clients import Clients
from modelship.errors import InfrastructureError
from modelship.ledger import ReleaseRecord, StageEntry, now_iso
from modelship.settings import Settings
from modelship.traffic.port import PRODUCTION_ONLY, TrafficRouter, TrafficSplit
from tasks.reconcile import reconcile
from tasks.recovery import UNKNOWN, Seen, recover
from tasks.status import status_report
from tasks.traffic_plan import ProgressivePlan, StepLook, next_action, step_event
from tasks.traffic_state import (
    TrafficClaim,
    claim_of,
    configured_router,
    decide_router,
    holding,
    live_traffic,
    reconcile_hook,
    recovery_hook,
    return_to_production,
    settle_router,
    slot_claims,
    slot_owners,
    split_of,
    traffic_intent,
    with_event,
)
from tests.fake_router import FakeRouter

CANARY_25 = TrafficSplit(canary_pct=25.0)
MIRROR_10 = TrafficSplit(mirror_pct=10.0)
HOLDBACK_5 = TrafficSplit(canary_pct=5.0)

LIVE_RUN = TrafficClaim("release R-live", CANARY_25, alive=True)
SLOT_HOLDER = TrafficClaim("the canary slot's holder R-slot", None, alive=True)
KILLED = TrafficClaim("release R-killed", CANARY_25, alive=False)
KILLED_SHADOW = TrafficClaim("release R-shadow", MIRROR_10, alive=False)
RETURNED = TrafficClaim("release R-done", PRODUCTION_ONLY, alive=False)

# (case, live, claims) -> (action, owner, words in the reason)
CASES = [
    ("at production, nobody", PRODUCTION_ONLY, [], ("none", None, "100 % to production")),
    ("at production, a killed run's claim (never applied, or already restored)",
     PRODUCTION_ONLY, [KILLED], ("none", None, "100 % to production")),
    ("a live run owns its split", CANARY_25, [LIVE_RUN], ("leave", "release R-live", "owns")),
    ("the canary slot's live holder owns any split", MIRROR_10, [SLOT_HOLDER],
     ("leave", "the canary slot's holder R-slot", "is running")),
    ("a live owner wins over a killed one", CANARY_25, [KILLED, LIVE_RUN],
     ("leave", "release R-live", "owns")),
    ("a live owner, router unreadable: left alone", None, [LIVE_RUN],
     ("leave", "release R-live", "could not be read")),
    ("a killed release's split: restored", CANARY_25, [KILLED],
     ("restore", "release R-killed", "stopped with the traffic router at 75 % production")),
    ("a killed shadow's mirror: restored", MIRROR_10, [KILLED_SHADOW],
     ("restore", "release R-shadow", "10 % mirrored")),
    ("a killed bake's holdback: restored", HOLDBACK_5,
     [TrafficClaim("release R-bake", HOLDBACK_5, alive=False)],
     ("restore", "release R-bake", "5 % canary")),
    ("an orphan: nobody claims it", CANARY_25, [], ("restore", None, "orphaned split")),
    ("an orphan: the only claim says production", CANARY_25, [RETURNED],
     ("restore", None, "orphaned")),
    ("unreadable, a killed claim: restore anyway (idempotent)", None, [KILLED],
     ("restore", "release R-killed", "left 75 % production / 25 % canary")),
    ("unreadable, nobody claims a split: unknown, nothing to restore", None, [],
     ("unknown", None, "nothing is restored")),
    ("unreadable, the only claim says production: unknown", None, [RETURNED],
     ("unknown", None, "no release claims a split")),
]


@pytest.mark.parametrize(("case", "live", "claims", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_decide_router(case: str, live: TrafficSplit | None, claims: list[TrafficClaim],
                       expected: tuple[str, str | None, str]) -> None:
    decision = decide_router(live, claims, problem="connection refused")
    action, owner, words = expected
    assert (decision.action, decision.owner) == (action, owner)
    assert words in decision.reason, decision.reason
    assert decision.live == live
    json.dumps(decision.to_dict())


@pytest.mark.parametrize("claims", [[], [KILLED]])
def test_the_reason_says_why_the_router_was_not_read(claims: list[TrafficClaim]) -> None:
    decision = decide_router(None, claims, problem="no answer within 15 s")
    assert "no answer within 15 s" in decision.reason


# --------------------------------------------------------------------------------------
# what a release writes, and its claim


def running(traffic: dict[str, Any] | None = None) -> ReleaseRecord:
    rec = ReleaseRecord.start("promote", "m", from_version=4, to_version=5)
    rec.stages = [StageEntry("canary", now_iso())]
    rec.holder["pid"] = -1  # not a live process of this host: a dead run
    rec.traffic = traffic or {}
    return rec


def test_the_intent_is_written_before_each_change_and_keeps_the_events() -> None:
    plan = ProgressivePlan((1.0, 5.0), 1.0, 2.0)
    look = StepLook(0, 1.0, "passed", TrafficSplit(canary_pct=1.0))
    action = next_action(plan, look)
    first = traffic_intent({}, router="fake-router", split=TrafficSplit(canary_pct=1.0),
                           at="t0")
    logged = with_event(first, step_event(plan, look, action, at="t1"))
    second = traffic_intent(logged, router="fake-router", split=action.split, at="t2")
    assert second["split"] == {"production_pct": 95.0, "canary_pct": 5.0, "mirror_pct": 0.0}
    assert [e["action"] for e in second["events"]] == ["advance"]
    assert first["events"] == []  # pure: the earlier document is not changed
    rec = running(json.loads(json.dumps(second)))
    assert ReleaseRecord.from_dict(rec.to_dict()).traffic == second
    claim = claim_of(rec, alive=False)
    assert claim is not None and claim.split == TrafficSplit(canary_pct=5.0)
    assert "m" in claim.owner and rec.id in claim.owner


def test_a_release_that_never_touched_the_router_claims_nothing() -> None:
    assert claim_of(running(), alive=False) is None
    assert running().to_dict()["traffic"] == {}


def test_split_of_reads_the_to_dict_form() -> None:
    assert split_of(TrafficSplit(canary_pct=2.5, mirror_pct=7).to_dict()) == \
        TrafficSplit(canary_pct=2.5, mirror_pct=7)


def test_only_the_canary_slots_live_holder_is_an_owner() -> None:
    holder = {"release_id": "canary of m v5 (pid 12)"}
    rows = [{"lock": "canary", "held": True, "holder": holder, "holder_alive": True},
            {"lock": "canary", "held": True, "holder": holder, "holder_alive": False},
            {"lock": "release", "held": True, "holder": holder, "holder_alive": True},
            {"lock": "canary", "held": False, "holder": None, "holder_alive": None}]
    claims = slot_claims(rows)
    assert claims == [TrafficClaim("the canary slot's holder canary of m v5 (pid 12)", None,
                                   True)]


# --------------------------------------------------------------------------------------
# the executor


def test_the_fake_is_a_traffic_router() -> None:
    assert isinstance(FakeRouter(), TrafficRouter)


def test_an_orphan_is_returned_weight_first_then_mirror_and_read_back() -> None:
    router = FakeRouter(split=TrafficSplit(canary_pct=25.0, mirror_pct=10.0))
    report = settle_router(router, list)
    assert router.split == PRODUCTION_ONLY
    assert router.calls == [("live",), ("set_weights", 0.0), ("mirror", 0.0), ("live",)]
    assert (report["action"], report["restored"], report["router"]) == \
        ("restore", True, "fake-router")
    assert report["live"] == PRODUCTION_ONLY.to_dict() and "error" not in report


@pytest.mark.parametrize("claims", [[LIVE_RUN], [SLOT_HOLDER]])
def test_a_live_owners_split_is_never_written(claims: list[TrafficClaim]) -> None:
    router = FakeRouter(split=CANARY_25)
    report = settle_router(router, lambda: claims)
    assert router.writes == [] and router.split == CANARY_25
    assert (report["action"], report["restored"]) == ("leave", False)


def test_a_router_at_production_is_only_read() -> None:
    router = FakeRouter()
    asked: list[bool] = []

    def claims() -> list[TrafficClaim]:
        asked.append(True)
        return [KILLED]

    assert settle_router(router, claims)["action"] == "none"
    assert asked == []  # the lock store is not read for a router at rest
    assert router.calls == [("live",)]


@pytest.mark.parametrize(("router", "says"), [
    (FakeRouter(split=CANARY_25, dead=True), "does not answer"),
    (FakeRouter(split=CANARY_25, stuck=True), "stuck: it holds canary 25 %"),
])
def test_a_dead_or_stuck_router_is_reported_not_hidden(router: FakeRouter, says: str) -> None:
    report = settle_router(router, lambda: [KILLED])
    assert report["action"] == "restore" and report["restored"] is False
    assert says in report["error"], report["error"]
    with pytest.raises(InfrastructureError) as caught:
        return_to_production(router)
    assert caught.value.exit_code == 1 and says in caught.value.message


def test_a_router_failing_with_a_raw_error_is_translated() -> None:
    class Broken(FakeRouter):
        def set_weights(self, canary_pct: float) -> None:
            raise OSError("socket closed")

    with pytest.raises(InfrastructureError, match="socket closed"):
        return_to_production(Broken(split=CANARY_25))


def test_live_traffic_for_status() -> None:
    assert live_traffic(None) is None
    shown = live_traffic(FakeRouter(split=HOLDBACK_5))
    assert shown is not None and shown["live"]["canary_pct"] == 5.0
    assert shown["production_only"] is False and shown["router"] == "fake-router"
    down = live_traffic(FakeRouter(dead=True))
    assert down is not None and down["live"] is None and "does not answer" in down["error"]


# --------------------------------------------------------------------------------------
# recovery: a killed release's split is restored by the next run


class Ledger:
    def __init__(self, *records: ReleaseRecord) -> None:
        self.by_id = {r.id: r for r in records}

    def records(self, model: str) -> list[ReleaseRecord]:
        return sorted(self.by_id.values(), key=lambda r: r.id, reverse=True)

    def write(self, rec: ReleaseRecord) -> None:
        self.by_id[rec.id] = rec


class NoEffects:
    def fleet_to(self, version: int | None) -> None:
        raise AssertionError("a canary-stage record never touched the fleet")

    def set_alias(self, alias: str, version: int | None) -> None:
        raise AssertionError("no alias to set")

    def tag_release(self, version: int, release_id: str) -> None:
        raise AssertionError("no tag to set")


def _unseen(rec: ReleaseRecord) -> Seen:
    return Seen(UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN)


def killed_in_the_canary(split: TrafficSplit) -> ReleaseRecord:
    return running(traffic_intent({}, router="fake-router", split=split, at=now_iso()))


def test_the_next_run_restores_a_killed_progressive_canarys_split() -> None:
    rec = killed_in_the_canary(CANARY_25)
    router = FakeRouter(split=CANARY_25)
    report = recover(Ledger(rec), "m", by="R-next", observe=_unseen, effects=NoEffects(),
                     traffic=recovery_hook(router, list))
    assert router.split == PRODUCTION_ONLY
    assert report["traffic"]["action"] == "restore" and report["traffic"]["restored"]
    assert rec.id in report["traffic"]["owner"]
    assert rec.status == "interrupted" and report["interrupted"] == [rec.id]


def test_the_next_run_leaves_a_split_the_canary_slots_live_holder_owns() -> None:
    rec = killed_in_the_canary(MIRROR_10)
    router = FakeRouter(split=MIRROR_10)
    report = recover(Ledger(rec), "m", by="R-next", observe=_unseen, effects=NoEffects(),
                     traffic=recovery_hook(router, lambda: [SLOT_HOLDER]))
    assert router.split == MIRROR_10 and router.writes == []
    assert report["traffic"]["action"] == "leave"


def test_an_orphan_is_restored_even_with_no_unfinished_record() -> None:
    router = FakeRouter(split=CANARY_25)
    report = recover(Ledger(), "m", by="R-next", observe=_unseen, effects=NoEffects(),
                     traffic=recovery_hook(router, list))
    assert router.split == PRODUCTION_ONLY and report["traffic"]["owner"] is None


def test_a_router_that_cannot_be_restored_stops_the_command_before_the_records() -> None:
    rec = killed_in_the_canary(CANARY_25)
    router = FakeRouter(split=CANARY_25, dead=True)
    with pytest.raises(InfrastructureError) as caught:
        recover(Ledger(rec), "m", by="R-next", observe=_unseen, effects=NoEffects(),
                traffic=recovery_hook(router, list))
    assert caught.value.exit_code == 1
    assert "could not be returned to 100 % production" in caught.value.message
    assert rec.status == "running"  # found again by the command after the gateway is back


def test_without_a_router_recovery_is_unchanged() -> None:
    rec = killed_in_the_canary(CANARY_25)
    report = recover(Ledger(rec), "m", by="R-next", observe=_unseen, effects=NoEffects())
    assert "traffic" not in report and rec.status == "interrupted"


# --------------------------------------------------------------------------------------
# reconcile: an orphaned split back to production


class NoPins:
    """A bucket without any production pin: reconcile loads nothing."""

    bucket = "b"

    def head(self, key: str) -> None:
        return None


def _reconcile(router: FakeRouter, *, dry_run: bool = False,
               owners: list[TrafficClaim] | None = None) -> dict[str, Any]:
    return reconcile([], storage=NoPins(), repository_prefix="models",  # type: ignore[arg-type]
                     signing_key=b"k", model="m", dry_run=dry_run,
                     traffic=reconcile_hook(router, lambda: owners or []))


def test_reconcile_returns_an_orphaned_split_to_production() -> None:
    router = FakeRouter(split=TrafficSplit(canary_pct=50.0, mirror_pct=5.0))
    doc = _reconcile(router)
    assert router.split == PRODUCTION_ONLY and doc["ok"] is True
    assert doc["traffic"]["action"] == "restore" and "orphaned" in doc["traffic"]["reason"]


def test_reconcile_fails_the_round_on_a_stuck_router_and_still_reconciles() -> None:
    doc = _reconcile(FakeRouter(split=CANARY_25, stuck=True))
    assert doc["ok"] is False and "stuck" in doc["traffic"]["error"]
    assert [m["model"] for m in doc["models"]] == ["m"]


def test_reconcile_leaves_a_live_owner_and_a_dry_run_alone() -> None:
    owned = FakeRouter(split=CANARY_25)
    assert _reconcile(owned, owners=[SLOT_HOLDER])["traffic"]["action"] == "leave"
    dry = FakeRouter(split=CANARY_25)
    doc = _reconcile(dry, dry_run=True)
    assert dry.calls == [] and "traffic" not in doc


# --------------------------------------------------------------------------------------
# status shows the live weights


def _status(tmp_path: Path, router: TrafficRouter | None) -> dict[str, Any]:
    settings = Settings(home=tmp_path, http_timeout_s=0.25)
    clients = Clients(registry=None, storage=None, prefect=None, slack=None)
    return status_report(settings, clients, model="m", router=router)


def test_status_has_no_traffic_without_a_router(tmp_path: Path) -> None:
    doc = _status(tmp_path, None)
    assert "traffic" in doc and doc["traffic"] is None


def test_status_shows_the_live_weights(tmp_path: Path) -> None:
    doc = _status(tmp_path, FakeRouter(split=HOLDBACK_5))
    assert doc["traffic"]["live"] == {"production_pct": 95.0, "canary_pct": 5.0,
                                      "mirror_pct": 0.0}
    assert doc["traffic"]["router"] == "fake-router"
    json.dumps(doc, default=str)


def test_status_says_a_hung_router_did_not_answer_by_its_deadline(tmp_path: Path) -> None:
    never = threading.Event()

    class Hung(FakeRouter):
        def live(self) -> TrafficSplit:
            never.wait()
            return self.split

    try:
        doc = _status(tmp_path, Hung())
    finally:
        never.set()
    assert doc["traffic"]["live"] is None and "no answer within" in doc["traffic"]["error"]


# --------------------------------------------------------------------------------------
# a split held for a block: the shadow's mirror, the bake's holdback


class Writes(list[tuple[float, float, TrafficSplit]]):
    """(canary %, mirror %) of each write, with what the router held then."""

    def __init__(self, router: FakeRouter) -> None:
        super().__init__()
        self.router = router

    def __call__(self, doc: dict[str, Any]) -> None:
        self.append((doc["split"]["canary_pct"], doc["split"]["mirror_pct"],
                     self.router.split))


@pytest.mark.parametrize("split", [MIRROR_10, HOLDBACK_5])
def test_a_held_split_is_written_first_live_in_the_block_and_production_after(
        split: TrafficSplit) -> None:
    router = FakeRouter()
    writes = Writes(router)
    with holding(router, split, write=writes) as doc:
        assert router.split == split and doc["split"] == split.to_dict()
    assert router.split == PRODUCTION_ONLY
    assert writes == [(split.canary_pct, split.mirror_pct, PRODUCTION_ONLY),
                      (0.0, 0.0, split)]


def test_a_block_that_raises_still_returns_the_router_and_its_error_goes_on() -> None:
    router = FakeRouter()
    writes = Writes(router)
    with pytest.raises(KeyboardInterrupt), holding(router, HOLDBACK_5, write=writes):
        raise KeyboardInterrupt
    assert router.split == PRODUCTION_ONLY and writes[-1][:2] == (0.0, 0.0)


def test_a_block_that_raises_with_a_dead_router_keeps_its_own_error() -> None:
    router = FakeRouter()
    lines: list[str] = []
    with pytest.raises(ValueError, match="bake bug"), \
            holding(router, HOLDBACK_5, write=Writes(router), progress=lines.append):
        router.dead = True
        raise ValueError("bake bug")
    assert router.split == HOLDBACK_5  # the record says production: the next run restores it
    assert any("next modelship command restores it" in line for line in lines)


@pytest.mark.parametrize(("router", "says"), [
    (FakeRouter(dead=True), "could not be returned"),
    (FakeRouter(stuck=True), "stuck: it holds canary 0 %, the release set canary 0 %, "
                             "mirror 10 %; weights back to 100 % production"),
])
def test_a_router_that_does_not_take_the_split_runs_no_block(router: FakeRouter,
                                                            says: str) -> None:
    ran = []
    with pytest.raises(InfrastructureError) as caught, \
            holding(router, MIRROR_10, write=Writes(router)):
        ran.append(True)
    assert not ran and caught.value.exit_code == 1
    assert says in caught.value.message, caught.value.message


def test_a_router_that_cannot_be_returned_after_a_good_block_fails_the_release() -> None:
    router = FakeRouter()
    with pytest.raises(InfrastructureError, match="does not answer"), \
            holding(router, HOLDBACK_5, write=Writes(router)):
        router.dead = True


def test_without_s3_nobody_owns_the_router(tmp_path: Path) -> None:
    assert slot_owners(None, home=tmp_path)() == []


def test_a_gateway_outage_alone_never_blocks_a_command() -> None:
    """No release claims a split: an unreadable router is reported, recovery goes on."""
    rec = running()  # a killed replay canary: it never touched the router
    router = FakeRouter(dead=True)
    report = recover(Ledger(rec), "m", by="R-next", observe=_unseen, effects=NoEffects(),
                     traffic=recovery_hook(router, list))
    assert report["traffic"]["action"] == "unknown" and "does not answer" in \
        report["traffic"]["unread"]
    assert router.writes == [] and rec.status == "interrupted"


def test_reconcile_fails_the_round_on_an_unreadable_router() -> None:
    doc = _reconcile(FakeRouter(dead=True))
    assert doc["ok"] is False and doc["traffic"]["action"] == "unknown"


def test_a_ledger_that_cannot_be_written_never_keeps_the_router_off_production() -> None:
    router = FakeRouter()
    calls: list[float] = []

    def write(doc: dict[str, Any]) -> None:
        calls.append(doc["split"]["canary_pct"])
        if doc["split"]["canary_pct"] == 0.0:
            raise OSError("S3 down")

    lines: list[str] = []
    with holding(router, HOLDBACK_5, write=write, progress=lines.append):
        pass
    assert router.split == PRODUCTION_ONLY and calls == [5.0, 0.0]
    assert any("goes back anyway" in line for line in lines)


def test_recovery_finds_no_router_without_a_stack_and_a_note_for_a_broken_one(
        tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    lines: list[str] = []
    assert configured_router(settings, lines.append) is None and lines == []
    settings.stack_file.parent.mkdir(parents=True, exist_ok=True)
    settings.stack_file.write_text("{not json")
    assert configured_router(settings, lines.append) is None
    assert len(lines) == 1 and "not readable JSON" in lines[0]
