"""Every recorded check fails closed: a result that does not say it passed is a failure."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from modelship.errors import ValidationFailed
from modelship.policy import Policy
from tasks.check import REQUIRED_CHECKS, CheckReport, check_outcomes, stage_checked

PASSED = {"inputs": {"success": True}, "outputs": {"success": True},
          "trial_load": {"success": True, "load_s": 0.4}}


@pytest.mark.parametrize(
    ("checks", "outcomes", "problem"),
    [
        (PASSED, {"inputs": True, "outputs": True, "trial_load": True}, None),
        # the defect of issue 19: the trial load's result had no success key and counted
        ({**PASSED, "trial_load": {"load_s": 0.4}}, {"trial_load": False},
         "trial_load: its result says nothing of success"),
        ({**PASSED, "outputs": {"success": False}}, {"outputs": False},
         "outputs: its result says success=False"),
        ({**PASSED, "outputs": {"success": "yes"}}, {"outputs": False},
         "outputs: its result says success='yes'"),
        ({**PASSED, "inputs": True}, {"inputs": False},
         "inputs: its result says nothing of success"),
        ({k: v for k, v in PASSED.items() if k != "outputs"}, {"outputs": False},
         "outputs: no result was recorded"),
        ({}, {name: False for name in REQUIRED_CHECKS}, "inputs: no result was recorded"),
        ({**PASSED, "extra": {}}, {"extra": False}, "extra: its result says nothing of success"),
    ],
)
def test_a_check_passes_only_when_its_result_says_so(
        checks: dict[str, Any], outcomes: dict[str, bool], problem: str | None) -> None:
    got, problems = check_outcomes(checks)
    assert {k: got[k] for k in outcomes} == outcomes
    assert set(REQUIRED_CHECKS) <= set(got)
    if problem is None:
        assert problems == [] and all(got.values())
    else:
        assert problem in problems
        assert len(problems) == sum(not ok for ok in got.values())


class Untouchable:
    """Storage and registry that fail the test if staging reaches them."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"staging touched {name} of a candidate that did not pass")


@pytest.mark.parametrize("dry_run", [False, True])
def test_staging_refuses_a_report_whose_check_recorded_no_pass(dry_run: bool) -> None:
    report = CheckReport(model="fraud", version=7, checks={**PASSED, "trial_load": {}},
                         config_pbtxt="name: 'fraud'")
    report.resolved = SimpleNamespace(version=7)  # type: ignore[assignment]
    report.exported = report.golden = SimpleNamespace()  # type: ignore[assignment]
    clients = SimpleNamespace(registry=Untouchable(), storage=Untouchable())
    with pytest.raises(ValidationFailed, match="trial_load: its result says nothing") as info:
        stage_checked(SimpleNamespace(), clients, Policy(), report,  # type: ignore[arg-type]
                      dry_run=dry_run)
    assert info.value.exit_code == 3 and info.value.details["stage"] == "stage"
    assert report.staged is None
