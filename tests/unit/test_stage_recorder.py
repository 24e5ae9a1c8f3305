"""One stage recorder (issue 19 item 7): the check's report and the release journal record
their stages through :class:`tasks.record.StageRecorder`, and say them the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.errors import GateFailed, InfrastructureError, ModelshipError, UsageError
from modelship.ledger import ReleaseRecord
from modelship.slack.notifier import NullNotifier
from tasks.check import CheckReport, CheckStages
from tasks.record import ReleaseJournal, ReleaseThread, StageRecorder


def _journal(lines: list[str]) -> ReleaseJournal:
    record = ReleaseRecord.start("swap", "m", to_version=2)
    return ReleaseJournal(record, None, NullNotifier(), lines.append)


def _check(lines: list[str]) -> CheckStages:
    return CheckStages(CheckReport(model="m"), lines.append)


def _run(recorder: StageRecorder, fail: BaseException | None) -> None:
    with recorder.stage("first"):
        pass
    if fail is None:
        return
    with pytest.raises(type(fail)), recorder.stage("second"):
        raise fail


@pytest.mark.parametrize("fail", [None, UsageError("bad flag"), GateFailed("p99 too high"),
                                  KeyboardInterrupt()])
def test_both_recorders_say_the_same_lines(fail: BaseException | None) -> None:
    said: dict[str, list[str]] = {"journal": [], "check": []}
    _run(_journal(said["journal"]), fail)
    _run(_check(said["check"]), fail)
    assert said["journal"] == said["check"]
    assert said["journal"][0] == "first ..." and said["journal"][1].startswith("first ok (")
    if isinstance(fail, ModelshipError):
        assert said["journal"][-1] == f"second failed: {fail.message}"
    elif fail is not None:  # a stop request: the stage began, nothing more is said
        assert said["journal"][-1] == "second ..."


@pytest.mark.parametrize(("fail", "verdict"), [
    (UsageError("bad flag"), "rejected"),
    (InfrastructureError("S3 down"), "error"),
])
def test_a_check_stage_records_its_outcome_on_the_report_and_the_error(
        fail: ModelshipError, verdict: str) -> None:
    stages = _check([])
    with stages.stage("resolve") as entry:
        entry.update(flavor="sklearn")
    fail.details["stage"] = "contract"  # a check inside the stage
    with pytest.raises(type(fail)), stages.stage("validate"):
        raise fail
    first, second = stages.report.stages
    assert list(first) == ["stage", "ok", "flavor", "seconds"] and first["ok"] is True
    assert second["ok"] is False and second["error"] == fail.message
    assert stages.report.verdict == verdict
    assert (fail.details["stage"], fail.details["check"]) == ("validate", "contract")
    assert fail.details["report"]["stages"][1]["stage"] == "validate"


def test_a_journal_stage_records_ok_failed_and_stopped() -> None:
    journal = _journal([])
    with journal.stage("swap") as entry:
        entry.details["kind"] = "swap"
    with pytest.raises(GateFailed), journal.stage("gates"):
        raise GateFailed("p99 too high")
    with pytest.raises(KeyboardInterrupt), journal.stage("bake"):
        raise KeyboardInterrupt()
    swap, gates, bake = journal.record.stages
    assert (swap.outcome, swap.details["kind"]) == ("ok", "swap") and swap.ended_at
    assert (gates.outcome, gates.reason, gates.details["error"]) == (
        "failed", "p99 too high", "GateFailed")
    assert bake.outcome == "failed" and bake.reason == "KeyboardInterrupt: " and bake.ended_at
    assert "seconds" not in bake.details


class _Posting:
    """A notifier that records its calls (not the null one: the thread posts to it)."""

    channel = "#releases"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def post(self, text: str, blocks: object = None, thread_ts: str | None = None) -> str:
        self.calls.append(f"post {text}")
        return "1.0"

    def update(self, ts: str, text: str, blocks: object = None) -> None:
        self.calls.append(f"update {text}")

    def upload(self, path: Path, *, title: str, thread_ts: str | None = None) -> str:
        self.calls.append(f"upload {path}")
        return "F1"


@pytest.mark.parametrize(("name", "uploaded"), [("", False), ("missing.png", False),
                                                ("plot.png", True)])
def test_the_thread_uploads_only_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        name: str, uploaded: bool) -> None:
    """A canary without a plot passes ``Path("")``: that is the working directory, which
    must not be uploaded (the failure would silence the rest of the thread)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plot.png").write_bytes(b"png")
    notifier = _Posting()
    thread = ReleaseThread(notifier, lambda why: notifier.calls.append(f"down {why}"))
    thread.open(ReleaseRecord.start("canary", "m", to_version=2))
    thread.upload(Path(name), "the canary")
    assert (f"upload {name}" in notifier.calls) is uploaded
    assert thread.down is None and not [c for c in notifier.calls if c.startswith("down")]
