"""The canary's pure judgement helpers: the tail reference refusal and the α split."""

from __future__ import annotations

import numpy as np
import pytest

from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import default_gates, gate_rule
from tasks.canary import shared_errors, spend_alpha, tail_reference_refusal, watched
from tasks.gates import evaluate, family_alpha

P99 = gate_rule(name="latency_p99", metric="latency_p99_ms", max_increase_pct=10.0)
ERR = gate_rule(name="error_rate", metric="error_rate", max_rate=0.001)


def snapshot(n: int, *, scale: float = 1.0, errors: int = 0) -> CanarySnapshot:
    rng = np.random.default_rng(n)
    return CanarySnapshot(
        "fraud", ArmMeasurements(7, scale * rng.lognormal(0.7, 0.3, n), n + errors, errors),
        ArmMeasurements(6, rng.lognormal(0.7, 0.3, n), n, 0))


def test_a_p99_rule_without_30_baseline_requests_above_it_is_refused() -> None:
    report = evaluate(snapshot(2000), [P99, ERR], min_samples=1)
    refusal = tail_reference_refusal(report)
    assert refusal is not None and "30 needed" in refusal and "canary.min_samples" in refusal
    assert report.results[0].details["reference_needed"] == 3100
    # Enough reference: judged, nothing refused.
    assert tail_reference_refusal(evaluate(snapshot(3200), [P99, ERR], min_samples=1)) is None


def test_a_refusal_never_hides_a_failed_rule() -> None:
    report = evaluate(snapshot(2000, errors=60), [P99, ERR], min_samples=1)
    assert str(report.verdict) == "failed"
    assert tail_reference_refusal(report) is None


def test_the_alpha_split_keeps_the_family_wise_rate() -> None:
    gates = default_gates()
    fixed = spend_alpha(gates, share=0.2)
    watched_alpha = sum(0.2 * g.alpha for g in gates if watched(g))
    assert (family_alpha(fixed) or 0.0) + watched_alpha == pytest.approx(0.05)
    assert [g.alpha for g in fixed if g.name == "server_latency"] == [0.01]  # not watched


def test_shared_errors_names_both_arms_failing_alike_and_only_that() -> None:
    def both(candidate_errors: int, baseline_errors: int, *, dry_run: bool = False) -> str | None:
        n, rng = 3000, np.random.default_rng(1)
        snap = CanarySnapshot(
            "fraud", ArmMeasurements(7, rng.lognormal(0.7, 0.3, n), n, candidate_errors),
            ArmMeasurements(6, rng.lognormal(0.7, 0.3, n), n, baseline_errors))
        rule = ERR.model_copy(update={"dry_run": dry_run})
        return shared_errors(evaluate(snap, [rule], min_samples=1))

    shared = both(150, 150)
    assert shared is not None and "both arms fail alike" in shared
    assert both(150, 0) is None  # the candidate alone fails: a failed rule, not shared
    assert both(0, 0) is None
    assert both(150, 150, dry_run=True) is None  # a dry-run rule never stops the canary
