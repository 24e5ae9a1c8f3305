"""A release stopped while it waits for an approval closes its request (issue 18 item 6,
the fault matrix's SIGTERM at the approval wait): a late click must find it over."""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

import tasks.approve as approve_module
from modelship.errors import InfrastructureError
from modelship.ledger import ReleaseRecord
from modelship.policy import ApprovalPolicy
from modelship.slack.notifier import NullNotifier
from tasks.approve import ApprovalChannels, approval_request, approve
from tasks.record import ReleaseJournal


def _journal() -> ReleaseJournal:
    """A promote's journal inside a flow run, with a canary report to approve."""
    record = ReleaseRecord.start("promote", "m")
    record.holder["flow_run_id"] = "run-1"
    record.candidate = {"canary_report_id": "canary-1"}
    return ReleaseJournal(record, None, NullNotifier())


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), InfrastructureError("S3 is down")])
def test_a_stop_or_an_error_during_the_wait_closes_the_pending_request(
        monkeypatch: pytest.MonkeyPatch, stop: BaseException) -> None:
    journal = _journal()
    record = journal.record

    def wait(*_args: Any) -> NoReturn:
        assert record.approvals[0]["status"] == "pending"  # recorded before the wait
        raise stop

    monkeypatch.setattr(approve_module, "_wait", wait)
    request = approval_request(ApprovalPolicy(), require=True, approvers=["U1"])
    with pytest.raises(type(stop)):
        approve(request, journal, ApprovalChannels(notifier=None), model="m", version=3)
    (pending,) = record.approvals
    assert pending["status"] == "interrupted", pending
    assert type(stop).__name__ in pending["reason"] and pending["decided_at"]


def test_a_decided_request_keeps_its_decision_when_the_run_stops_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    journal = _journal()
    record = journal.record

    def wait(*_args: Any) -> NoReturn:
        record.approvals[0]["status"] = "rejected"
        raise KeyboardInterrupt

    monkeypatch.setattr(approve_module, "_wait", wait)
    request = approval_request(ApprovalPolicy(), require=True, approvers=["U1"])
    with pytest.raises(KeyboardInterrupt):
        approve(request, journal, ApprovalChannels(notifier=None), model="m", version=3)
    assert record.approvals[0]["status"] == "rejected"
