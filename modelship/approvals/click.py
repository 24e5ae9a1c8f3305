"""A click sent as Slack sends it: for the demo, for trying approvals by hand, for tests.

Only against the embedded stack: it signs with the stack's own secret and refuses any
``approvals_url`` that is not on loopback, so it can never stand in for a human on a real
Slack workspace.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from modelship.approvals.rules import pending_entry
from modelship.approvals.server import NotPaused, PrefectRuns
from modelship.approvals.wire import (
    APPROVE,
    REJECT,
    block_actions_payload,
    button_value,
    signed_request,
)
from modelship.clients import build_clients
from modelship.errors import InfrastructureError, Unreachable, UsageError
from modelship.ledger import LEDGER_PREFIX, Ledger, ReleaseRecord

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def find_release(ledger: Ledger, release_id: str) -> ReleaseRecord:
    """The record of ``release_id``, whatever its model (the ledger is keyed by model)."""
    suffix = f"/{release_id}.json"
    for key in ledger.storage.list_keys(f"{LEDGER_PREFIX}/"):
        if key.endswith(suffix):
            model = key[len(LEDGER_PREFIX) + 1:-len(suffix)]
            return ledger.read(model, release_id)
    raise UsageError(f"no release {release_id} is on record",
                     hint="`modelship history MODEL` lists the release ids")


def embedded_only(settings: Any) -> str:
    """The approvals URL, if and only if it belongs to the embedded stack on this machine."""
    url = settings.approvals_url
    if not settings.stack_file.is_file() or not url:
        raise UsageError("`approvals click` works only on the embedded stack",
                         hint="run `modelship stack up`; on real Slack, click the button")
    state = json.loads(settings.stack_file.read_text())
    if state.get("approvals_url") != url or urlsplit(url).hostname not in LOOPBACK_HOSTS:
        raise UsageError(f"`approvals click` refuses {url}: it is not the embedded stack's "
                         "loopback endpoint", hint="on real Slack, click the button")
    if settings.slack_signing_secret is None:
        raise UsageError("the stack has no Slack signing secret",
                         hint="run `modelship stack down` then `modelship stack up`")
    return str(url)


def click_body(record: ReleaseRecord, *, user: str, approve: bool, secret: str,
               timestamp: int | None = None) -> tuple[bytes, dict[str, str]]:
    """The signed interactivity request for a click on ``record``'s approval message."""
    pending = pending_entry(record.approvals)
    if pending is None:
        raise UsageError(f"release {record.id} never asked for an approval",
                         hint="promote with --require-approval --approvers U1,U2")
    slack_at = pending.get("slack") or {}
    payload = block_actions_payload(
        user_id=user, user_name=user, action_id=APPROVE if approve else REJECT,
        value=button_value(record.id, pending["digest"]),
        channel=str(slack_at.get("channel") or "#releases"),
        message_ts=str(slack_at.get("ts") or "0"))
    return signed_request(secret, payload, timestamp=timestamp)


def send(url: str, body: bytes, headers: dict[str, str], *, timeout_s: float
         ) -> tuple[int, dict[str, Any]]:
    """POST a click; returns the HTTP status and the JSON answer (refusals included)."""
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            answer = json.loads(exc.read() or b"{}")
        except ValueError:
            answer = {}
        return exc.code, answer
    except OSError as exc:
        raise Unreachable(f"the approvals endpoint {url} did not answer: {exc}",
                          hint="is the stack up? `modelship stack status`") from exc


def click(settings: Any, release_id: str, *, user: str, approve: bool) -> dict[str, Any]:
    """Click Approve or Reject on a release's approval message, as ``user``."""
    url = embedded_only(settings)
    clients = build_clients(settings)
    if clients.storage is None:
        raise InfrastructureError("the stack has no S3 ledger", hint="`modelship stack up`")
    record = find_release(Ledger(clients.storage), release_id)
    body, headers = click_body(record, user=user, approve=approve,
                               secret=settings.slack_signing_secret.get_secret_value())
    status, answer = send(url, body, headers, timeout_s=settings.http_timeout_s)
    return {"release_id": release_id, "model": record.model, "user": user,
            "decision": "approve" if approve else "reject", "http_status": status,
            **answer}


def approve_when_asked(settings: Any, model: str, *, user: str, since: str,
                       stop: Any, timeout_s: float = 600.0) -> dict[str, Any]:
    """Wait for a release of ``model`` (started after ``since``, a release id prefix) to
    ask for approval, then click Approve as ``user``. For the demo, in a thread.

    Returns the endpoint's answer, or ``{"ok": False, "error": "not_asked"}``.
    """
    url = embedded_only(settings)
    clients = build_clients(settings)
    if clients.storage is None:
        raise InfrastructureError("the stack has no S3 ledger", hint="`modelship stack up`")
    ledger = Ledger(clients.storage)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        for record in ledger.records(model):
            pending = pending_entry(record.approvals)
            if record.id >= since and pending is not None and pending.get("status") == \
                    "pending" and (pending.get("slack") or {}).get("ts"):
                body, headers = click_body(
                    record, user=user, approve=True,
                    secret=settings.slack_signing_secret.get_secret_value())
                status, answer = send(url, body, headers, timeout_s=settings.http_timeout_s)
                return {"release_id": record.id, "user": user, "http_status": status,
                        **answer}
        stop.wait(0.5)
    return {"ok": False, "error": "not_asked"}


def withdraw_pending(settings: Any, model: str, *, since: str, user: str,
                     reason: str) -> str | None:
    """Reject a release of ``model`` that waits for approval, as its requester, through
    the Prefect API (the fallback channel: the flow checks it like any input). For the
    demo, so that a failed click ends the release at once instead of at its expiry.

    Returns the release id it withdrew, or None.
    """
    clients = build_clients(settings)
    if clients.storage is None:
        return None
    for record in Ledger(clients.storage).records(model):
        pending = pending_entry(record.approvals)
        if record.id >= since and pending is not None and pending.get("status") == "pending":
            try:
                PrefectRuns(settings.prefect_api_url).resume(str(pending["flow_run_id"]), {
                    "decision": "reject", "user": user, "release_id": record.id,
                    "digest": pending["digest"], "channel": "prefect-api",
                    "reason": reason})
            except NotPaused:
                return None
            return record.id
    return None
