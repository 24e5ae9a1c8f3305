"""Stage 7, approve: a human approves exactly this candidate, or the release stops (DESIGN §2).

When the policy (or ``--require-approval``) asks for it:

1. The pending approval goes into the release record (``approvals``, in the ledger in S3)
   **before** anything is posted, so it survives a restart of the approvals service: the
   release id, the flow run, the candidate digest (model, version, ONNX sha256, canary
   report id), the approvers, the requester and the expiry.
2. The approval request is posted as its own message in the release's thread: the canary
   numbers, the plot, and Approve/Reject buttons whose value carries the release id and
   the digest. Slack being down approves nothing: the record says so and the run waits.
3. The run pauses with ``pause_flow_run(wait_for_input=ApprovalInput, timeout=...)``. The
   Slack endpoint (``modelship approvals serve``) resumes it after its checks; the Prefect
   UI form is the fallback channel. Every input is checked again here with the same rules
   (:func:`modelship.approvals.rules.check_decision`): a refused input is recorded and the
   run pauses again for the time left.
4. While it waits, the candidate stays loaded on the canary Triton (the canary stage keeps
   it when approval is required) and a watcher keeps measuring it, every
   ``WATCH_INTERVAL_S``, with the **same always-valid tests as the sequential canary**:
   - a light paired probe (``PROBE_S`` of golden rows at ``PROBE_RPS`` pairs per second,
     like the canary's load) to the candidate and to the baseline on the canary, fed to
     :class:`tasks.sequential.SequentialCanary` (its errors and latency e-processes, with
     the policy's gates' tolerances and α); a breach is the e-process crossing its bound,
     so watching for hours never inflates false rejections (Ville's inequality; Lindon,
     Sanden and Shirikian, KDD 2022, arXiv:2205.14762);
   - production's own error rate on every replica (Triton's counters since the wait
     began) through the bake's e-process (:func:`tasks.sequential.log_e_over_budget`,
     H0 "rate ≤ ``bake.max_error_rate``", bound ``1 / bake.alpha``);
   - what the approval rests on: every replica still serves the baseline, the staged
     manifest is unchanged, the canary server answers.

   A statistical breach rejects the release at once (exit 5). A check of the evidence or
   of the infrastructure must fail twice in a row (a blip is not a reason); a changed
   baseline or manifest rejects (exit 5), while an unanswering canary (or both arms
   failing alike) is an infrastructure failure (exit 1), never a gate breach.
5. On every path out of the wait (approved, rejected, expired, the watcher, an error) the
   watcher stops and the candidate is unloaded from the canary (``cleanup``); on expiry
   the release fails closed (exit 5) and the message is marked expired.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run

from modelship.approvals.rules import (
    ApprovalInput,
    GroupResolver,
    check_decision,
    resolve_approvers,
)
from modelship.approvals.server import PrefectRuns
from modelship.approvals.wire import approval_digest
from modelship.candidate import ReleaseCandidate
from modelship.errors import (
    ApprovalDenied,
    ApprovalUnavailable,
    InfrastructureError,
    ModelshipError,
    ReleaseLocked,
)
from modelship.ledger import now_iso
from modelship.loadgen import LoadReport, LoadSpec, Target, run_load, run_paired
from modelship.locks import canary_slot
from modelship.policy import ApprovalPolicy, Policy
from modelship.repository import manifest_key, remote_digest
from modelship.slack import blocks
from modelship.slack.client import SlackClient
from modelship.triton.metrics import Scrape, delta, scrape
from tasks.canary import sequential_config
from tasks.sequential import SequentialCanary, SequentialConfig, log_e_over_budget

#: Seconds between two checks of "has the run been resumed?" (Prefect's default is 10 s).
POLL_INTERVAL_S = 1
#: The watcher's period, in seconds.
WATCH_INTERVAL_S = 5.0
#: Seconds of paired probe load per look, and its rate in pairs per second: light, so a
#: long wait costs the canary server little (≈ PROBE_S·PROBE_RPS pairs per look).
PROBE_S = 1.0
PROBE_RPS = 20.0
WATCHER = "modelship-watcher"
BASELINE, CANDIDATE = "baseline", "candidate"

Kind = Literal["breach", "evidence", "infrastructure"]


@dataclass(frozen=True)
class Finding:
    """Why the watcher stops the wait.

    Attributes:
        kind: ``breach`` (an always-valid test crossed its bound: exit 5), ``evidence``
            (what the approval rests on changed: the baseline, the staged bytes; exit 5)
            or ``infrastructure`` (the canary or a replica stopped answering: exit 1).
        reason: One sentence with the numbers.
    """

    kind: Kind
    reason: str


Check = Callable[[], str | Finding | None]


@dataclass(frozen=True)
class ApprovalRequest:
    """What this release needs: the policy's approval, with the CLI's overrides applied.

    Attributes:
        required: An approval click must come before the swap.
        approvers: Slack user ids (``U…``) or user group ids (``S…``) allowed to approve.
        requester: Who asked for the release; never allowed to approve it (four-eyes).
        timeout_s: Seconds before the request expires and the release fails closed.
    """

    required: bool
    approvers: tuple[str, ...] = ()
    requester: str | None = None
    timeout_s: int = 3600
    digest: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"required": self.required, "approvers": list(self.approvers),
                "requester": self.requester, "timeout_s": self.timeout_s}


def approval_request(policy: ApprovalPolicy, *, require: bool | None = None,
                     approvers: list[str] | None = None,
                     requester: str | None = None) -> ApprovalRequest:
    """The policy's approval with ``--require-approval`` / ``--approvers`` applied (pure)."""
    return ApprovalRequest(
        required=policy.required if require is None else require or policy.required,
        approvers=tuple(approvers if approvers else policy.approvers),
        requester=requester, timeout_s=policy.timeout_s)


@dataclass
class ApprovalChannels:
    """Where the approval is asked and how decisions come back, built at the edge.

    Attributes:
        notifier: The release thread's notifier (posts the request, updates it).
        resolve_group: Resolves a Slack user group to its members (None: groups grant
            nobody).
        resume: Resumes the paused run with an input (the watcher's rejection).
        watch: Returns why the canary's evidence no longer holds, or None.
        cleanup: Cleans the canary up after an expiry or a rejection; returns what it did.
        plot: The canary report's PNG, shown in the request.
    """

    notifier: Any
    resolve_group: GroupResolver | None = None
    resume: Callable[[str, dict[str, Any]], None] | None = None
    watch: Check | None = None
    cleanup: Callable[[], str] | None = None
    plot: Path | None = None
    watch_interval_s: float = WATCH_INTERVAL_S
    reminder_s: float | None = None


def pending_request(record: Any, request: ApprovalRequest, *, flow_run_id: str,
                    now: float) -> dict[str, Any]:
    """The durable pending approval of ``record`` (pure)."""
    digest = approval_digest(record.candidate)
    expires = now + request.timeout_s
    return {"kind": "request", "status": "pending", "release_id": record.id,
            "flow_run_id": flow_run_id, "digest": digest,
            "approvers": list(request.approvers), "requester": request.requester,
            "requested_at": now_iso(), "timeout_s": request.timeout_s,
            "expires_at": expires,
            "expires_at_iso": datetime.fromtimestamp(expires, UTC).isoformat(
                timespec="seconds"),
            "slack": {}, "file_id": None, "refusals": []}


def approve(request: ApprovalRequest, journal: Any, channels: ApprovalChannels, *,
            model: str, version: int) -> dict[str, Any]:
    """Pass a release that needs no approval; otherwise wait for one (fail closed).

    Returns:
        ``{"required": False}``, or the decided approval (who, when, through what).

    Raises:
        ApprovalDenied: rejected, expired, or rejected by the watcher (exit 5).
        ApprovalUnavailable: approval is required but the release runs outside a Prefect
            flow run, so nothing could resume it (exit 2).
    """
    if not request.required:
        return {"required": False, "decision": "not required"}
    if not request.approvers:
        raise ApprovalUnavailable(
            f"{model} v{version} needs an approval, and nobody is allowed to give it",
            hint="name the approvers: --approvers U1,U2 or approval.approvers in the policy",
            model=model, version=version)
    record = journal.record
    flow_run_id = record.holder.get("flow_run_id")
    if not flow_run_id:
        raise ApprovalUnavailable(
            f"{model} v{version} needs an approval, and this release runs outside a Prefect "
            "flow run, so nothing could resume it", hint="run it with `modelship promote`, "
            "which runs the flow on the Prefect server", model=model, version=version)
    if not record.candidate.get("canary_report_id"):
        raise ApprovalUnavailable(
            f"{model} v{version} has no canary report to approve",
            hint="approval needs a canary; run the promotion without --force", model=model)
    pending = pending_request(record, request, flow_run_id=str(flow_run_id), now=time.time())
    record.approvals.append(pending)
    journal.save()  # durable before anyone can click
    _post_request(journal, channels, pending)
    journal.save()
    watcher = _Watcher(channels, pending, journal)
    watcher.start()
    try:
        return _wait(request, journal, channels, pending, watcher)
    except BaseException as exc:
        if pending.get("status") == "pending":  # a stop or an error ended the wait: the
            # request closes with the run (saved below or by the record's end), so a late
            # click is refused instead of approving a release that is over
            pending.update(status="interrupted", decided_at=now_iso(),
                           reason=f"the run stopped while it waited ({type(exc).__name__})")
        raise
    finally:
        watcher.stop()
        _cleanup(journal, channels, pending)


def _cleanup(journal: Any, channels: ApprovalChannels, pending: dict[str, Any]) -> None:
    """Unload the candidate from the canary, once, on every path out of the wait (after
    the watcher stopped probing it); never raises over the outcome."""
    if channels.cleanup is None or "cleanup" in pending:
        return
    try:
        pending["cleanup"] = channels.cleanup()
    except Exception as exc:  # noqa: BLE001 - reported; the wait's outcome wins
        pending["cleanup"] = f"canary cleanup failed: {type(exc).__name__}: {exc}"
    if "failed" in pending["cleanup"]:
        journal.note(f"after the approval wait: {pending['cleanup']}; unload it from the "
                     "canary by hand (`modelship doctor` shows what is loaded)")
    try:
        journal.save()
    except ModelshipError as exc:
        journal.note(f"the record could not be saved after the canary cleanup: {exc.message}")


def _post_request(journal: Any, channels: ApprovalChannels, pending: dict[str, Any]) -> None:
    """The approval request as its own message in the thread, with the plot."""
    notifier = channels.notifier
    thread = journal.thread
    if notifier is None or getattr(notifier, "channel", None) is None:
        journal.note("Slack is not configured: the approval request was not posted; only "
                     "the Prefect UI form can decide")
        return
    if thread.down is not None or thread.ts is None:
        journal.note("the approval request was not posted (the release thread is not in "
                     f"Slack: {thread.down or 'no thread'}); only the Prefect UI form can "
                     "decide, else the approval expires and the release fails closed")
        return
    record = journal.record.to_dict()
    try:
        if channels.plot is not None and channels.plot.exists():
            pending["file_id"] = notifier.upload(channels.plot, title="canary report",
                                                 thread_ts=thread.ts)
        ts = notifier.post(blocks.approval_text(pending),
                           blocks.approval_blocks(pending, record,
                                                  file_id=pending["file_id"]),
                           thread_ts=thread.ts)
    except ModelshipError as exc:
        journal.note(f"the approval request could not be posted to Slack ({exc.message}); "
                     "only the Prefect UI form can decide, else the approval expires and the "
                     "release fails closed")
        return
    channel = getattr(notifier, "_posted_channel", None) or notifier.channel
    pending["slack"] = {"channel": channel, "ts": ts, "thread_ts": thread.ts}


def _wait(request: ApprovalRequest, journal: Any, channels: ApprovalChannels,
          pending: dict[str, Any], watcher: _Watcher) -> dict[str, Any]:
    record = journal.record
    model, version = pending["digest"]["model"], pending["digest"]["version"]
    attempt = 0
    while True:
        remaining = pending["expires_at"] - time.time()
        if remaining <= 0:
            _expire(journal, channels, pending, request)
        attempt += 1
        form = ApprovalInput.with_initial_data(
            description=f"Approve or reject {model} v{version} (release {record.id}). "
            "Same checks as the Slack buttons: an approver, not the requester, this digest.",
            release_id=record.id, digest=dict(pending["digest"]), channel="prefect-ui")
        try:
            got = pause_flow_run(wait_for_input=form, timeout=max(1, math.ceil(remaining)),
                                 poll_interval=POLL_INTERVAL_S,
                                 key=f"approval-{record.id.lower()}-{attempt}")
        except FlowPauseTimeout:
            _expire(journal, channels, pending, request)
        except (RuntimeError, ValueError) as exc:  # Prefect refused the pause or the input
            pending.update(status="failed", decided_at=now_iso())
            _show(journal, channels, pending, f"Failed: the run could not wait ({exc})")
            journal.save()
            raise InfrastructureError(
                f"{model} v{version} could not wait for its approval: {exc}",
                hint="production is unchanged; check the Prefect server, then promote "
                "again", model=model, version=version) from exc
        finding = watcher.finding
        if finding is not None:
            _decide(journal, channels, pending, "rejected", WATCHER, "watcher",
                    f"{finding.kind}: {finding.reason}")
            _notice(journal, channels, f"the watcher rejected {model} v{version} while it "
                    f"waited for approval ({finding.kind}): {finding.reason}", "critical")
            if finding.kind == "infrastructure":
                raise InfrastructureError(
                    f"the watcher stopped {model} v{version} while it waited for approval: "
                    f"{finding.reason}", hint="production is unchanged; the candidate was "
                    "not judged by this: fix the canary Triton or the replica named above "
                    "(`modelship doctor`), then promote again", model=model, version=version,
                    reason="infrastructure")
            raise ApprovalDenied(
                f"the watcher rejected {model} v{version} while it waited for approval: "
                f"{finding.reason}", hint="production is unchanged; look at the fleet and "
                "the canary, then promote again", model=model, version=version)
        allowed, unresolved = resolve_approvers(pending["approvers"], channels.resolve_group)
        verdict = check_decision(pending, decision=got.decision, user=got.user,
                                 release_id=got.release_id, digest=got.digest,
                                 allowed=allowed, now=time.time())
        if not verdict.ok:
            pending["refusals"].append({"user": got.user, "decision": got.decision,
                                        "channel": got.channel, "code": verdict.code,
                                        "at": now_iso()})
            journal.note(f"approval input refused ({verdict.code}): {verdict.message}"
                         + (f"; unresolved groups {unresolved}" if unresolved else ""))
            journal.save()
            continue
        status = "approved" if got.decision == "approve" else "rejected"
        _decide(journal, channels, pending, status, got.user, got.channel, got.reason)
        if status == "rejected":
            raise ApprovalDenied(
                f"{got.user} rejected {model} v{version} (via {got.channel})"
                + (f": {got.reason}" if got.reason else ""),
                hint="production is unchanged; fix what the approver named and promote "
                "again", model=model, version=version)
        return {"required": True, "decision": status, "by": got.user,
                "channel": got.channel, "at": pending["decided_at"]}


def _decide(journal: Any, channels: ApprovalChannels, pending: dict[str, Any], status: str,
            user: str, channel: str, reason: str | None) -> None:
    """Record the outcome and replace the buttons with it."""
    at = now_iso()
    pending.update(status=status, decided_by=user, decided_at=at, channel=channel,
                   reason=reason)
    journal.record.approvals.append({"kind": "decision", "decision": status, "user": user,
                                     "channel": channel, "at": at, "reason": reason})
    verb = {"approved": "Approved", "rejected": "Rejected"}[status]
    who = "the watcher" if user == WATCHER else f"<@{user}>"
    outcome = f"{verb} by {who} at {at} (via {channel})" + (f": {reason}" if reason else "")
    _show(journal, channels, pending, outcome)
    journal.save()


def _expire(journal: Any, channels: ApprovalChannels, pending: dict[str, Any],
            request: ApprovalRequest) -> NoReturn:
    """Fail closed: mark the request expired, clean the canary up, raise ApprovalDenied."""
    model, version = pending["digest"]["model"], pending["digest"]["version"]
    pending.update(status="expired", decided_at=now_iso())
    posted = bool((pending.get("slack") or {}).get("ts"))
    why = (f"the approval expired after {request.timeout_s} s without a valid decision"
           + ("" if posted else " (the request never reached Slack; see the notes)"))
    journal.record.approvals.append({"kind": "decision", "decision": "expired",
                                     "user": None, "channel": None, "at": now_iso(),
                                     "reason": why})
    _show(journal, channels, pending, f"Expired at {pending['decided_at']}: {why}")
    _notice(journal, channels, f"the approval of {model} v{version} expired: {why}",
            "warning")
    journal.save()
    raise ApprovalDenied(f"{model} v{version} was not released: {why}",
                         hint="production is unchanged; promote again and ask an approver "
                         f"({', '.join(request.approvers)}) to click in time",
                         model=model, version=version)


def _notice(journal: Any, channels: ApprovalChannels, text: str, severity: str) -> None:
    """A notice in the release's thread, as loud as its severity."""
    root = journal.thread.ts
    if root is None or channels.notifier is None or journal.thread.down is not None:
        return
    try:
        channels.notifier.post(text, blocks.notice_blocks(text, severity), thread_ts=root)
    except ModelshipError as exc:
        journal.note(f"a {severity} notice could not be posted: {exc.message}")


def _show(journal: Any, channels: ApprovalChannels, pending: dict[str, Any],
          outcome: str) -> None:
    slack_at = pending.get("slack") or {}
    if not slack_at.get("ts") or channels.notifier is None:
        return
    try:
        channels.notifier.update(slack_at["ts"], blocks.approval_text(pending),
                                 blocks.approval_outcome_blocks(
                                     pending, journal.record.to_dict(), outcome=outcome,
                                     file_id=pending.get("file_id")))
    except ModelshipError as exc:
        journal.note(f"the approval message could not be updated: {exc.message}")


class _Watcher:
    """While the run waits: look at the evidence, ping the thread, reject on a finding.

    A watch that raises is a failed look: twice in a row is an infrastructure finding.
    """

    def __init__(self, channels: ApprovalChannels, pending: dict[str, Any],
                 journal: Any) -> None:
        self.channels = channels
        self.pending = pending
        self.journal = journal
        self.finding: Finding | None = None
        self.looks = 0
        self._stop = threading.Event()
        self._context = contextvars.copy_context()  # Prefect's settings (API URL)
        self._thread = threading.Thread(target=lambda: self._context.run(self._run),
                                        name="approval-watcher", daemon=True)

    @property
    def breach(self) -> str | None:
        """The finding's reason, or None."""
        return self.finding.reason if self.finding is not None else None

    def start(self) -> None:
        if self.channels.watch is not None or self.channels.reminder_s:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10 + PROBE_S)

    def _run(self) -> None:
        last_ping = time.monotonic()
        failed_looks = 0
        while not self._stop.wait(self.channels.watch_interval_s):
            reminder = self.channels.reminder_s
            if reminder and time.monotonic() - last_ping >= reminder:
                last_ping = time.monotonic()
                self._remind()
            if self.channels.watch is None:
                continue
            try:
                found = self.channels.watch()
                failed_looks = 0
            except Exception as exc:  # noqa: BLE001 - a watch that cannot look is a finding
                failed_looks += 1
                found = Finding("infrastructure", "the watch failed twice in a row: "
                                f"{type(exc).__name__}: {exc}") if failed_looks >= 2 else None
            self.looks += 1
            if found is None:
                continue
            self.finding = found if isinstance(found, Finding) else Finding("breach", found)
            if self.channels.resume is not None:
                self._reject(self.finding)
            return

    def _remind(self) -> None:
        thread = (self.pending.get("slack") or {}).get("thread_ts")
        if not thread or self.channels.notifier is None:
            return
        left = max(0, int(self.pending["expires_at"] - time.time()))
        text = f"still waiting for an approval; {left} s left before it expires"
        try:
            self.channels.notifier.post(text, blocks.notice_blocks(text, "info"),
                                        thread_ts=thread)
        except ModelshipError:
            pass  # a lost ping changes nothing

    def _reject(self, finding: Finding) -> None:
        resume = self.channels.resume
        if resume is None:
            return
        for _ in range(30):  # the run may be between two pauses: retry for a while
            try:
                resume(self.pending["flow_run_id"], {
                    "decision": "reject", "user": WATCHER,
                    "release_id": self.pending["release_id"],
                    "digest": self.pending["digest"], "channel": "watcher",
                    "reason": f"{finding.kind}: {finding.reason}", "at": now_iso()})
                return
            except Exception:  # noqa: BLE001 - not paused yet; try again
                if self._stop.wait(1.0):
                    return


def channels_for(settings: Any, clients: Any, *, release: ReleaseCandidate,
                 baseline: int | None, notifier: Any, plot: Path | None, timeout_s: int,
                 max_error_rate: float = 0.01,
                 policy: Policy | None = None) -> ApprovalChannels:
    """The approval's channels from settings and clients (the wiring, at the edge).

    The watch probes with the release's golden rows and holds the staged manifest to the
    release's digest (nothing about the candidate is loaded again). With ``policy``, the
    watch takes its tests from it: the sequential canary's settings from ``gates`` (as
    :func:`tasks.canary.sequential_config` builds them for the canary), production's error
    budget and α from ``bake``, the probe's rows from ``export``.
    """
    resolve: GroupResolver | None = None
    if settings.slack_api_url and settings.slack_token is not None:
        slack = SlackClient(settings.slack_api_url, settings.slack_token.get_secret_value(),
                            timeout_s=settings.http_timeout_s)
        resolve = slack.group_members
    runs = PrefectRuns(settings.prefect_api_url)
    judge = EvidenceJudge(
        sequential_config(policy.gates) if policy is not None else SequentialConfig(),
        max_error_rate=policy.bake.max_error_rate if policy is not None else max_error_rate,
        alpha=policy.bake.alpha if policy is not None else 0.01)
    return ApprovalChannels(
        notifier=notifier, resolve_group=resolve, resume=runs.resume,
        watch=evidence_watch(settings, clients, release=release, baseline=baseline,
                             judge=judge, rows=policy.export.golden_max_rows
                             if policy is not None else 64),
        cleanup=lambda: canary_cleanup(clients, release.model), plot=plot,
        reminder_s=max(30.0, timeout_s / 4))


# --------------------------------------------------------------------------------------
# the watch: pure judgement, then the I/O around it


@dataclass(frozen=True)
class ProbeBatch:
    """One look's paired probe on the canary, as the client saw it.

    Attributes:
        baseline_ms: Latencies of the baseline's answered requests, ms, in completion
            order (paired by position with the candidate's, as the canary pairs them).
        candidate_ms: The candidate's, ms.
        baseline_errors: Failed baseline requests.
        candidate_errors: Failed candidate requests.
        first_error: One error text, for the reason.
    """

    baseline_ms: np.ndarray
    candidate_ms: np.ndarray
    baseline_errors: int = 0
    candidate_errors: int = 0
    first_error: str | None = None

    @property
    def sent(self) -> int:
        return (self.baseline_ms.size + self.candidate_ms.size + self.baseline_errors
                + self.candidate_errors)

    @property
    def answered(self) -> int:
        return int(self.baseline_ms.size + self.candidate_ms.size)


def probe_batch(records: Sequence[Any]) -> ProbeBatch:
    """A load report's measured records as one look (pure): untagged records (a first
    release, no baseline) are the candidate's."""
    arms: dict[str, list[float]] = {BASELINE: [], CANDIDATE: []}
    errors = {BASELINE: 0, CANDIDATE: 0}
    first: str | None = None
    for r in records:
        arm = r.tag or CANDIDATE
        if r.ok:
            arms[arm].append(float(r.latency_ms))
        else:
            errors[arm] += 1
            first = first or r.error
    return ProbeBatch(np.asarray(arms[BASELINE], dtype=float),
                      np.asarray(arms[CANDIDATE], dtype=float),
                      errors[BASELINE], errors[CANDIDATE], first)


class EvidenceJudge:
    """The approval wait's verdict, look by look (pure: no I/O).

    - :meth:`probe` feeds the canary probe to a :class:`SequentialCanary` (errors and
      latency e-processes); ``failed`` is a breach, ``inconclusive`` (both arms fail
      alike) and a look where nothing answered are infrastructure reasons;
    - :meth:`production` accumulates production's failures and requests since the wait
      began, judged by :func:`log_e_over_budget` at ``1 / alpha``;
    - :meth:`conclude` turns the look's reasons into a finding: a breach at once; an
      evidence or infrastructure reason only when the previous look had one too.

    Args:
        config: The sequential canary's rules and α (from the policy's gates).
        max_error_rate: Production's error budget (``bake.max_error_rate``).
        alpha: Production's error rule's level over the whole wait (``bake.alpha``).
    """

    def __init__(self, config: SequentialConfig | None = None, *,
                 max_error_rate: float = 0.001, alpha: float = 0.01) -> None:
        self.canary = SequentialCanary(config or SequentialConfig())
        self.max_error_rate = max_error_rate
        self.alpha = alpha
        self.failed = 0.0
        self.total = 0.0
        self.looks = 0
        self._streak: list[tuple[Kind, str]] = []

    def probe(self, batch: ProbeBatch) -> tuple[Kind, str] | None:
        """Ingest one look's probe; why it stops the wait, or None."""
        if batch.sent and not batch.answered:
            return ("infrastructure", f"none of the {batch.sent} probe requests to the "
                    "canary was answered" + (f" ({batch.first_error})"
                                             if batch.first_error else ""))
        if not batch.sent:
            return ("infrastructure", "the probe sent nothing to the canary")
        decision = self.canary.update(batch.baseline_ms, batch.candidate_ms,
                                      baseline_errors=batch.baseline_errors,
                                      candidate_errors=batch.candidate_errors)
        if decision.status == "failed":
            return ("breach", f"the candidate on the canary: {decision.reason}")
        if decision.status == "inconclusive":
            return ("infrastructure", f"the canary probe: {decision.reason}")
        return None

    def production(self, failures: float, requests: float, *, model: str,
                   version: int) -> tuple[Kind, str] | None:
        """Add production's failures and answered requests since the last look; why its
        error rate is above the budget with always-valid evidence, or None."""
        self.failed += max(0.0, failures)
        self.total += max(0.0, failures) + max(0.0, requests)
        failed, total = int(self.failed), int(self.total)
        if failed == 0 or total == 0:
            return None
        log_e = log_e_over_budget(failed, total, self.max_error_rate)
        if log_e < math.log(1.0 / self.alpha):
            return None
        evidence = "certain" if math.isinf(log_e) else f"e-value {math.exp(min(log_e, 700)):.3g}"
        return ("breach", f"production {model} v{version} failed {failed} of {total} "
                f"requests while the release waited ({failed / total:.2%} > "
                f"{self.max_error_rate:.2%}: {evidence} ≥ 1/α = {1 / self.alpha:g}): the "
                "canary's baseline no longer holds")

    def conclude(self, reasons: Sequence[tuple[Kind, str] | None]) -> Finding | None:
        """The look's finding from its reasons (in order of precedence)."""
        self.looks += 1
        found = [r for r in reasons if r is not None]
        for kind, reason in found:
            if kind == "breach":
                return Finding(kind, reason)
        if not found:
            self._streak.clear()
            return None
        seen_before = bool(self._streak)
        self._streak = found
        if seen_before:
            kind, reason = found[0]
            return Finding(kind, f"{reason} (two looks in a row)")
        return None


def production_change(before: Mapping[str, Scrape], after: Mapping[str, Scrape], *,
                      model: str, version: int) -> tuple[float, float]:
    """Production's (failures, successes) between two scrapes of every replica (pure; a
    replica first seen now contributes nothing; counter resets count from zero)."""
    failures = successes = 0.0
    for name, now in after.items():
        if name not in before:
            continue
        change = delta(before[name], now).get((model, str(version)))
        if change is not None:
            failures += change.failures
            successes += change.requests
    return failures, successes


def error_rate_breach(before: Any, after: Any, *, model: str, version: int, max_rate: float,
                      where: str, alpha: float = 0.01) -> str | None:
    """Why the version's failures between two scrapes show, with always-valid evidence
    (:func:`log_e_over_budget` at ``1 / alpha``), an error rate above ``max_rate``, or
    None (pure; no earlier scrape or no traffic is no breach)."""
    if before is None:
        return None
    judge = EvidenceJudge(max_error_rate=max_rate, alpha=alpha)
    failures, successes = production_change({where: before}, {where: after}, model=model,
                                            version=version)
    found = judge.production(failures, successes, model=model, version=version)
    return None if found is None else f"on {where}: {found[1]}"


def _probe(url: str, model: str, version: int, baseline: int | None,
           payload: Mapping[str, np.ndarray], *, seconds: float, rps: float,
           timeout_s: float) -> LoadReport:
    """Paired golden rows to the baseline and the candidate on the canary (the candidate
    alone on a first release), like the canary's load."""
    spec = LoadSpec(protocol="grpc", rate_rps=rps, duration_s=seconds, warmup_s=0.0,
                    window_s=seconds, timeout_s=timeout_s, max_duration_s=seconds + 5)
    if baseline is None:
        report: LoadReport = asyncio.run(run_load([url], model, payload, spec,
                                                  version=str(version)))
        return report
    report = asyncio.run(run_paired(Target(url, model, str(baseline)),
                                    Target(url, model, str(version)), payload, spec,
                                    tags=(BASELINE, CANDIDATE)))
    return report


def evidence_watch(settings: Any, clients: Any, *, release: ReleaseCandidate,
                   baseline: int | None, max_error_rate: float = 0.001,
                   judge: EvidenceJudge | None = None, rows: int = 64,
                   probe_s: float = PROBE_S, probe_rps: float = PROBE_RPS) -> Check:
    """One look at what the approval rests on, each time it is called (the I/O; the
    verdict is :class:`EvidenceJudge`'s).

    Each look: production's counters on every replica, the paired probe of the candidate
    and the baseline on the canary (when there is a canary) with the release's first
    ``rows`` golden rows, whether every replica still serves the baseline, the staged
    manifest's digest (its HEAD) against the release's, the canary's liveness.

    Args:
        release: The candidate as its stage handed it over (rows and digest: nothing about
            it is loaded from MLflow or read from S3 again).
        judge: The always-valid tests (default: the sequential canary's defaults and
            ``max_error_rate``).
    """
    return _EvidenceWatch(settings, clients, release=release, baseline=baseline,
                          judge=judge or EvidenceJudge(max_error_rate=max_error_rate),
                          payload=release.rows(rows), probe_s=probe_s, probe_rps=probe_rps)


@dataclass
class _EvidenceWatch:
    """The looks of :func:`evidence_watch`: each call reads every source once and asks the
    judge. Between looks it keeps production's last scrape (the next look counts from it).

    Attributes:
        release: The candidate (its digest as its canary saw it: ``manifest_sha256``).
        baseline: The version production serves (None on a first release: no production
            to watch, the candidate probed alone).
        payload: The rows the probe sends (the release's first golden rows).
        probe_s: Seconds of paired probe per look (0: no probe).
        probe_rps: Pairs per second of the probe.
        before: Every replica's previous scrape, by name.
    """

    settings: Any
    clients: Any
    release: ReleaseCandidate
    baseline: int | None
    judge: EvidenceJudge
    payload: Mapping[str, np.ndarray]
    probe_s: float
    probe_rps: float
    before: dict[str, Scrape] = field(default_factory=dict)

    def __call__(self) -> Finding | None:
        down = self.canary_down()
        return self.judge.conclude([self.production(), down,
                                    None if down else self.probe(), self.evidence()])

    def production(self) -> tuple[Kind, str] | None:
        """Production's failures since the last look, through the bake's e-process."""
        if self.baseline is None:
            return None
        now: dict[str, Scrape] = {}
        for replica in self.clients.replicas:
            try:
                now[replica.name] = scrape(replica.endpoint.metrics,
                                           self.settings.http_timeout_s)
            except ModelshipError as exc:
                return ("infrastructure", f"{replica.name}'s metrics did not answer: "
                        f"{exc.message}")
        failures, successes = production_change(self.before, now, model=self.release.model,
                                                version=self.baseline)
        self.before.update(now)
        return self.judge.production(failures, successes, model=self.release.model,
                                     version=self.baseline)

    def probe(self) -> tuple[Kind, str] | None:
        """The paired probe on the canary, fed to the sequential canary's e-processes."""
        canary, storage = self.clients.canary, self.clients.storage
        if canary is None or (self.probe_s <= 0 or self.probe_rps <= 0):
            return None
        model, version = self.release.model, self.release.version
        # The probe is load on the shared canary Triton: it takes the canary slot, without
        # waiting. While another model's canary measures there, this look skips its probe
        # (the e-processes allow any number of looks), so neither measures the other.
        with ExitStack() as slot:
            try:
                slot.enter_context(canary_slot(
                    storage, model=model, wait_s=0,
                    owner=f"approval watch of {model} v{version} (pid {os.getpid()})"))
            except ReleaseLocked:
                return None
            report = _probe(canary.endpoint.grpc, model, version, self.baseline, self.payload,
                            seconds=self.probe_s, rps=self.probe_rps,
                            timeout_s=self.settings.http_timeout_s)
        return self.judge.probe(probe_batch(report.measured_records()))

    def evidence(self) -> tuple[Kind, str] | None:
        """What the approval rests on: every replica serves the baseline, the staged
        manifest is the one the canary measured (its HEAD's sha256, written with it at
        staging; the swap verifies the bytes themselves, DESIGN §4)."""
        model, version, baseline = self.release.model, self.release.version, self.baseline
        if baseline is not None:
            for replica in self.clients.replicas:
                if not replica.is_model_ready(model, str(baseline)):
                    return ("evidence", f"{replica.name} no longer serves {model} "
                            f"v{baseline}, the baseline the canary compared against")
        if self.clients.storage is not None:
            found = remote_digest(self.clients.storage.head(manifest_key(
                self.settings.repository_prefix, model, version)))
            now = "absent" if found is None else found.sha256 or "unmarked"
            was = str(self.release.digest.get("manifest_sha256"))
            if now != was:
                return ("evidence", f"the staged {model} v{version} changed after its "
                        f"canary (manifest {now[:12]}, canary saw {was[:12]})")
        return None

    def canary_down(self) -> tuple[Kind, str] | None:
        """The canary server stopped answering (an infrastructure finding)."""
        if self.clients.canary is not None:
            try:
                self.clients.canary.ping()
            except ModelshipError as exc:
                return ("infrastructure", f"the canary server stopped answering: "
                        f"{exc.message}")
        return None


def canary_cleanup(clients: Any, model: str, *, wait_s: float = 10.0) -> str:
    """Unload the model from the canary server if anything of it is still loaded there, and
    wait until no version of it is left (the next canary must not race it)."""
    canary = clients.canary
    if canary is None:
        return "no canary server"
    try:
        loaded = [m for m in canary.repository_index() if m.get("name") == model
                  and m.get("state") in ("READY", "LOADING", "UNLOADING")]
        if not loaded:
            return "nothing loaded on the canary"
        canary.unload_model(model)
        end = time.monotonic() + wait_s
        while any(m.get("name") == model and m.get("state") in ("READY", "LOADING",
                                                                 "UNLOADING")
                  for m in canary.repository_index()):
            if time.monotonic() > end:
                return f"canary cleanup failed: {model} still loaded {wait_s:g} s after the unload"
            time.sleep(0.1)
        return "unloaded from the canary"
    except ModelshipError as exc:
        return f"canary cleanup failed: {exc.message}"
