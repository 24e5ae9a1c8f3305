"""The canary's plan (tasks/canary_plan.py, pure): what it loads and judges, each round's
load, the stop rules, and the judgement, as tables."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from modelship.loadgen import LoadReport, RequestRecord
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import Policy
from tasks.agreement import BASELINE, CANDIDATE
from tasks.canary_plan import (
    CanaryPlan,
    Measured,
    enough_samples,
    judge_measured,
    load_summary,
    next_round,
    plan_canary,
    round_mode,
    shortfall,
    watch_stops,
)
from tasks.canary_sizing import SEQUENTIAL_SHARE
from tasks.gate_report import Verdict
from tasks.sequential import SequentialDecision

GPU_RULE = {"name": "gpu_busy", "metric": "gpu_utilization", "test": "threshold",
            "max": 0.9}


def _policy(*, sequential: bool = False, warmup_s: float = 1.0, gpu_rule: bool = False,
            min_samples: int = 100) -> Policy:
    gates = [g.model_dump(exclude_none=True) for g in Policy().gates]
    return Policy.model_validate({
        "canary": {"sequential": sequential, "warmup_s": warmup_s, "window_s": 2.0,
                   "max_duration_s": 20.0, "min_samples": min_samples,
                   "sequential_round_s": 1.5},
        "gates": gates + ([GPU_RULE] if gpu_rule else [])})


def _plan(*, baseline: int | None = 1, on_gpu: bool = False, **policy: Any) -> CanaryPlan:
    return plan_canary(_policy(**policy), model="m", candidate=2, baseline=baseline,
                       on_gpu=on_gpu, server_name="triton-canary", timeout_s=5.0)


def _records(n_baseline: int, n_candidate: int, *, failed: int = 0) -> list[RequestRecord]:
    out = [RequestRecord(start_s=i * 0.01, latency_ms=10.0, ok=True, error=None, server=0,
                         model_version="1", row=i, tag=BASELINE) for i in range(n_baseline)]
    out += [RequestRecord(start_s=i * 0.01, latency_ms=10.0, ok=i >= failed,
                          error=None if i >= failed else "boom", server=1, model_version="2",
                          row=i, tag=CANDIDATE) for i in range(n_candidate)]
    return out


# --------------------------------------------------------------------------- the plan


@pytest.mark.parametrize(
    ("baseline", "on_gpu", "gpu_rule", "skipped", "versions"),
    [
        (1, False, False, (), [1, 2]),
        # first release: every comparative rule is skipped, C is loaded alone
        (None, False, False, ("latency_p50", "latency_p99", "agreement", "server_latency"),
         [2]),
        # a CPU canary skips the rules on GPU metrics, never fails them
        (1, False, True, ("gpu_busy",), [1, 2]),
        (1, True, True, (), [1, 2]),
        (None, False, True, ("latency_p50", "latency_p99", "agreement", "server_latency",
                             "gpu_busy"), [2]),
        (None, True, True, ("latency_p50", "latency_p99", "agreement", "server_latency"), [2]),
    ],
)
def test_the_plan_loads_and_judges(baseline: int | None, on_gpu: bool, gpu_rule: bool,
                                   skipped: tuple[str, ...], versions: list[int]) -> None:
    plan = _plan(baseline=baseline, on_gpu=on_gpu, gpu_rule=gpu_rule)
    assert plan.skipped == skipped
    assert plan.versions == versions
    assert plan.paired is (baseline is not None)
    assert [r.name for r in plan.judged] == [r.name for r in _policy(gpu_rule=gpu_rule).gates
                                             if r.name not in skipped]
    assert len(plan.notes) == (baseline is None) + (gpu_rule and not on_gpu)
    assert plan.spec.keep_outputs is plan.paired  # outputs only to compare them
    assert plan.spec.warmup_s == 0.0  # the canary warms up in a round of its own


def test_the_notes_name_the_skipped_rules_and_why() -> None:
    plan = _plan(baseline=None, gpu_rule=True)
    assert plan.notes[0].startswith("first release of m: no baseline")
    assert "latency_p99" in plan.notes[0] and "gpu_busy" not in plan.notes[0]
    assert "triton-canary reports no GPU" in plan.notes[1] and "gpu_busy" in plan.notes[1]


@pytest.mark.parametrize(
    ("sequential", "baseline", "watching", "share"),
    [(True, 1, True, SEQUENTIAL_SHARE), (True, None, False, 0.0), (False, 1, False, 0.0)],
)
def test_the_watch_spends_its_share_of_alpha_only_when_paired(
        sequential: bool, baseline: int | None, watching: bool, share: float) -> None:
    plan = _plan(sequential=sequential, baseline=baseline)
    assert plan.sequential is watching
    assert plan.share == share
    for judged, fixed in zip(plan.judged, plan.fixed, strict=True):
        watched = judged.test in ("mann_whitney", "quantile", "exact_rate")
        alpha = getattr(judged, "alpha", None)
        expected = alpha * (1 - share) if watched and alpha is not None else alpha
        assert getattr(fixed, "alpha", None) == pytest.approx(expected)


@pytest.mark.parametrize(("warmup_s", "has_warmup"), [(0.0, False), (1.0, True), (3.0, True)])
def test_the_warmup_round(warmup_s: float, has_warmup: bool) -> None:
    plan = _plan(warmup_s=warmup_s)
    if not has_warmup:
        assert plan.warmup is None
        return
    assert plan.warmup is not None
    assert plan.warmup.duration_s == warmup_s
    assert plan.warmup.window_s == min(2.0, warmup_s)
    assert plan.warmup.keep_outputs is False


def test_the_first_plan_is_sized_from_the_baselines_warmup_and_floored() -> None:
    plan = _plan(min_samples=100)
    assert plan.samples_needed([]) >= 3100  # the p99 rule's tail reference at least
    assert _plan(min_samples=50_000).samples_needed([]) == 50_000
    warm = _records(50, 50)
    assert plan.reference_ms(warm) is not None
    assert plan.reference_ms(_records(0, 50)) is None


# --------------------------------------------------------------------------- the rounds


def _measured(rounds: int, *, ok: int = 0, measured_s: float = 0.0,
              required: int = 1000) -> Measured:
    return Measured(records=_records(ok, ok), measured_s=measured_s,
                    rounds=[{"mode": "x"}] * rounds, required=required)


@pytest.mark.parametrize(
    ("sequential", "rounds", "ok", "measured_s", "remaining_s", "expected"),
    [
        # the stability round: at most 40% of the budget, at least 4 windows
        (False, 0, 0, 0.0, 20.0, ("stability", None, 8.0)),
        (False, 0, 0, 0.0, 10.0, ("stability", None, 8.0)),
        (False, 0, 0, 0.0, 5.0, ("stability", None, 5.0)),
        (False, 0, 0, 0.0, 0.4, None),               # not even half a second left
        # sized rounds: from the observed rate, with a 20% margin, within the budget
        (False, 1, 500, 5.0, 10.0, ("sized", 6.0, None)),
        (False, 1, 500, 5.0, 3.0, ("sized", 3.0, None)),
        (False, 1, 1000, 5.0, 10.0, None),           # enough already
        (False, 1, 0, 5.0, 10.0, None),              # nothing answered: no rate to size from
        # sequential looks: one round of sequential_round_s each, the last one shorter
        (True, 0, 0, 0.0, 20.0, ("sequential", 1.5, None)),
        (True, 3, 10, 4.5, 1.0, ("sequential", 1.0, None)),
        (True, 3, 10, 4.5, 0.4, None),
    ],
)
def test_next_round(sequential: bool, rounds: int, ok: int, measured_s: float,
                    remaining_s: float, expected: tuple[str, float | None, float | None] | None
                    ) -> None:
    plan = _plan(sequential=sequential)
    measured = _measured(rounds, ok=ok, measured_s=measured_s)
    spec = next_round(plan, measured, remaining_s)
    if expected is None:
        assert spec is None
        return
    mode, duration_s, cap_s = expected
    assert spec is not None
    assert round_mode(plan, measured) == mode
    assert spec.duration_s == pytest.approx(duration_s) if duration_s is not None \
        else spec.duration_s is None
    if cap_s is not None:
        assert spec.max_duration_s == pytest.approx(cap_s)
    if duration_s is not None:
        assert spec.window_s == min(plan.spec.window_s, duration_s)
        assert spec.max_duration_s >= duration_s


def _decision(status: str) -> SequentialDecision:
    return SequentialDecision(status=status, reason=f"{status} because", looks=3,  # type: ignore[arg-type]
                              samples=(10, 10))


@pytest.mark.parametrize(
    ("status", "ok", "stops"),
    [
        (None, 5000, False),          # no watch, no stop by the watch
        ("failed", 10, True),         # a certain regression stops at once
        ("inconclusive", 10, True),   # both arms failing alike too
        ("passed", 99, False),        # an early pass waits for the floor (100)
        ("passed", 100, True),
        ("continue", 5000, False),
    ],
)
def test_the_watch_stops_the_rounds(status: str | None, ok: int, stops: bool) -> None:
    plan = _plan(sequential=True, min_samples=100)
    measured = _measured(1, ok=ok)
    measured.decision = _decision(status) if status else None
    assert watch_stops(plan, measured) is stops


@pytest.mark.parametrize(("baseline_ok", "candidate_ok", "enough"),
                         [(1000, 1000, True), (999, 1000, False), (1000, 999, False)])
def test_enough_samples_needs_every_arm(baseline_ok: int, candidate_ok: int,
                                        enough: bool) -> None:
    plan = _plan()
    measured = Measured(records=_records(baseline_ok, candidate_ok), required=1000)
    assert enough_samples(plan, measured) is enough
    assert (shortfall(plan, measured) is None) is enough


def _report(records: list[RequestRecord], *, duration_s: float, stable: bool | None,
            requests: int | None = None) -> LoadReport:
    return LoadReport(requests=len(records) if requests is None else requests, errors=0,
                      throughput_rps=0.0, latency_ms={}, stable=stable, windows=[],
                      duration_s=duration_s, measured_from_s=0.0, measured_to_s=1e9,
                      mode="concurrency", protocol="http", concurrency=1, rate_rps=None,
                      by_version={}, by_server={}, records=records)


def test_rounds_form_one_timeline_and_the_first_says_if_stable() -> None:
    measured = Measured()
    first = measured.add(_report(_records(2, 0), duration_s=3.0, stable=True), "stability")
    assert [r.start_s for r in first] == [0.0, 0.01]
    measured.add(_report(_records(2, 0), duration_s=2.0, stable=False), "sized")
    assert [r.start_s for r in measured.records] == pytest.approx([0.0, 0.01, 3.0, 3.01])
    assert measured.measured_s == 5.0
    assert measured.stable is True
    assert [r["mode"] for r in measured.rounds] == ["stability", "sized"]
    looks = Measured()
    looks.add(_report(_records(1, 0), duration_s=1.0, stable=True), "sequential")
    assert looks.stable is None  # the watch's looks never say whether windows settled


def test_a_later_round_is_shifted_in_copies_and_each_round_says_how_long_it_sent() -> None:
    measured = Measured()
    first = _report(_records(2, 0), duration_s=15.0, stable=True)
    first.measured_to_s = 20.0  # stable on windows 2-4: 5 s of its load were not kept
    measured.add(first, "stability")
    later = measured.add(_report(_records(2, 0), duration_s=2.0, stable=None), "sized")
    assert [r.start_s for r in later] == [0.0, 0.01]  # the round's own clock, untouched
    assert [r.start_s for r in measured.records] == pytest.approx([0.0, 0.01, 15.0, 15.01])
    assert [(r.latency_ms, r.tag, r.row) for r in measured.records[2:]] == \
        [(r.latency_ms, r.tag, r.row) for r in later]
    assert [(r["duration_s"], r["sent_s"]) for r in measured.rounds] == [(15.0, 20.0),
                                                                        (2.0, 1e9)]


# --------------------------------------------------------------------------- the judgement


def _snapshot(n: int, slower: float = 1.0) -> CanarySnapshot:
    rng = np.random.default_rng(7)

    def arm(version: int, scale: float) -> ArmMeasurements:
        lat = rng.lognormal(np.log(10.0), 0.3, n) * scale
        return ArmMeasurements(version=version, latency_ms=lat, requests=n, errors=0,
                               latency_s=np.linspace(0.0, 30.0, n), error_s=np.zeros(0),
                               throughput_rps=n / 30.0)

    return CanarySnapshot(model="m", candidate=arm(2, slower), baseline=arm(1, 1.0),
                          agreement=1.0, agreement_samples=n, window_s=30.0)


@pytest.mark.parametrize(
    ("status", "ok", "judged", "sequential_line"),
    [
        (None, 3000, ["latency_p50", "latency_p99", "error_rate", "agreement",
                      "server_latency"], None),
        # an early pass on fewer requests than planned: the watched rules are not judged
        # again, the others are, and the watch's line is added
        ("passed", 500, ["agreement", "server_latency", "sequential"], Verdict.PASSED),
        ("failed", 500, ["latency_p50", "latency_p99", "error_rate", "agreement",
                         "server_latency", "sequential"], Verdict.FAILED),
    ],
)
def test_judge_measured(status: str | None, ok: int, judged: list[str],
                        sequential_line: Verdict | None) -> None:
    plan = _plan(sequential=status is not None)
    measured = Measured(records=_records(ok, ok), required=3000, measured_s=30.0)
    measured.decision = _decision(status) if status else None
    report = judge_measured(plan, measured, _snapshot(ok))
    assert [r.rule for r in report.results] == judged
    if sequential_line is not None:
        assert report.results[-1].verdict is sequential_line
    if status == "failed":
        assert report.verdict is Verdict.FAILED


def test_load_summary_states_the_plan_against_what_was_reached() -> None:
    plan = _plan()
    measured = Measured(records=_records(900, 1000), required=1000, measured_s=12.3456,
                        rounds=[{"mode": "stability"}], stable=True)
    load = load_summary(plan, measured, url="127.0.0.1:1", payload_rows=64,
                        payload_source="golden")
    assert list(load) == ["sequential", "protocol", "mode", "concurrency", "rate_rps",
                          "paired", "warmup_s", "measured_s", "stable", "rounds",
                          "required_samples", "samples", "enough_samples", "payload_rows",
                          "payload_source", "url"]
    assert load["samples"] == {CANDIDATE: 1000, BASELINE: 900}
    assert load["enough_samples"] is False
    assert load["measured_s"] == 12.346
    assert load["rate_rps"] is None and load["concurrency"] == plan.canary.concurrency
