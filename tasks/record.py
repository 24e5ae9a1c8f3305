"""Stage 10, record/notify: every state change of a release goes through one journal.

:class:`ReleaseJournal` is the ``emit(event)`` of STYLE §11. Each stage that begins or ends
updates the :class:`~modelship.ledger.ReleaseRecord`, rewrites it in the ledger (so a
crash leaves a record that says where it stopped), prints one progress line, and reaches
the release's Slack thread: the parent message is updated in place and the stage gets one
reply.

Slack being down never changes a release's outcome: the first failure is logged and noted
in the record, and the thread stops posting (one slow timeout, not one per stage).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from modelship.errors import ModelshipError
from modelship.ledger import Ledger, ReleaseRecord, StageEntry, now_iso
from modelship.progress import Progress, quiet
from modelship.signals import exit_code_for, stop_signal
from modelship.slack import blocks
from modelship.slack.notifier import Notifier, NullNotifier

if TYPE_CHECKING:  # annotation only: the canary imports the load generator
    from tasks.canary import CanaryResult

NextStep = Callable[[ModelshipError], str]
E = TypeVar("E")


class StageRecorder(Generic[E]):
    """The one stage recorder (the release journal, and the check's report): each stage is
    timed, its start and its end are recorded where the record lives, and each is said in
    one progress line (``name ...``, then ``name ok (1.2 s)`` or ``name failed: why``).

    Subclasses keep the entry: :class:`ReleaseJournal` in the release record (the ledger
    and the Slack thread), :class:`tasks.check.CheckStages` in the check's report.
    """

    progress: Progress

    def _begin(self, name: str) -> E:
        """Record the stage's start; returns the entry the caller fills in."""
        raise NotImplementedError

    def _failed(self, name: str, entry: E, exc: ModelshipError, seconds: float,
                next_step: NextStep | None) -> None:
        """Record a stage that failed with ``exc`` after ``seconds``."""
        raise NotImplementedError

    def _stopped(self, entry: E, exc: BaseException) -> None:
        """Record a stage left by anything else (a stop request, a bug); default: nothing."""

    def _ended(self, name: str, entry: E, seconds: float) -> tuple[str, str | None]:
        """Record a stage that ended; returns its outcome and reason (None: none)."""
        raise NotImplementedError

    @contextmanager
    def stage(self, name: str, *, next_step: NextStep | None = None) -> Iterator[E]:
        """Run one stage: record its start, then its outcome (ok, or the error's message).

        Args:
            next_step: What to tell the reader to do when the stage fails (default: the
                error's hint).
        """
        entry = self._begin(name)
        self.progress(f"{name} ...")
        began = time.monotonic()
        try:
            yield entry
        except ModelshipError as exc:
            self._failed(name, entry, exc, round(time.monotonic() - began, 3), next_step)
            self.progress(f"{name} failed: {exc.message}")
            raise
        except BaseException as exc:
            self._stopped(entry, exc)
            raise
        seconds = round(time.monotonic() - began, 3)
        outcome, reason = self._ended(name, entry, seconds)
        self.progress(f"{name} {outcome} ({seconds:.1f} s)" + (f": {reason}" if reason else ""))


class ReleaseThread:
    """One Slack thread per release; every failure is swallowed and reported once."""

    def __init__(self, notifier: Notifier, on_failure: Callable[[str], None]) -> None:
        self.notifier = notifier
        self.on_failure = on_failure
        self.ts: str | None = None
        self.down: str | None = None

    def _safe(self, what: str, call: Callable[[], Any]) -> Any:
        if self.down is not None or isinstance(self.notifier, NullNotifier):
            return None
        try:
            return call()
        except ModelshipError as exc:
            self.down = exc.message
            self.on_failure(f"Slack {what} failed, later posts skipped: {exc.message}")
            return None

    def open(self, record: ReleaseRecord) -> None:
        data = record.to_dict()
        self.ts = self._safe("post", lambda: self.notifier.post(
            blocks.title(data), blocks.parent_blocks(data)))

    def refresh(self, record: ReleaseRecord) -> None:
        if self.ts is None:
            return
        data = record.to_dict()
        ts = self.ts
        self._safe("update", lambda: self.notifier.update(ts, blocks.title(data),
                                                           blocks.parent_blocks(data)))

    def reply(self, text: str, reply_blocks: list[dict[str, Any]]) -> None:
        if self.ts is None:
            return
        ts = self.ts
        self._safe("reply", lambda: self.notifier.post(text, reply_blocks, thread_ts=ts))

    def upload(self, path: Path, title: str) -> None:
        if self.ts is None or not path.is_file():  # Path("") is the working directory
            return
        ts = self.ts
        self._safe("upload", lambda: self.notifier.upload(path, title=title, thread_ts=ts))


class ReleaseJournal(StageRecorder[StageEntry]):
    """The record of one release, kept true in the ledger and the Slack thread as it goes.

    Args:
        record: The record to keep (already started).
        ledger: Where it is written; None only for dry runs (nothing is written).
        notifier: The Slack notifier (or the null one).
        progress: Receives one human line per event.
    """

    def __init__(self, record: ReleaseRecord, ledger: Ledger | None, notifier: Notifier,
                 progress: Progress = quiet) -> None:
        self.record = record
        self.ledger = ledger
        self.progress = progress
        self.thread = ReleaseThread(notifier, self.note)
        if notifier.channel:
            record.slack = {"channel": notifier.channel}

    def save(self) -> None:
        if self.ledger is not None:
            self.ledger.write(self.record)

    def note(self, text: str) -> None:
        """Something that went wrong without changing the outcome."""
        self.record.notes.append(text)
        self.progress(f"note: {text}")

    def open(self) -> None:
        self.save()
        self.thread.open(self.record)
        if self.thread.ts:
            self.record.slack["ts"] = self.thread.ts
        self.save()

    def _begin(self, name: str) -> StageEntry:
        entry = StageEntry(name=name, started_at=now_iso())
        self.record.stages.append(entry)
        self.save()
        self.thread.refresh(self.record)
        return entry

    def _failed(self, name: str, entry: StageEntry, exc: ModelshipError, seconds: float,
                next_step: NextStep | None) -> None:
        entry.outcome, entry.reason = "failed", exc.message
        entry.details.setdefault("error", type(exc).__name__)
        entry.ended_at = now_iso()
        entry.details["seconds"] = seconds
        self.save()
        hint = next_step(exc) if next_step else exc.hint
        self.thread.reply(f"{name} failed: {exc.message}",
                          blocks.stage_blocks(entry.to_dict(), next_step=hint))

    def _stopped(self, entry: StageEntry, exc: BaseException) -> None:
        entry.outcome, entry.reason = "failed", f"{type(exc).__name__}: {exc}"
        entry.ended_at = now_iso()
        self.save()

    def _ended(self, name: str, entry: StageEntry, seconds: float) -> tuple[str, str | None]:
        if entry.outcome == "running":
            entry.outcome = "ok"
        entry.ended_at = now_iso()
        entry.details["seconds"] = seconds
        self.save()
        self.thread.refresh(self.record)
        lines = entry.details.pop("_lines", [])
        self.thread.reply(f"{name} {entry.outcome}",
                          blocks.stage_blocks(entry.to_dict(), lines=lines))
        return entry.outcome, entry.reason

    def upload(self, path: Path, title: str) -> None:
        self.thread.upload(path, title)

    def attach_gates(self, result: CanaryResult) -> dict[str, Any]:
        """The canary's gate verdicts on the record, its report files uploaded next to it
        (one builder for promote and the canary on its own); returns the record's gates."""
        keys = {}
        for kind, path in (result.report_paths or {}).items():
            if path and Path(path).exists() and self.ledger is not None:
                keys[kind] = self.ledger.attach(self.record, Path(path).name, Path(path))
        gates = result.gate_report.to_dict()
        self.record.gates = {
            "verdict": result.verdict, "baseline": result.baseline,
            "candidate": result.candidate, "required_samples": gates.get("required_samples"),
            "results": gates.get("results", []), "report_keys": keys,
            "load": result.load, "skipped_rules": result.skipped_rules,
            # C's measured GPU footprint: a later `swap --to V` sizes its headroom by it
            "gpu": result.gpu.to_dict() if result.gpu is not None else None}
        return self.record.gates

    def finish(self, status: str, exit_code: int, reason: str | None = None,
               links: Sequence[str] = ()) -> None:
        """End the release: the record's last write, the parent's last update, a summary."""
        self.record.finish(status, exit_code, reason)
        self.save()
        self.thread.refresh(self.record)
        data = self.record.to_dict()
        self.thread.reply(blocks.title(data), blocks.summary_blocks(data, links))
        if self.thread.down is not None:
            self.save()  # the note about Slack came after the last write

    def write_ending(self, record: ReleaseRecord) -> None:
        """The last write of a release that :func:`tasks.fleet.end_release` ended
        (released, undone or incomplete): the record, the parent and the summary."""
        self.finish(record.status, int(record.exit_code or 0), record.reason)

    def stopped(self, exc: BaseException) -> None:
        """End a run that stopped before it changed the fleet (the canary on its own):
        ``cancelled`` for a stop request (exit 128 + signal), else ``failed`` or
        ``rejected`` with the error's exit code; the record says nothing changed."""
        signum = stop_signal(exc)
        stage = next((s.name for s in reversed(self.record.stages)), "start")
        if signum is not None:
            self.finish("cancelled", exit_code_for(signum),
                        f"stopped by {signal.Signals(signum).name} during {stage}; nothing "
                        "in production was changed")
        elif isinstance(exc, ModelshipError):
            self.finish("failed" if exc.exit_code == 1 else "rejected", exc.exit_code,
                        exc.message, links=[f"next: {exc.hint}"] if exc.hint else [])
        else:
            self.finish("failed", 1, f"{type(exc).__name__}: {exc}")
