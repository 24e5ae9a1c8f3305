"""The progressive canary's per-server load (issue 20): the one canary Triton serves the
candidate's share alone while each replica serves ``(1 - w)/N``, so at large steps the
candidate's server is busier than a replica. The plan states each step's load relative to
a replica's, the judge counts latency only at steps of at most equal load (errors at every
step), and the record and the Slack line say which. Tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from modelship.policy import CanaryPolicy, Policy
from modelship.traffic.port import TrafficSplit
from tasks.live_judge import ArmLook, LiveJudge, LiveRules
from tasks.traffic_plan import (
    NOT_STARTED,
    ProgressivePlan,
    StepEvent,
    StepLook,
    latency_judged,
    load_words,
    next_action,
    server_load,
    step_event,
    step_loads,
)

RULES = LiveRules.from_policy(Policy())


@pytest.mark.parametrize(("weight", "replicas", "expected"), [
    (1.0, 2, 0.0202),      # 1 / 99 x 2
    (5.0, 2, 0.1053),
    (25.0, 2, 0.6667),
    (50.0, 2, 2.0),        # the session-22 gap: twice a replica's load
    (50.0, 1, 1.0),        # one replica: equal at 50 %
    (25.0, 3, 1.0),        # three replicas: equal at 25 %
    (50.0, 3, 3.0),
    (33.3333, 2, 1.0),     # 1/(1 + N): the largest fair weight
    (0.0, 2, 0.0),         # nothing live
])
def test_the_canary_servers_load_relative_to_a_replica(weight: float, replicas: int,
                                                       expected: float) -> None:
    assert server_load(weight, replicas) == pytest.approx(expected, abs=1e-3)


def test_an_unknown_fleet_or_a_whole_share_are_said_as_such() -> None:
    assert server_load(50.0, 0) is None
    assert server_load(100.0, 2) == math.inf


@pytest.mark.parametrize(("load", "judged"), [
    (None, True),          # replicas unknown: as before (judged)
    (0.0, True), (0.6667, True), (1.0, True),
    (1.0 + 1e-7, True),    # float noise at exactly 1/(1 + N)
    (1.01, False), (2.0, False), (math.inf, False),
])
def test_latency_is_judged_up_to_equal_load_only(load: float | None, judged: bool) -> None:
    assert latency_judged(load) is judged
    assert ("NOT judged" in load_words(load)) is not judged


@pytest.mark.parametrize(("steps", "replicas", "judged", "warned"), [
    ((1.0, 5.0, 25.0, 50.0), 2, [True, True, True, False], False),  # the default steps
    ((1.0, 5.0, 25.0, 50.0), 1, [True, True, True, True], False),
    ((1.0, 5.0, 25.0, 50.0), 4, [True, True, False, False], False),
    ((5.0, 25.0, 50.0), 2, [True, True, False], False),              # the e2e test's
    ((60.0, 80.0), 1, [False, False], True),                          # no fair step
    ((50.0,), 0, [True], False),                                      # replicas unknown
])
def test_the_plan_states_each_steps_load_and_flags_those_above_equal(
        steps: tuple[float, ...], replicas: int, judged: list[bool], warned: bool) -> None:
    plan = ProgressivePlan(steps, 1.0, 10.0, replicas)
    loads = step_loads(plan)
    assert [s["latency_judged"] for s in loads["steps"]] == judged
    assert [s["above_equal_load"] for s in loads["steps"]] == [not j for j in judged]
    assert [s["weight_pct"] for s in loads["steps"]] == list(steps)
    assert (loads["warning"] is not None) is warned
    if warned:
        assert "latency is judged at no step" in loads["warning"]
        assert f"{100 / (1 + replicas):.3g} %" in loads["warning"]


def test_the_plan_comes_with_the_fleets_replica_count() -> None:
    canary = CanaryPolicy(traffic="progressive", steps=[5, 25, 50])
    plan = ProgressivePlan.from_policy(canary, replicas=2)
    assert [plan.latency_judged(i) for i in range(3)] == [True, True, False]
    assert plan.load(2) == pytest.approx(2.0)
    assert plan.load(NOT_STARTED) == 0.0
    assert ProgressivePlan.from_policy(canary).replicas == 0  # unknown: every step judged


PLAN = ProgressivePlan((1.0, 5.0, 25.0, 50.0), 2.0, 60.0, replicas=2)


@pytest.mark.parametrize(("step", "decision", "load", "judged", "shown"), [
    (NOT_STARTED, None, 0.0202, True, "0.02× a replica's load"),  # start: to 1 %
    (2, "passed", 2.0, False, "2.00× a replica's load: latency NOT judged"),
    (1, "passed", 0.6667, True, "0.67× a replica's load: latency judged"),
])
def test_each_event_says_the_load_after_it_and_whether_latency_is_judged(
        step: int, decision: str | None, load: float, judged: bool, shown: str) -> None:
    look = StepLook(step, 5.0, decision, TrafficSplit(canary_pct=PLAN.weight(step)))  # type: ignore[arg-type]
    action = next_action(PLAN, look)
    event = step_event(PLAN, look, action, at="t")
    assert event.load_ratio == pytest.approx(load, abs=1e-3)
    assert event.latency_judged is judged
    assert shown in event.line()
    doc = event.to_dict()
    assert doc["latency_judged"] is judged and doc["load_ratio"] == pytest.approx(load, abs=1e-3)
    assert StepEvent.from_dict(doc) == StepEvent.from_dict(StepEvent.from_dict(doc).to_dict())


def test_a_way_out_carries_no_load_and_an_old_record_still_reads() -> None:
    look = StepLook(3, 5.0, "failed", TrafficSplit(canary_pct=50.0))
    event = step_event(PLAN, look, next_action(PLAN, look), at="t")
    assert event.weight_pct == 0.0 and event.load_ratio == 0.0
    assert "replica's load" not in event.line()   # back at production: nothing to say
    old = {k: v for k, v in event.to_dict().items()
           if k not in ("load_ratio", "latency_judged")}
    read = StepEvent.from_dict(old)
    assert read.load_ratio is None and read.latency_judged is True


def _looks(ratio: float, n: int, rng: np.random.Generator, per_look: int = 200
           ) -> list[tuple[ArmLook, ArmLook]]:
    """``n`` looks: production ~1500 µs per request with a 15 % look-to-look spread, the
    candidate ``ratio`` × that."""
    out = []
    for _ in range(n):
        p_us = 1500.0 * float(np.exp(rng.normal(0, 0.15)))
        c_us = ratio * 1500.0 * float(np.exp(rng.normal(0, 0.15)))
        out.append((ArmLook(per_look, 0, c_us), ArmLook(per_look * 10, 0, p_us)))
    return out


def _canary(fair: float, busy: float, seed: int, *, rule: bool,
            fair_looks: int = 60, busy_looks: int = 120) -> tuple[str, LiveJudge]:
    """One canary as the executor runs it: looks at a step of fair load (the candidate
    ``fair`` × production) until the judge passes it (at most ``fair_looks``), then
    ``busy_looks`` at the next step, where its server carries 2× a replica's load
    (``busy`` ×); ``rule``: the load rule on (False: every look judged, as before)."""
    rng = np.random.default_rng(seed)
    judge = LiveJudge(RULES)
    status = "continue"
    for c, p in _looks(fair, fair_looks, rng):
        status = judge.update(c, p).status
        if status != "continue":
            break
    if status in ("failed", "inconclusive"):
        return status, judge
    for c, p in _looks(busy, busy_looks, rng):
        status = judge.update(c, p, latency=not rule).status
        if status in ("failed", "inconclusive"):
            break
    return status, judge


@pytest.mark.parametrize("busy", [1.5, 1.8])
def test_a_good_model_on_a_busier_server_is_no_longer_failed_on_latency(busy: float) -> None:
    """The gap, before and after, side by side on the same seeded looks: an identical
    model whose server at 2× a replica's load answers ``busy`` × slower (1.8: queueing
    1/(1 - 0.72) against 1/(1 - 0.36) at a replica's 36 % utilisation, the same compute)
    after a fair step of at most 60 looks (30 s). Before the rule, all 20 canaries were
    failed at the busy step (and the release rolled back); with it, none: each ends as its
    fair step left it (passed, or still undecided for the step's ceiling to settle)."""
    before = [_canary(1.0, busy, seed, rule=False, fair_looks=60)[0] for seed in range(20)]
    after = [_canary(1.0, busy, seed, rule=True, fair_looks=60)[0] for seed in range(20)]
    assert before.count("failed") == 20, before
    assert "failed" not in after and "passed" in after, after


def test_a_slow_candidate_is_still_failed_at_the_fair_step() -> None:
    for seed in range(10):
        status, judge = _canary(3.0, 3.0, seed, rule=True)
        assert status == "failed" and judge.load_skipped == 0, (seed, status)


def test_looks_above_equal_load_count_for_errors_but_not_for_latency() -> None:
    judge = LiveJudge(RULES)
    for _ in range(30):   # far slower AND failing, at a busy step only
        decision = judge.update(ArmLook(80, 20, 9000.0), ArmLook(1000, 0, 1500.0),
                                latency=False)
        if decision.status != "continue":
            break
    assert decision.status == "failed" and "errors" in decision.reason, decision.reason
    assert judge.judged == 0 and judge.above == 0 and judge.load_skipped == judge.looks
    assert decision.evidence["latency"]["looks_not_judged_for_load"] == judge.looks


def test_a_canary_judged_at_no_fair_step_is_never_passed_on_latency() -> None:
    judge = LiveJudge(RULES)
    for _ in range(300):
        decision = judge.update(ArmLook(2000, 0, 1400.0), ArmLook(20000, 0, 1500.0),
                                latency=False)
    assert decision.status == "continue", decision.reason  # the ceiling ends it inconclusive
    assert "300 more not judged" in decision.reason


@pytest.mark.parametrize(("steps", "replicas", "lines", "warned"), [
    ((5.0, 25.0, 50.0), 2, ["step 5 %: canary server at 0.11× a replica's load; latency judged",
                            "step 50 %: canary server at 2.00× a replica's load; latency NOT "
                            "judged (above equal load; errors still are)"], False),
    ((60.0,), 1, ["step 60 %: canary server at 1.50× a replica's load; latency NOT judged"],
     True),
    ((50.0,), 0, ["step 50 %: canary server at ? (replicas unknown) a replica's load; "
                  "latency judged"], False),
])
def test_the_dry_run_prints_each_steps_load(steps: tuple[float, ...], replicas: int,
                                            lines: list[str], warned: bool) -> None:
    from modelship.cli.release import render_record

    loads = step_loads(ProgressivePlan(steps, 1.0, 10.0, replicas))
    record = {"kind": "promote", "model": "m", "from_version": 1, "to_version": 2,
              "status": "planned", "exit_code": 0, "id": "r1", "stages": [],
              "plan": {"stages": ["resolve"], "gates": [],
                       "canary": {"expected_s": "-", "step_loads": loads},
                       "replicas": ["triton-0"], "rollback_target": 1,
                       "approval": {"required": False, "approvers": []}}}
    shown = render_record(record)
    for line in lines:
        assert line in shown, shown
    assert ("WARNING: no step leaves the canary server" in shown) is warned, shown
