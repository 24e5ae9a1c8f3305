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
4. While it waits, a watcher re-checks the canary's evidence (the fleet still serves the
   baseline the canary compared against, the candidate's staged bytes are unchanged, the
   canary server is alive) and rejects the release itself on a breach, with the reason.
5. On expiry the release fails closed (exit 5), the canary is cleaned up and the message
   is marked expired.
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from model_registry.ledger import now_iso
from modelship.approvals.rules import (
    ApprovalInput,
    GroupResolver,
    check_decision,
    resolve_approvers,
)
from modelship.approvals.wire import approval_digest
from modelship.errors import (
    ApprovalDenied,
    ApprovalUnavailable,
    InfrastructureError,
    ModelshipError,
)
from modelship.policy import ApprovalPolicy
from modelship.slack import blocks

#: Seconds between two checks of "has the run been resumed?" (Prefect's default is 10 s).
POLL_INTERVAL_S = 1
#: The watcher's period, in seconds.
WATCH_INTERVAL_S = 5.0
WATCHER = "modelship-watcher"

Check = Callable[[], str | None]


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
        decided = _wait(request, journal, channels, pending, watcher)
    finally:
        watcher.stop()
    return decided


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
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import pause_flow_run

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
        if watcher.breach is not None:
            _decide(journal, channels, pending, "rejected", WATCHER, "watcher",
                    watcher.breach)
            _notice(journal, channels, f"the watcher rejected {model} v{version} while it "
                    f"waited for approval: {watcher.breach}", "critical")
            raise ApprovalDenied(
                f"the watcher rejected {model} v{version} while it waited for approval: "
                f"{watcher.breach}", hint="production is unchanged; look at the fleet and "
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
    if status == "rejected" and channels.cleanup is not None:
        pending["cleanup"] = channels.cleanup()
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
    if channels.cleanup is not None:
        pending["cleanup"] = channels.cleanup()
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
    """While the run waits: re-check the evidence, ping the thread, reject on a breach."""

    def __init__(self, channels: ApprovalChannels, pending: dict[str, Any],
                 journal: Any) -> None:
        self.channels = channels
        self.pending = pending
        self.journal = journal
        self.breach: str | None = None
        self._stop = threading.Event()
        self._context = contextvars.copy_context()  # Prefect's settings (API URL)
        self._thread = threading.Thread(target=lambda: self._context.run(self._run),
                                        name="approval-watcher", daemon=True)

    def start(self) -> None:
        if self.channels.watch is not None or self.channels.reminder_s:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        last_ping = time.monotonic()
        while not self._stop.wait(self.channels.watch_interval_s):
            reminder = self.channels.reminder_s
            if reminder and time.monotonic() - last_ping >= reminder:
                last_ping = time.monotonic()
                self._remind()
            if self.channels.watch is None:
                continue
            try:
                breach = self.channels.watch()
            except Exception as exc:  # noqa: BLE001 - a watch that cannot look is a breach
                breach = f"the watch itself failed: {type(exc).__name__}: {exc}"
            if breach is None:
                continue
            self.breach = breach
            if self.channels.resume is not None:
                self._reject(breach)
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

    def _reject(self, breach: str) -> None:
        assert self.channels.resume is not None
        for _ in range(30):  # the run may be between two pauses: retry for a while
            try:
                self.channels.resume(self.pending["flow_run_id"], {
                    "decision": "reject", "user": WATCHER,
                    "release_id": self.pending["release_id"],
                    "digest": self.pending["digest"], "channel": "watcher",
                    "reason": breach, "at": now_iso()})
                return
            except Exception:  # noqa: BLE001 - not paused yet; try again
                if self._stop.wait(1.0):
                    return


def channels_for(settings: Any, clients: Any, *, model: str, version: int,
                 baseline: int | None, candidate: dict[str, Any], notifier: Any,
                 plot: Path | None, timeout_s: int,
                 max_error_rate: float = 0.01) -> ApprovalChannels:
    """The approval's channels from settings and clients (the wiring, at the edge)."""
    from modelship.approvals.server import PrefectRuns
    from modelship.approvals.slack_api import ApprovalSlack

    resolve: GroupResolver | None = None
    if settings.slack_api_url and settings.slack_token is not None:
        slack = ApprovalSlack(settings.slack_api_url, settings.slack_token.get_secret_value(),
                              timeout_s=settings.http_timeout_s)
        resolve = slack.group_members
    runs = PrefectRuns(settings.prefect_api_url)
    return ApprovalChannels(
        notifier=notifier, resolve_group=resolve, resume=runs.resume,
        watch=evidence_watch(settings, clients, model=model, version=version,
                             baseline=baseline, candidate=candidate,
                             max_error_rate=max_error_rate),
        cleanup=lambda: canary_cleanup(clients, model), plot=plot,
        reminder_s=max(30.0, timeout_s / 4))


def error_rate_breach(before: Any, after: Any, *, model: str, version: int, max_rate: float,
                      where: str, min_requests: int = 20) -> str | None:
    """Why the version's server-side error rate between two scrapes breaches ``max_rate``,
    or None (pure; too few requests to judge is not a breach)."""
    from modelship.triton.metrics import delta

    if before is None:
        return None
    change = delta(before, after).get((model, str(version)))
    if change is None:
        return None
    total = change.requests + change.failures
    if total < min_requests:
        return None
    rate = change.failures / total
    if rate <= max_rate:
        return None
    return (f"{model} v{version} on {where} failed {change.failures:.0f} of {total:.0f} "
            f"requests ({rate:.1%} > {max_rate:.1%}) while the release waited: the canary's "
            "baseline no longer holds")


def evidence_watch(settings: Any, clients: Any, *, model: str, version: int,
                   baseline: int | None, candidate: dict[str, Any],
                   max_error_rate: float = 0.01) -> Check:
    """A check of what the canary's verdict rests on; a breach must be seen twice in a row.

    - production's error rate on every replica (Triton's counters between two looks) stays
      within ``max_error_rate`` (the bake's limit);
    - every replica still serves the baseline the canary compared against;
    - the candidate's staged manifest is unchanged (same sha256: the approved bytes);
    - the canary server answers.
    """
    from modelship.triton.metrics import scrape
    from tasks.evidence import read_candidate_digest

    seen: list[str] = []
    before: dict[str, Any] = {}

    def metrics() -> str | None:
        """Production's own error rate since the last look (Triton's counters)."""
        if baseline is None:
            return None
        for replica in clients.replicas:
            now = scrape(replica.endpoint.metrics, settings.http_timeout_s)
            found = error_rate_breach(before.get(replica.name), now, model=model,
                                      version=baseline, max_rate=max_error_rate,
                                      where=replica.name)
            before[replica.name] = now
            if found:
                return found
        return None

    def look() -> str | None:
        if breach := metrics():
            return breach
        if baseline is not None:
            for replica in clients.replicas:
                if not replica.is_model_ready(model, str(baseline)):
                    return (f"{replica.name} no longer serves {model} v{baseline}, the "
                            "baseline the canary compared against")
        if clients.storage is not None:
            digest = read_candidate_digest(clients.storage,
                                           repository_prefix=settings.repository_prefix,
                                           model=model, version=version)
            if digest.get("manifest_sha256") != candidate.get("manifest_sha256"):
                return (f"the staged {model} v{version} changed after its canary (manifest "
                        f"{str(digest.get('manifest_sha256'))[:12]}, canary saw "
                        f"{str(candidate.get('manifest_sha256'))[:12]})")
        if clients.canary is not None:
            try:
                clients.canary.ping()
            except ModelshipError as exc:
                return f"the canary server stopped answering: {exc.message}"
        return None

    def check() -> str | None:
        found = look()
        if found is None:
            seen.clear()
            return None
        seen.append(found)
        return found if len(seen) >= 2 else None

    return check


def canary_cleanup(clients: Any, model: str) -> str:
    """Unload the model from the canary server if anything of it is still loaded there."""
    canary = clients.canary
    if canary is None:
        return "no canary server"
    try:
        if not canary.is_model_ready(model):
            return "nothing loaded on the canary"
        canary.unload_model(model)
        return "unloaded from the canary"
    except ModelshipError as exc:
        return f"canary cleanup failed: {exc.message}"
