"""``modelship approvals serve``: the Slack interactivity endpoint (DESIGN §2, stage 7).

A click reaches ``POST /slack/interactivity``. Before a paused release resumes, the request
passes every check, in this order, and the first that fails answers with its HTTP status,
writes one ``approval_refused`` line to the audit log and resumes nothing:

==========================  ======  =============================================
check                       status  code
==========================  ======  =============================================
body at most 64 KiB         413     ``oversized_body``
signature headers present   401     ``missing_signature``
timestamp within 5 min      401     ``stale_timestamp``
``v0=`` HMAC on the raw body 401    ``bad_signature`` (``SignatureVerifier``)
not seen before             409     ``replayed`` (same signature)
a ``block_actions`` click   400     ``malformed_payload``
an approval waits           409     ``no_pending_approval`` / ``already_decided`` /
                                    ``expired``
same candidate digest       409     ``stale_digest``
four-eyes                   403     ``requester_cannot_approve`` (told ephemerally)
an approver                 403     ``not_an_approver`` (told ephemerally)
the run is paused           409     ``not_paused``
==========================  ======  =============================================

Then it resumes the run with ``resume_flow_run(..., run_input=...)`` and replaces the
buttons with the outcome. A second click on a decided release (a double click) answers 200
with the outcome and resumes nothing. The pending approval lives in the release record in
S3, so a restarted service picks it up; it keeps no state of its own beyond the replay cache.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol, cast
from urllib.parse import parse_qs
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.exceptions import FlowPauseTimeout, NotPausedError
from prefect.flow_runs import resume_flow_run
from slack_sdk.signature import Clock, SignatureVerifier

from modelship.approvals.rules import check_decision, pending_entry, resolve_approvers
from modelship.approvals.wire import ACTIONS, parse_button_value
from modelship.clients import build_clients
from modelship.errors import ModelshipError, StorageError, UsageError
from modelship.ledger import Ledger, ReleaseRecord
from modelship.prefect_api import pointed_at
from modelship.slack import blocks
from modelship.slack.client import SlackClient

log = logging.getLogger("modelship.approvals")

MAX_BODY_BYTES = 64 * 1024  # Slack's payloads are a few KiB
TIMESTAMP_WINDOW_S = 300  # Slack's own advice: refuse requests older than 5 minutes
INTERACTIVITY_PATH = "/slack/interactivity"


class FlowRuns(Protocol):
    """The two Prefect calls the endpoint makes."""

    def state(self, flow_run_id: str) -> str | None:
        """The run's state type (``PAUSED``, ``RUNNING``…), None if there is no such run."""
        ...

    def resume(self, flow_run_id: str, run_input: dict[str, Any]) -> None:
        """Resume a paused run with its input; raises NotPaused if it is not paused."""
        ...


class NotPaused(Exception):
    """The run was not paused when the resume reached Prefect."""


class PrefectRuns:
    """:class:`FlowRuns` over a Prefect server's API."""

    def __init__(self, api_url: str | None) -> None:
        self.api_url = api_url

    def state(self, flow_run_id: str) -> str | None:
        with pointed_at(self.api_url), get_client(sync_client=True) as client:
            try:
                run = client.read_flow_run(UUID(flow_run_id))
            except Exception:  # noqa: BLE001 - ObjectNotFound and a malformed id alike
                return None
        return run.state.type.value if run.state else None

    def resume(self, flow_run_id: str, run_input: dict[str, Any]) -> None:
        with pointed_at(self.api_url):
            try:
                resume_flow_run(UUID(flow_run_id), run_input=run_input)
            except (NotPausedError, FlowPauseTimeout) as exc:
                raise NotPaused(str(exc)) from exc


@dataclass
class Reply:
    """An HTTP answer: status and JSON body."""

    status: int
    body: dict[str, Any]


@dataclass
class ApprovalService:
    """The checks and the resume, independent of HTTP (the server below wraps it).

    Args:
        secret: The Slack signing secret.
        ledger: Where the release records (and their pending approvals) are.
        runs: Prefect.
        slack: Slack, for user groups, message updates and ephemeral replies; None when
            Slack is not configured (user groups then grant nobody).
        audit_path: The audit log (JSON lines); every refusal and decision is appended.
        clock: Epoch seconds (tests move it).
    """

    secret: str
    ledger: Ledger
    runs: FlowRuns
    slack: SlackClient | None = None
    audit_path: Path | None = None
    clock: Callable[[], float] = time.time
    _seen: dict[str, float] = field(default_factory=dict)
    _decided: dict[str, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _release_locks: dict[str, threading.Lock] = field(default_factory=dict)
    resumes: int = 0

    # ------------------------------------------------------------------ audit

    def audit(self, event: str, **fields: Any) -> None:
        line = {"event": event, "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                **fields}
        text = json.dumps(line, sort_keys=True, default=str)
        log.warning(text) if event == "approval_refused" else log.info(text)
        if self.audit_path is not None:
            with self._lock, self.audit_path.open("a", encoding="utf-8") as handle:
                handle.write(text + "\n")

    def refuse(self, code: str, status: int, message: str, **fields: Any) -> Reply:
        self.audit("approval_refused", code=code, status=status, message=message, **fields)
        return Reply(status, {"ok": False, "error": code, "message": message})

    # ------------------------------------------------------------------ the request

    def handle(self, headers: Mapping[str, str], body: bytes) -> Reply:
        """Check one interactivity request and act on it (see the module docstring)."""
        if len(body) > MAX_BODY_BYTES:
            return self.refuse("oversized_body", 413, f"the body is {len(body)} bytes; at "
                               f"most {MAX_BODY_BYTES}")
        lower = {k.lower(): v for k, v in headers.items()}
        timestamp = lower.get("x-slack-request-timestamp")
        signature = lower.get("x-slack-signature")
        if not timestamp or not signature:
            return self.refuse("missing_signature", 401, "X-Slack-Signature and "
                               "X-Slack-Request-Timestamp are required")
        now = self.clock()
        try:
            age = abs(now - int(timestamp))
        except ValueError:
            return self.refuse("stale_timestamp", 401, f"timestamp {timestamp!r} is not "
                               "an integer")
        if age > TIMESTAMP_WINDOW_S:
            return self.refuse("stale_timestamp", 401, f"the request is {age:.0f} s from "
                               f"now; at most {TIMESTAMP_WINDOW_S} s")
        verifier = SignatureVerifier(self.secret, clock=_FixedClock(now))
        if not verifier.is_valid(body, timestamp, signature):
            return self.refuse("bad_signature", 401, "the signature does not match the "
                               "body and the signing secret")
        with self._lock:
            self._seen = {s: t for s, t in self._seen.items() if t > now}
            if signature in self._seen:
                replayed = True
            else:
                replayed = False
                self._seen[signature] = now + 2 * TIMESTAMP_WINDOW_S
        if replayed:
            return self.refuse("replayed", 409, "this exact request was received before")
        try:
            click = parse_click(body)
        except ValueError as exc:
            return self.refuse("malformed_payload", 400, f"not a button click: {exc}")
        with self._release_lock(click.release_id):
            return self._decide(click, now)

    def _release_lock(self, release_id: str) -> threading.Lock:
        with self._lock:
            return self._release_locks.setdefault(release_id, threading.Lock())

    def _decide(self, click: Click, now: float) -> Reply:
        who = {"release_id": click.release_id, "user": click.user,
               "decision": click.decision}
        done = self._decided.get(click.release_id)
        if done is not None:  # a double click: answer with the outcome, resume nothing
            self.audit("approval_repeated", **who, outcome=done["status"])
            return Reply(200, {"ok": True, "idempotent": True, **done})
        model = str(click.digest.get("model") or "")
        try:
            record = self.ledger.read(model, click.release_id)
        except StorageError as exc:
            return self.refuse("no_pending_approval", 409, f"no release {click.release_id} "
                               f"of {model!r} is on record", **who, error=exc.message)
        except ModelshipError as exc:
            return self.refuse("unavailable", 503, f"the release record could not be read: "
                               f"{exc.message}", **who)
        pending = pending_entry(record.approvals)
        if pending is not None and pending.get("status") in ("approved", "rejected") \
                and pending.get("decided_by"):
            outcome = {"status": pending["status"], "by": pending["decided_by"]}
            self.audit("approval_repeated", **who, outcome=pending["status"])
            return Reply(200, {"ok": True, "idempotent": True, **outcome})
        allowed, unresolved = resolve_approvers((pending or {}).get("approvers") or [],
                                                self.slack.group_members if self.slack
                                                else None)
        verdict = check_decision(pending, decision=click.decision, user=click.user,
                                 release_id=click.release_id, digest=click.digest,
                                 allowed=allowed, now=now)
        if not verdict.ok:
            if verdict.status == 403:
                self._tell(click, pending, verdict.message)
            return self.refuse(verdict.code, verdict.status, verdict.message, **who,
                               unresolved_groups=unresolved)
        assert pending is not None  # check_decision refuses a missing one
        run_id = str(pending.get("flow_run_id") or "")
        state = self.runs.state(run_id)
        if state != "PAUSED":
            return self.refuse("not_paused", 409, f"the run of release {click.release_id} "
                               f"is not waiting (state {state})", **who)
        at = datetime.now(UTC).isoformat(timespec="seconds")
        run_input = {"decision": click.decision, "user": click.user,
                     "release_id": click.release_id, "digest": click.digest,
                     "channel": "slack", "reason": None, "at": at}
        try:
            self.runs.resume(run_id, run_input)
        except NotPaused as exc:
            return self.refuse("not_paused", 409, f"the run of release {click.release_id} "
                               f"is not waiting: {exc}", **who)
        self.resumes += 1
        status = "approved" if click.decision == "approve" else "rejected"
        outcome = {"status": status, "by": click.user, "at": at}
        self._decided[click.release_id] = outcome
        self.audit("approval_accepted", **who, flow_run_id=run_id)
        self._show_outcome(click, record, pending, status, at)
        return Reply(200, {"ok": True, **outcome})

    # ------------------------------------------------------------------ Slack side

    def _tell(self, click: Click, pending: Mapping[str, Any] | None, text: str) -> None:
        """Tell a refused clicker why, only to them (response_url, else postEphemeral)."""
        if self.slack is None:
            return
        try:
            if click.response_url:
                self.slack.respond(click.response_url, {"response_type": "ephemeral",
                                                        "replace_original": False,
                                                        "text": text})
            elif click.channel:
                thread = ((pending or {}).get("slack") or {}).get("thread_ts")
                self.slack.ephemeral(click.channel, click.user, text, thread_ts=thread)
        except ModelshipError as exc:
            self.audit("slack_failed", release_id=click.release_id, error=exc.message)

    def _show_outcome(self, click: Click, record: ReleaseRecord, pending: dict[str, Any],
                      status: str, at: str) -> None:
        """Replace the buttons with the outcome ("Approved by @x at …")."""
        slack_at = pending.get("slack") or {}
        if self.slack is None or not slack_at.get("ts"):
            return
        shown = {**pending, "status": status}
        verb = "Approved" if status == "approved" else "Rejected"
        outcome = f"{verb} by <@{click.user}> at {at}"
        try:
            self.slack.update_message(str(slack_at["channel"]), str(slack_at["ts"]),
                                      blocks.approval_text(shown),
                                      blocks=blocks.approval_outcome_blocks(
                                          shown, record.to_dict(), outcome=outcome,
                                          file_id=pending.get("file_id")))
        except ModelshipError as exc:  # the run resumed; the flow updates it again
            self.audit("slack_failed", release_id=click.release_id, error=exc.message)


class _FixedClock(Clock):
    """SignatureVerifier's clock, pinned to the time the checks above used."""

    def __init__(self, now: float) -> None:
        self._now = now

    def now(self) -> float:
        return self._now


@dataclass(frozen=True)
class Click:
    """One Approve/Reject click, parsed from a ``block_actions`` payload."""

    decision: str
    user: str
    release_id: str
    digest: dict[str, Any]
    channel: str | None
    message_ts: str | None
    response_url: str | None


def parse_click(body: bytes) -> Click:
    """The click in an interactivity body (``payload=<json>``, form encoded).

    Raises:
        ValueError: anything but one Approve/Reject button click.
    """
    try:
        form = parse_qs(body.decode("utf-8"), strict_parsing=True)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"the body is not form data ({exc})") from exc
    raw = form.get("payload")
    if not raw or len(raw) != 1:
        raise ValueError("no single payload field")
    try:
        payload = json.loads(raw[0])
    except json.JSONDecodeError as exc:
        raise ValueError(f"payload is not JSON ({exc})") from exc
    if not isinstance(payload, dict) or payload.get("type") != "block_actions":
        raise ValueError("payload is not a block_actions click")
    actions = payload.get("actions")
    user = payload.get("user")
    if not isinstance(actions, list) or len(actions) != 1 or not isinstance(actions[0], dict):
        raise ValueError("a click has exactly one action")
    if not isinstance(user, dict) or not isinstance(user.get("id"), str) or not user["id"]:
        raise ValueError("the click names no user")
    action = cast(dict[str, Any], actions[0])
    decision = ACTIONS.get(str(action.get("action_id")))
    if decision is None:
        raise ValueError(f"unknown action {action.get('action_id')!r}")
    try:
        release_id, digest = parse_button_value(str(action.get("value")))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the button value is not an approval's ({exc})") from exc
    channel = (payload.get("channel") or {}).get("id") if isinstance(
        payload.get("channel"), dict) else None
    message = payload.get("message") if isinstance(payload.get("message"), dict) else {}
    response_url = payload.get("response_url")
    return Click(decision=decision, user=user["id"], release_id=release_id, digest=digest,
                 channel=channel, message_ts=(message or {}).get("ts"),
                 response_url=response_url if isinstance(response_url, str) else None)


# ---------------------------------------------------------------------------- HTTP


class ApprovalsServer(ThreadingHTTPServer):
    """A threading HTTP server carrying the :class:`ApprovalService`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: ApprovalService) -> None:
        super().__init__(address, _Handler)
        self.service = service

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}{INTERACTIVITY_PATH}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "modelship-approvals/1"
    disable_nagle_algorithm = True
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the audit log has every decision."""

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/health", "/_approvals/health"):
            self._send(Reply(200, {"ok": True}))
        else:
            self._send(Reply(404, {"ok": False, "error": "not_found"}))

    def do_POST(self) -> None:
        service = cast(ApprovalsServer, self.server).service
        if self.path.split("?", 1)[0].rstrip("/") not in (INTERACTIVITY_PATH, ""):
            self._send(Reply(404, {"ok": False, "error": "not_found"}))
            return
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self._send(service.refuse("malformed_payload", 411, "Content-Length required"))
            return
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the body is never read
            self._send(service.refuse("oversized_body", 413, f"the body is {length} "
                                      f"bytes; at most {MAX_BODY_BYTES}"))
            return
        body = self.rfile.read(length)
        try:
            reply = service.handle(dict(self.headers.items()), body)
        except Exception as exc:  # noqa: BLE001 - never resume on an unexpected error
            log.exception("approvals: unexpected error")
            reply = service.refuse("internal_error", 500, f"{type(exc).__name__}: {exc}")
        self._send(reply)

    def _send(self, reply: Reply) -> None:
        payload = json.dumps(reply.body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def build_service(settings: Any, *, audit_path: Path | None) -> ApprovalService:
    """The service from settings: the ledger in S3, Prefect, Slack (built at the edge)."""
    if settings.slack_signing_secret is None:
        raise UsageError("approvals serve needs the Slack signing secret",
                         hint="set MODELSHIP_SLACK_SIGNING_SECRET, or run `modelship stack "
                         "up` (it generates one per stack)")
    clients = build_clients(settings)
    if clients.storage is None:
        raise UsageError("approvals serve needs the S3 ledger (the release records)",
                         hint="set MODELSHIP_S3_ENDPOINT or run `modelship stack up`")
    slack = None
    if settings.slack_api_url and settings.slack_token is not None:
        slack = SlackClient(settings.slack_api_url,
                            settings.slack_token.get_secret_value(),
                            timeout_s=settings.http_timeout_s)
    return ApprovalService(secret=settings.slack_signing_secret.get_secret_value(),
                           ledger=Ledger(clients.storage),
                           runs=PrefectRuns(settings.prefect_api_url), slack=slack,
                           audit_path=audit_path)


def serve(service: ApprovalService, *, host: str, port: int,
          ready: Callable[[str], None], stop: threading.Event) -> None:
    """Serve until ``stop`` is set; ``ready`` receives the interactivity URL."""
    server = ApprovalsServer((host, port), service)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name="approvals", daemon=True)
    thread.start()
    ready(server.url)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


__all__ = ["ApprovalService", "ApprovalsServer", "Click", "PrefectRuns", "Reply",
           "build_service", "parse_click", "serve"]
