"""The progressive canary's plan: every transition from each kind of look (issue 20 item 3)."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from modelship.policy import BakePolicy, CanaryPolicy, Policy
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit
from tasks import sequential, traffic_plan
from tasks.traffic_plan import (
    NOT_STARTED,
    ProgressivePlan,
    Status,
    StepEvent,
    StepLook,
    expected_split,
    next_action,
    not_carried_out,
    router_problem,
    same_split,
    step_event,
)

PLAN = ProgressivePlan(steps=(1.0, 5.0, 25.0, 50.0), min_s=10.0, max_s=60.0)


def at(step: int) -> TrafficSplit:
    return expected_split(PLAN, step)


def look(step: int, elapsed_s: float, decision: Status | None, *,
         live: TrafficSplit | None = None, dead: bool = False,
         problem: str | None = None) -> StepLook:
    """A look at ``step``; the router holds what the release set unless ``live`` says
    otherwise, or does not answer (``dead``)."""
    seen = None if dead else live if live is not None else at(step)
    return StepLook(step, elapsed_s, decision, seen, problem)


# (look, kind, step after, canary % after, outcome, exit code, words in the reason)
TRANSITIONS = [
    # start
    (look(NOT_STARTED, 0, None), "advance", 0, 1.0, "running", None, "starting"),
    # a breach steps back at once, at any age and any step
    (look(0, 0.5, "failed"), "step_back", NOT_STARTED, 0.0, "failed", 4, "breach at step 1/4"),
    (look(2, 30, "failed"), "step_back", NOT_STARTED, 0.0, "failed", 4, "(25 %)"),
    (look(3, 59, "failed"), "step_back", NOT_STARTED, 0.0, "failed", 4, "rejected"),
    # both arms failing alike: inconclusive, weight back to 0
    (look(1, 3, "inconclusive"), "step_back", NOT_STARTED, 0.0, "inconclusive", 6, "alike"),
    # the minimum holds even a pass
    (look(0, 9.9, "passed"), "hold", 0, 1.0, "running", None, "minimum"),
    (look(1, 0, None), "hold", 1, 5.0, "running", None, "minimum"),
    (look(2, 5, "continue"), "hold", 2, 25.0, "running", None, "minimum"),
    # a pass after the minimum advances; after the last step, the swap
    (look(0, 10, "passed"), "advance", 1, 5.0, "running", None, "step 2/4 (5 %)"),
    (look(2, 45, "passed"), "advance", 3, 50.0, "running", None, "step 4/4"),
    (look(3, 10, "passed"), "swap", NOT_STARTED, 0.0, "passed", None, "atomic swap"),
    # continue between the minimum and the ceiling holds
    (look(1, 30, "continue"), "hold", 1, 5.0, "running", None, "continue"),
    (look(3, 59.9, None), "hold", 3, 50.0, "running", None, "continue"),
    # the ceiling advances a step with no breach; at the last step it is inconclusive
    (look(0, 60, "continue"), "advance", 1, 5.0, "running", None, "ceiling"),
    (look(2, 61, None), "advance", 3, 50.0, "running", None, "no breach"),
    (look(3, 60, "continue"), "step_back", NOT_STARTED, 0.0, "inconclusive", 6, "no swap"),
    # a dead router: back to 100 % production, exit 1, whatever the judge says
    (look(1, 30, "passed", dead=True, problem="connection refused"), "abort", NOT_STARTED,
     0.0, "infrastructure", 1, "connection refused"),
    (look(NOT_STARTED, 0, None, dead=True), "abort", NOT_STARTED, 0.0, "infrastructure", 1,
     "did not answer"),
    (look(3, 10, "failed", dead=True), "abort", NOT_STARTED, 0.0, "infrastructure", 1,
     "not the candidate's"),
    # a stuck router: it holds another split than the one set
    (look(2, 20, "continue", live=at(1)), "abort", NOT_STARTED, 0.0, "infrastructure", 1,
     "stuck: it holds canary 5 %, the release set canary 25 %"),
    (look(0, 20, "passed", live=TrafficSplit(canary_pct=1.0, mirror_pct=10.0)), "abort",
     NOT_STARTED, 0.0, "infrastructure", 1, "mirror 10 %"),
    (look(NOT_STARTED, 0, None, live=TrafficSplit(canary_pct=25.0)), "abort", NOT_STARTED,
     0.0, "infrastructure", 1, "stuck"),
    # the routers' precision (0.01 %) is not a stuck router
    (look(0, 10, "passed", live=TrafficSplit(canary_pct=1.005)), "advance", 1, 5.0,
     "running", None, "passed"),
]


@pytest.mark.parametrize(("seen", "kind", "step", "canary", "outcome", "code", "words"),
                         TRANSITIONS)
def test_every_transition(seen: StepLook, kind: str, step: int, canary: float, outcome: str,
                          code: int | None, words: str) -> None:
    action = next_action(PLAN, seen)
    assert (action.kind, action.step, action.split.canary_pct, action.outcome,
            action.exit_code) == (kind, step, canary, outcome, code)
    assert action.split.mirror_pct == 0.0
    assert words in action.reason, action.reason
    assert action.ends == (kind in ("step_back", "swap", "abort"))
    if action.ends:
        assert action.split == PRODUCTION_ONLY


def test_a_walk_through_every_step_reaches_the_swap_and_each_weight_once() -> None:
    step, weights = NOT_STARTED, []
    for _ in range(20):
        action = next_action(PLAN, look(step, PLAN.min_s, "passed"))
        if action.ends:
            break
        weights.append(action.split.canary_pct)
        step = action.step
    assert weights == [1.0, 5.0, 25.0, 50.0]
    assert action.kind == "swap"


def test_a_single_step_plan_swaps_after_its_pass_and_is_inconclusive_at_its_ceiling() -> None:
    plan = ProgressivePlan(steps=(10.0,), min_s=1.0, max_s=5.0)
    live = expected_split(plan, 0)
    assert next_action(plan, StepLook(0, 1.0, "passed", live)).kind == "swap"
    ceiling = next_action(plan, StepLook(0, 5.0, "continue", live))
    assert (ceiling.kind, ceiling.exit_code) == ("step_back", 6)


def test_an_empty_plan_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="at least one step"):
        next_action(ProgressivePlan((), 1.0, 2.0), StepLook(NOT_STARTED, 0, None,
                                                            PRODUCTION_ONLY))


def test_the_plan_comes_from_the_policy() -> None:
    plan = ProgressivePlan.from_policy(CanaryPolicy(traffic="progressive", steps=[2, 20],
                                                    step_min_s=3, step_max_s=4))
    assert plan == ProgressivePlan((2.0, 20.0), 3.0, 4.0)
    default = ProgressivePlan.from_policy(CanaryPolicy(traffic="progressive"))
    assert default == PLAN


@pytest.mark.parametrize(
    ("expected", "live", "problem", "says"),
    [
        (PRODUCTION_ONLY, PRODUCTION_ONLY, None, None),
        (TrafficSplit(mirror_pct=10), TrafficSplit(mirror_pct=10.004), None, None),
        (TrafficSplit(mirror_pct=10), PRODUCTION_ONLY, None, "stuck"),
        (TrafficSplit(mirror_pct=10), None, "timed out after 15 s", "timed out after 15 s"),
        (PRODUCTION_ONLY, TrafficSplit(canary_pct=0.02), None, "canary 0.02 %"),
    ],
)
def test_router_problem(expected: TrafficSplit, live: TrafficSplit | None,
                        problem: str | None, says: str | None) -> None:
    found = router_problem(expected, live, problem)
    if says is None:
        assert found is None
    else:
        assert found is not None and says in found, found


def test_same_split_is_symmetric_and_bounded() -> None:
    a, b = TrafficSplit(canary_pct=5.0), TrafficSplit(canary_pct=5.01)
    assert same_split(a, b) and same_split(b, a)
    assert not same_split(a, TrafficSplit(canary_pct=5.02))


def test_the_step_event_is_json_and_round_trips() -> None:
    seen = look(2, 12.3456, "failed")
    action = next_action(PLAN, seen)
    event = step_event(PLAN, seen, action, at="2026-12-02T03:40:00.000+00:00")
    doc = json.loads(json.dumps(event.to_dict()))
    assert doc == {"at": "2026-12-02T03:40:00.000+00:00", "action": "step_back",
                   "step": NOT_STARTED, "weight_pct": 0.0, "from_step": 2,
                   "from_weight_pct": 25.0, "decision": "failed", "elapsed_s": 12.346,
                   "live": {"production_pct": 75.0, "canary_pct": 25.0, "mirror_pct": 0.0},
                   "outcome": "failed", "exit_code": 4, "reason": action.reason,
                   "load_ratio": None, "latency_judged": True}  # PLAN: replicas unknown
    back = StepEvent.from_dict(doc)
    assert back.to_dict() == doc
    assert back.line().startswith("progressive: step_back 25 % -> 0 %: breach at step 3/4")


def test_an_abort_event_records_that_the_router_did_not_answer() -> None:
    seen = look(1, 3, None, dead=True, problem="refused")
    event = step_event(PLAN, seen, next_action(PLAN, seen), at="t")
    assert event.to_dict()["live"] is None
    assert (event.outcome, event.exit_code, event.weight_pct) == ("infrastructure", 1, 0.0)


def test_the_judges_words_are_the_sequential_judges() -> None:
    assert set(get_args(traffic_plan.Status)) == set(get_args(sequential.Status))


@pytest.mark.parametrize(
    ("policy", "bake", "keys"),
    [
        (Policy(), True, None),
        (Policy(canary=CanaryPolicy(traffic="shadow")), True, None),
        (Policy(canary=CanaryPolicy(traffic="shadow")), False, ["canary.traffic"]),
        (Policy(canary=CanaryPolicy(traffic="progressive")), True, None),
        (Policy(canary=CanaryPolicy(traffic="progressive")), False, ["canary.traffic"]),
        (Policy(bake=BakePolicy(holdback_pct=5)), True, None),
        (Policy(bake=BakePolicy(holdback_pct=5)), False, None),
        (Policy(canary=CanaryPolicy(traffic="shadow"), bake=BakePolicy(holdback_pct=5)), True,
         None),
    ],
)
def test_live_traffic_keys_not_carried_out_yet_are_refused(
        policy: Policy, bake: bool, keys: list[str] | None) -> None:
    refusal = not_carried_out(policy, bake=bake)
    if keys is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.exit_code == 2
        assert refusal.details["keys"] == keys
        assert all(k in refusal.message for k in keys)
