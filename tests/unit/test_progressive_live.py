"""The live judge of the progressive canary (tasks/live_judge.py): per-version looks from
Triton's counters, and its decisions on seeded live traffic, as table tests."""

from __future__ import annotations

import numpy as np
import pytest

from modelship.policy import CanaryPolicy, Policy
from modelship.triton.metrics import (
    COMPUTE_INFER_US,
    FAILURE,
    QUEUE_US,
    SUCCESS,
    VersionMetrics,
)
from tasks.live_judge import ArmLook, LiveJudge, LiveRules, arm_look
from tasks.progressive import replay_policy
from tasks.traffic_plan import not_carried_out

MODEL = "m"


def _scrape(version: str, ok: float, failed: float, queue_us: float, infer_us: float
            ) -> dict[tuple[str, str], VersionMetrics]:
    return {(MODEL, version): VersionMetrics(counters={
        SUCCESS: ok, FAILURE: failed, QUEUE_US: queue_us, COMPUTE_INFER_US: infer_us})}


def test_a_look_adds_up_the_servers_and_weighs_the_latency_by_requests() -> None:
    before = {"a": _scrape("2", 100, 0, 1_000, 10_000), "b": _scrape("2", 50, 1, 0, 0)}
    after = {"a": _scrape("2", 110, 0, 1_100, 11_000),   # 10 ok at 110 µs each
             "b": _scrape("2", 80, 3, 300, 9_000)}       # 30 ok at 310 µs each, 2 failed
    look = arm_look(before, after, model=MODEL, version=2)
    assert (look.requests, look.failures) == (40, 2)
    assert look.server_us == pytest.approx((10 * 110 + 30 * 310) / 40)


@pytest.mark.parametrize(("before", "after", "expected"), [
    ({}, {"a": _scrape("2", 5, 0, 0, 50)}, ArmLook()),                  # no earlier scrape
    ({"a": _scrape("2", 5, 0, 0, 50)}, {"a": _scrape("3", 5, 0, 0, 50)},
     ArmLook()),                                                        # another version
    ({"a": _scrape("2", 5, 0, 0, 50)}, {"a": _scrape("2", 5, 1, 0, 50)},
     ArmLook(0, 1, None)),                                              # failures only
])
def test_a_look_without_evidence_is_empty(before: dict, after: dict,
                                          expected: ArmLook) -> None:
    assert arm_look(before, after, model=MODEL, version=2) == expected


RULES = LiveRules.from_policy(Policy())


def _run(ratio: float, looks: int, seed: int, *, c_rate: float = 0.0, p_rate: float = 0.0,
         per_look: int = 20) -> list[str]:
    """Seeded live looks: production's mean µs per request ~1500 with a look-to-look
    spread of 15 %, the candidate ``ratio`` × that, errors at the given rates."""
    rng = np.random.default_rng(seed)
    judge = LiveJudge(RULES)
    seen: list[str] = []
    for _ in range(looks):
        p_us = 1500.0 * float(np.exp(rng.normal(0, 0.15)))
        c_us = ratio * 1500.0 * float(np.exp(rng.normal(0, 0.15)))
        c_fail = int(rng.binomial(per_look, c_rate))
        p_fail = int(rng.binomial(per_look * 20, p_rate))
        seen.append(judge.update(ArmLook(per_look - c_fail, c_fail, c_us),
                                 ArmLook(per_look * 20 - p_fail, p_fail, p_us)).status)
        if seen[-1] != "continue":
            break
    return seen


def test_a_slow_candidate_fails_within_two_dozen_looks() -> None:
    """Within 12 s at a look every 0.5 s: 9-22 looks for these seeds (the counts are
    deflated by the looks' measured dependence, whose bound is wide early; undeflated it
    took at most 12)."""
    for seed in range(20):
        seen = _run(3.0, 40, seed)
        assert seen[-1] == "failed" and len(seen) <= 24, (seed, seen)


def test_an_identical_candidate_is_not_failed_over_many_looks() -> None:
    failed = sum(_run(1.0, 120, seed)[-1] == "failed" for seed in range(100))
    assert failed <= 3  # α = 0.01 per rule over all looks; 3 of 100 is a loose bound


def test_an_identical_candidate_is_passed_once_enough_requests_are_shown() -> None:
    seen = _run(1.0, 400, 7, per_look=200)
    assert seen[-1] == "passed", seen[-5:]


def test_candidate_errors_over_budget_fail_and_shared_errors_are_inconclusive() -> None:
    assert _run(1.0, 40, 1, c_rate=0.2)[-1] == "failed"
    assert _run(1.0, 40, 1, c_rate=0.2, p_rate=0.2)[-1] == "inconclusive"


def test_a_look_with_no_candidate_answer_is_not_judged() -> None:
    judge = LiveJudge(RULES)
    for _ in range(30):
        decision = judge.update(ArmLook(0, 0, None), ArmLook(100, 0, 1500.0))
    assert (decision.status, decision.judged, decision.looks) == ("continue", 0, 30)


def test_the_rules_come_from_the_gates() -> None:
    policy = Policy.model_validate({"gates": [
        {"name": "p99", "metric": "latency_p99_ms", "test": "quantile",
         "max_increase_pct": 50},
        {"name": "p50", "metric": "latency_p50_ms", "test": "mann_whitney",
         "max_increase_pct": 20},
        {"name": "errors", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.05}]})
    rules = LiveRules.from_policy(policy)
    assert (rules.latency.name, rules.latency.tolerance) == ("p50", 20)
    assert (rules.errors.name, rules.errors.tolerance) == ("errors", 0.05)


def test_a_first_release_under_progressive_replays_and_promote_carries_progressive() -> None:
    policy = Policy(canary=CanaryPolicy(traffic="progressive", steps=[5, 25], step_min_s=1))
    replay = replay_policy(policy)
    assert (replay.canary.traffic, replay.canary.steps) == ("replay", None)
    assert not_carried_out(replay, bake=False) is None
    assert not_carried_out(policy) is None
    assert policy.canary.traffic == "progressive"  # the original is untouched
