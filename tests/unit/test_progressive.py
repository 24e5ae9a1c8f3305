"""The progressive canary's executor against an in-memory router and a fake clock: every
way out returns the router to 100 % production, and each transition is written before the
router changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from modelship.errors import InfrastructureError
from modelship.ledger import ReleaseRecord
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit
from tasks.progressive import Progressive, run_progressive
from tasks.traffic_plan import ProgressivePlan, Status, StepEvent
from tasks.traffic_state import TrafficClaim, claim_of, decide_router, split_of
from tests.fake_router import FakeRouter

PLAN = ProgressivePlan(steps=(1.0, 5.0, 25.0, 50.0), min_s=2.0, max_s=6.0)


@dataclass
class Rig:
    """The clock, the record's writes (with what the router held at each) and the Slack
    thread."""

    router: FakeRouter = field(default_factory=FakeRouter)
    t: float = 0.0
    written: list[tuple[dict[str, Any], TrafficSplit]] = field(default_factory=list)
    announced: list[StepEvent] = field(default_factory=list)

    def run(self, judge: Callable[[int], Status | None]) -> Any:
        return run_progressive(Progressive(
            plan=PLAN, router=self.router, judge=judge, write=self.write, look_s=1.0,
            announce=self.announced.append, clock=lambda: self.t, sleep=self.sleep,
            now=lambda: f"t={self.t:g}"))

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def write(self, doc: dict[str, Any]) -> None:
        self.written.append((doc, self.router.split))

    @property
    def intents(self) -> list[float]:
        return [doc["split"]["canary_pct"] for doc, _ in self.written]


def passing(step: int) -> Status:
    return "passed"


def test_a_candidate_that_passes_every_step_is_handed_to_the_swap() -> None:
    rig = Rig()
    result = rig.run(passing)
    assert (result.action.kind, result.action.outcome) == ("swap", "passed")
    assert rig.router.split == PRODUCTION_ONLY
    assert rig.intents == [1.0, 5.0, 25.0, 50.0, 0.0]
    assert [c for c in rig.router.writes if c[0] == "set_weights"] == [
        ("set_weights", w) for w in (1.0, 5.0, 25.0, 50.0, 0.0)]
    assert [e.action for e in rig.announced] == ["advance"] * 4 + ["swap"]
    assert [e["weight_pct"] for e in result.traffic["events"]] == [1.0, 5.0, 25.0, 50.0, 0.0]
    # each step was live for its minimum, never less
    assert all(e.elapsed_s >= PLAN.min_s for e in rig.announced[1:])


def test_each_transition_is_written_before_the_router_changes() -> None:
    rig = Rig()
    rig.run(passing)
    held = [held.canary_pct for _, held in rig.written]
    assert held == [0.0, 1.0, 5.0, 25.0, 50.0]  # the router still held the previous split


def test_a_breach_steps_back_to_zero_at_the_first_step_that_shows_it() -> None:
    rig = Rig()
    result = rig.run(lambda step: "failed" if step == 2 else "passed")
    assert (result.action.kind, result.action.exit_code) == ("step_back", 4)
    assert rig.router.split == PRODUCTION_ONLY
    assert rig.intents == [1.0, 5.0, 25.0, 0.0]
    breach = rig.announced[-1]
    assert (breach.from_weight_pct, breach.weight_pct, breach.decision) == (25.0, 0.0, "failed")
    # the breach was acted on at the first look of that step: no second look
    assert breach.elapsed_s == 1.0


def test_a_step_that_never_decides_advances_at_its_ceiling_and_ends_inconclusive() -> None:
    rig = Rig()
    result = rig.run(lambda step: "continue")
    assert (result.action.kind, result.action.outcome, result.action.exit_code) == \
        ("step_back", "inconclusive", 6)
    assert rig.intents == [1.0, 5.0, 25.0, 50.0, 0.0] and rig.router.split == PRODUCTION_ONLY


def test_a_dead_router_is_an_infrastructure_failure_with_the_weights_returned_when_back(
) -> None:
    rig = Rig()

    def judge(step: int) -> Status:
        if step == 1:
            rig.router.dead = True  # the gateway dies during step 2
        return "continue"

    with pytest.raises(InfrastructureError) as caught:
        rig.run(judge)
    assert caught.value.exit_code == 1
    assert "could not be returned to 100 % production" in caught.value.message
    assert rig.intents[-1] == 0.0  # the record says production: the next run restores it
    rig.router.dead = False
    claim = TrafficClaim("release R", split_of(rig.written[-1][0]["split"]), alive=False)
    assert decide_router(rig.router.live(), [claim]).action == "restore"


def test_a_stuck_router_aborts_and_the_weights_return_to_production() -> None:
    rig = Rig(router=FakeRouter(stuck=True))
    with pytest.raises(InfrastructureError) as caught:
        rig.run(passing)
    assert caught.value.exit_code == 1 and "stuck" in caught.value.message
    assert rig.router.split == PRODUCTION_ONLY
    assert rig.announced[-1].action == "abort" and rig.intents[-1] == 0.0


def test_a_router_stuck_on_a_weight_is_reported_and_left_for_the_next_run() -> None:
    rig = Rig()

    def judge(step: int) -> Status:
        if step == 1:
            rig.router.stuck = True  # stuck from 5 % on
        return "passed"

    with pytest.raises(InfrastructureError) as caught:
        rig.run(judge)
    assert "holds canary 5 %, the release set canary 25 %" in caught.value.message
    assert "could not be returned to 100 % production" in caught.value.message
    assert rig.router.split == TrafficSplit(canary_pct=5.0)
    assert rig.intents[-1] == 0.0


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), RuntimeError("judge bug")])
def test_a_signal_or_an_error_of_the_judge_returns_the_router_and_goes_on_up(
        stop: BaseException) -> None:
    rig = Rig()

    def judge(step: int) -> Status:
        if step == 2:
            raise stop
        return "passed"

    with pytest.raises(type(stop)):
        rig.run(judge)
    assert rig.router.split == PRODUCTION_ONLY and rig.intents[-1] == 0.0


@pytest.mark.parametrize("kill_after", range(5))
def test_a_run_killed_after_any_write_leaves_a_split_the_next_run_restores(
        kill_after: int) -> None:
    """SIGKILL runs no handler: the router holds at most what the last write claims (the
    write comes first), and the next run's decision returns it to production."""
    rig = Rig()
    rig.run(passing)
    doc, _ = rig.written[kill_after]
    before = rig.written[kill_after][1]
    record = ReleaseRecord.start("promote", "m")
    record.traffic = doc
    claim = claim_of(record, alive=False)
    assert claim is not None and claim.split is not None
    # killed just before or just after the router applied the written split
    for live in (before, claim.split):
        decision = decide_router(live, [claim])
        assert decision.action == ("none" if live.is_production_only else "restore")


def test_a_ledger_down_stops_the_steps_and_the_router_still_returns() -> None:
    rig = Rig()

    def write(doc: dict[str, Any]) -> None:
        rig.written.append((doc, rig.router.split))
        if doc["split"]["canary_pct"] in (25.0, 0.0):
            raise OSError("S3 down")  # never set a weight the record does not claim

    with pytest.raises(OSError, match="S3 down"):
        run_progressive(Progressive(plan=PLAN, router=rig.router, judge=passing, write=write,
                                    clock=lambda: rig.t, sleep=rig.sleep))
    assert rig.router.split == PRODUCTION_ONLY
    assert ("set_weights", 25.0) not in rig.router.calls


def test_the_time_from_the_deciding_look_to_production_is_measured() -> None:
    """The seconds from the look that decided the step back to the router read back at
    production: here the record's write takes 0.25 s of the fake clock."""
    rig = Rig()
    write = rig.write

    def slow_write(doc: dict[str, Any]) -> None:
        write(doc)
        rig.t += 0.25

    rig.write = slow_write  # type: ignore[method-assign]
    result = rig.run(lambda step: "failed")
    assert result.action.kind == "step_back"
    assert result.to_production_s == pytest.approx(0.25)
