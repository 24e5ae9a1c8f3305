"""Which running records belong to dead runs (the rerun's crash recovery), as a table; a
live run of the same model in another terminal is never one of them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from modelship.ledger import ReleaseRecord, StageEntry, now_iso
from tasks.recovery import dead_runs, recover

#: Each pid's start time (clock ticks since boot), as a record's holder keeps it.
STARTS: dict[int, int] = {}


def _start_ticks(pid: int) -> int:
    """The start time of ``pid``, whatever its state (a zombie's too)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _gone_pid() -> int:
    """The pid of a process that has exited (and been reaped), its start time kept: a later
    process that is given the same pid is not taken for it (pids are recycled)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    STARTS[child.pid] = _start_ticks(child.pid)  # exited or not, not reaped yet
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
    record.holder = {"host": host, "pid": pid, "pid_start": STARTS.get(pid)}
    record.status = status
    record.stages = [StageEntry(name, now_iso()) for name in stages]
    return record


HERE = socket.gethostname()
DEAD = _gone_pid()
STARTS[os.getpid()] = _start_ticks(os.getpid())


def _recycled() -> ReleaseRecord:
    """A running record whose pid now belongs to another process: this one, started later."""
    record = _record(host=HERE, pid=os.getpid())
    record.holder["pid_start"] = STARTS[os.getpid()] - 1
    return record


@pytest.mark.parametrize(("record", "dead"), [
    (_record(host=HERE, pid=DEAD), True),                        # same host, process gone
    (_record(host=HERE, pid=os.getpid()), False),                # same host, alive
    (_recycled(), True),                                         # its pid recycled
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
    found = dead_runs(_Ledger([record, current]), "m", current.id)
    assert [r.id for r in found] == ([record.id] if dead else [])


class _WritingLedger(_Ledger):
    def __init__(self, records: list[ReleaseRecord]) -> None:
        super().__init__(records)
        self.written: list[str] = []

    def write(self, record: ReleaseRecord) -> None:
        self.written.append(record.id)


class _NoEffects:
    """Effects for records that never changed the fleet: any call is a test failure."""

    def fleet_to(self, version: int | None) -> None:
        raise AssertionError("no fleet change expected")

    def set_alias(self, alias: str, version: int | None) -> None:
        raise AssertionError("no alias change expected")

    def tag_release(self, version: int, release_id: str) -> None:
        raise AssertionError("no tag expected")


def _unseen(_record: ReleaseRecord) -> Any:
    raise AssertionError("a record without an intent needs no observation")


def test_a_run_that_died_waiting_for_approval_has_its_request_closed() -> None:
    """A click for it is then refused by the approvals rules (already interrupted)."""
    from modelship.approvals.rules import check_decision

    dead = _record(host=HERE, pid=DEAD, stages=("resolve", "check", "stage", "canary",
                                                "gates", "approve"))
    digest = {"model": "m", "version": 2, "onnx_sha256": "ab", "canary_report_id": dead.id}
    dead.approvals = [{"kind": "request", "status": "pending", "release_id": dead.id,
                       "digest": digest, "approvers": ["U1"], "requester": "U0",
                       "expires_at": 4e9}]
    current = _record(host=HERE, pid=os.getpid())
    ledger = _WritingLedger([dead, current])
    recover(ledger, "m", by=current.id, observe=_unseen,
            effects=_NoEffects())
    assert ledger.written == [dead.id] and dead.status == "interrupted"
    assert dead.approvals[0]["status"] == "interrupted" and current.id in \
        dead.approvals[0]["reason"]
    verdict = check_decision(dead.approvals[0], decision="approve", user="U1",
                             release_id=dead.id, digest=digest, allowed={"U1"}, now=0.0)
    assert (verdict.ok, verdict.code, verdict.status) == (False, "already_decided", 409)
    assert "interrupted" in verdict.message


def test_two_terminals_the_live_run_is_never_marked_interrupted() -> None:
    """Terminal A checks v3 (running, its process alive, no lock yet); terminal B takes the
    lock and recovers: only the dead run ends, A's record is not written at all."""
    live = _record(host=HERE, pid=os.getpid(), stages=("resolve", "check"))
    dead = _record(host=HERE, pid=DEAD, stages=("resolve", "check"))
    current = _record(host=HERE, pid=os.getpid())
    ledger = _WritingLedger([live, dead, current])
    report = recover(ledger, "m", by=current.id, observe=_unseen,
                     effects=_NoEffects())
    assert report["interrupted"] == [dead.id] and ledger.written == [dead.id]
    assert live.status == "running" and dead.status == "interrupted"
