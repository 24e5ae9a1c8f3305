"""Whether a release must recover first, from one read of the model's records (the ledger
grows with every release; a promote asks before its resolve and again under its lock)."""

from __future__ import annotations

import os

import pytest

from modelship.ledger import ReleaseRecord
from tasks.prefect_tasks import needs_recovery
from tests.unit.test_crash_recovery import DEAD, HERE, _Ledger, _record


class _CountingLedger(_Ledger):
    def __init__(self, records: list[ReleaseRecord]) -> None:
        super().__init__(records)
        self.reads = 0

    def records(self, model: str) -> list[ReleaseRecord]:
        self.reads += 1
        return super().records(model)


@pytest.mark.parametrize(("other", "needed"), [
    (None, False),                                                    # only this release
    (_record(host=HERE, pid=DEAD), True),                             # a dead run
    (_record(host=HERE, pid=os.getpid()), False),                     # a live run
    (_record(host=HERE, pid=os.getpid(), status="incomplete"), True),  # left incomplete
    (_record(host=HERE, pid=DEAD, status="incomplete", dry_run=True), False),  # a dry run
    (_record(host=HERE, pid=DEAD, status="released"), False),         # finished
    (_record(host=HERE, pid=DEAD, status="incomplete", kind="canary"), False),  # not a fleet
    (_record(host=HERE, pid=DEAD, model="other-model"), False),       # another model
])
def test_needs_recovery_reads_the_records_once(other: ReleaseRecord | None,
                                               needed: bool) -> None:
    current = _record(host=HERE, pid=os.getpid())
    ledger = _CountingLedger([current, *([other] if other is not None else [])])
    assert needs_recovery(ledger, "m", current.id) is needed  # type: ignore[arg-type]
    assert ledger.reads == 1
