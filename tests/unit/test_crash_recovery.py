"""Which running records belong to dead runs (the rerun's crash recovery), as a table."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from flows.promote import dead_runs
from model_registry.ledger import ReleaseRecord, StageEntry, now_iso


def _gone_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


class _Ledger:
    def __init__(self, records: list[ReleaseRecord]) -> None:
        self._records = records

    def records(self, model: str) -> list[ReleaseRecord]:
        return [r for r in self._records if r.model == model]


def _record(*, host: str, pid: int, stages: tuple[str, ...] = ("resolve", "check"),
            status: str = "running", kind: str = "promote", dry_run: bool = False,
            model: str = "m") -> ReleaseRecord:
    record = ReleaseRecord.start(kind, model, dry_run=dry_run)  # type: ignore[arg-type]
    record.holder = {"host": host, "pid": pid}
    record.status = status
    record.stages = [StageEntry(name, now_iso()) for name in stages]
    return record


HERE = socket.gethostname()
DEAD = _gone_pid()


@pytest.mark.parametrize(("record", "dead"), [
    (_record(host=HERE, pid=DEAD), True),                        # same host, process gone
    (_record(host=HERE, pid=os.getpid()), False),                # same host, alive
    (_record(host="other", pid=1, stages=("resolve", "check")), False),  # maybe still checking
    (_record(host="other", pid=1, stages=("resolve", "check", "stage", "canary")), True),
    (_record(host=HERE, pid=DEAD, status="released"), False),    # finished
    (_record(host=HERE, pid=DEAD, status="interrupted"), False),  # already found
    (_record(host=HERE, pid=DEAD, dry_run=True), False),         # changed nothing
    (_record(host=HERE, pid=DEAD, kind="canary"), False),        # not a fleet change
    (_record(host=HERE, pid=DEAD, model="other-model"), False),
])
def test_dead_runs(record: ReleaseRecord, dead: bool) -> None:
    current = _record(host=HERE, pid=os.getpid())
    found = dead_runs(_Ledger([record, current]), "m", current.id)  # type: ignore[arg-type]
    assert [r.id for r in found] == ([record.id] if dead else [])


class _WritingLedger(_Ledger):
    def __init__(self, records: list[ReleaseRecord]) -> None:
        super().__init__(records)
        self.written: list[str] = []

    def write(self, record: ReleaseRecord) -> None:
        self.written.append(record.id)


def test_a_run_that_died_waiting_for_approval_has_its_request_closed() -> None:
    """A click for it is then refused by the approvals rules (already interrupted)."""
    from flows.promote import _mark_interrupted
    from modelship.approvals.rules import check_decision

    dead = _record(host=HERE, pid=DEAD, stages=("resolve", "check", "stage", "canary",
                                                "gates", "approve"))
    digest = {"model": "m", "version": 2, "onnx_sha256": "ab", "canary_report_id": dead.id}
    dead.approvals = [{"kind": "request", "status": "pending", "release_id": dead.id,
                       "digest": digest, "approvers": ["U1"], "requester": "U0",
                       "expires_at": 4e9}]
    current = _record(host=HERE, pid=os.getpid())
    ledger = _WritingLedger([dead, current])
    _mark_interrupted(ledger, "m", current.id)  # type: ignore[arg-type]
    assert ledger.written == [dead.id] and dead.status == "interrupted"
    assert dead.approvals[0]["status"] == "interrupted" and current.id in \
        dead.approvals[0]["reason"]
    verdict = check_decision(dead.approvals[0], decision="approve", user="U1",
                             release_id=dead.id, digest=digest, allowed={"U1"}, now=0.0)
    assert (verdict.ok, verdict.code, verdict.status) == (False, "already_decided", 409)
    assert "interrupted" in verdict.message
