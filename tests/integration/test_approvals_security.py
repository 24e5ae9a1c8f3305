"""The stack's approvals endpoint against forged, stale, replayed and unauthorized clicks.

A real Prefect flow run pauses with ``pause_flow_run(wait_for_input=ApprovalInput)`` on the
session stack's Prefect server; its pending approval sits in a release record in the
stack's S3 ledger. Every click goes over HTTP to the stack's ``approvals serve`` process.
Each refused click must answer the right HTTP status, leave the run PAUSED (0 resumes) and
leave one ``approval_refused`` line with its code in the audit log. Then a valid approver's
click (a member of the approvers' user group) resumes the run within 2 s.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.context import FlowRunContext
from prefect.flow_runs import pause_flow_run

from modelship.approvals.click import send
from modelship.approvals.rules import ApprovalInput
from modelship.approvals.server import PrefectRuns
from modelship.approvals.wire import (
    APPROVE,
    block_actions_payload,
    button_value,
    signed_request,
)
from modelship.clients import build_clients
from modelship.ledger import Ledger, ReleaseRecord
from modelship.prefect_api import pointed_at
from modelship.settings import Settings

MODEL = "approvals-security"
APPROVERS = ["U0ALICE", "S0APPROVERS"]  # alice, and the group of alice and bob
REQUESTER = "U0CAROL"


#: What the flows below tell the test (flow parameters are copied, so they carry a key).
BOXES: dict[str, dict[str, Any]] = {}


@flow(name="approval-probe")
def waiting_flow(key: str, timeout_s: int) -> dict[str, Any]:
    """Pause for an ApprovalInput, as the promote flow does, and return what came."""
    box = BOXES[key]
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None
    box["id"] = str(context.flow_run.id)
    got = pause_flow_run(wait_for_input=ApprovalInput, timeout=timeout_s, poll_interval=1,
                         key="probe")
    box["resumed_at"] = time.monotonic()
    return got.model_dump()


@flow(name="approval-done")
def finished_flow(key: str) -> None:
    box = BOXES[key]
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None
    box["id"] = str(context.flow_run.id)


def _in_thread(target: Any, box: dict[str, Any], api: str, *args: Any) -> threading.Thread:
    key = uuid.uuid4().hex
    BOXES[key] = box

    def run() -> None:
        with pointed_at(api):
            try:
                box["result"] = target(key, *args)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                box["error"] = exc

    context = contextvars.copy_context()
    thread = threading.Thread(target=lambda: context.run(run), daemon=True)
    thread.start()
    return thread


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _record(ledger: Ledger, run_id: str, *, release_id: str) -> ReleaseRecord:
    record = ReleaseRecord.start("promote", MODEL, requester=REQUESTER)
    record.id = release_id
    record.to_version = 2
    record.candidate = {"model": MODEL, "version": 2, "onnx_sha256": "ab" * 32,
                        "manifest_sha256": "cd" * 32, "canary_report_id": release_id}
    record.approvals.append({
        "kind": "request", "status": "pending", "release_id": release_id,
        "flow_run_id": run_id, "digest": {k: record.candidate[k] for k in (
            "model", "version", "onnx_sha256", "canary_report_id")},
        "approvers": APPROVERS, "requester": REQUESTER, "expires_at": time.time() + 600,
        "slack": {}, "refusals": []})
    ledger.write(record)
    return record


@pytest.fixture(scope="module")
def stack(stack_settings: Settings) -> Iterator[dict[str, Any]]:
    clients = build_clients(stack_settings)
    assert clients.storage is not None
    yield {"settings": stack_settings, "ledger": Ledger(clients.storage),
           "url": str(stack_settings.approvals_url),
           "secret": stack_settings.slack_signing_secret.get_secret_value()  # type: ignore[union-attr]
           if stack_settings.slack_signing_secret else "",
           "audit": Path(stack_settings.home) / "logs" / "approvals-audit.jsonl",
           "runs": PrefectRuns(stack_settings.prefect_api_url)}
    clients.close()


def _click(record: ReleaseRecord, user: str, *, action: str = APPROVE,
           digest: dict[str, Any] | None = None) -> dict[str, Any]:
    pending = record.approvals[-1]
    return block_actions_payload(
        user_id=user, user_name=user, action_id=action,
        value=button_value(record.id, digest or pending["digest"]), channel="#releases",
        message_ts="1.000001")


def _audit(path: Path, release_id: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in lines if release_id is None or e.get("release_id") == release_id]


def _post_raw(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    return send(url, body, headers, timeout_s=10)


def test_forged_stale_replayed_and_unauthorized_clicks_resume_nothing(
        stack: dict[str, Any]) -> None:
    settings: Settings = stack["settings"]
    api = str(settings.prefect_api_url)
    url, secret, audit, runs = stack["url"], stack["secret"], stack["audit"], stack["runs"]
    ledger: Ledger = stack["ledger"]

    box: dict[str, Any] = {}
    thread = _in_thread(waiting_flow, box, api, 120)
    _wait_for(lambda: "id" in box and runs.state(box["id"]) == "PAUSED", 60, "the pause")
    release_id = f"sec-{uuid.uuid4().hex[:8]}"
    record = _record(ledger, box["id"], release_id=release_id)

    done: dict[str, Any] = {}
    _in_thread(finished_flow, done, api).join(60)
    finished = _record(ledger, done["id"], release_id=f"{release_id}-done")

    valid_body, valid_headers = signed_request(secret, _click(record, "U0ALICE"))
    stale_ts = int(time.time()) - 600
    newer_digest = {**record.approvals[-1]["digest"], "canary_report_id": "a-newer-canary"}
    cases: list[tuple[str, bytes, dict[str, str], int, str]] = [
        ("forged signature", *signed_request("not-the-secret", _click(record, "U0ALICE")),
         401, "bad_signature"),
        ("missing headers", valid_body, {"Content-Type": valid_headers["Content-Type"]},
         401, "missing_signature"),
        ("stale timestamp", *signed_request(secret, _click(record, "U0ALICE"),
                                            timestamp=stale_ts), 401, "stale_timestamp"),
        ("unauthorized user", *signed_request(secret, _click(record, "U0MALLORY")),
         403, "not_an_approver"),
        ("requester approves", *signed_request(secret, _click(record, REQUESTER)),
         403, "requester_cannot_approve"),
        ("older digest", *signed_request(secret, _click(record, "U0ALICE",
                                                        digest=newer_digest)),
         409, "stale_digest"),
        ("run not paused", *signed_request(secret, _click(finished, "U0ALICE")),
         409, "not_paused"),
        ("malformed payload", *_signed_text(secret, b"payload=%7Bnot-json"),
         400, "malformed_payload"),
        ("oversized body", *_signed_text(secret, b"payload=" + b"x" * (100 * 1024)),
         413, "oversized_body"),
    ]
    try:
        for name, body, headers, status, code in cases:
            before = len(_audit(audit))
            got, answer = _post_raw(url, body, headers)
            assert got == status, (name, got, answer)
            assert answer.get("error") == code, (name, answer)
            assert runs.state(box["id"]) == "PAUSED", f"{name} resumed the run"
            logged = _audit(audit)[before:]
            assert any(e["event"] == "approval_refused" and e["code"] == code
                       for e in logged), (name, logged)

        # the refused clicker is told why, only to them
        ephemeral = _get(f"{settings.slack_api_url}_emulator/ephemeral")["messages"]
        assert any(m["user"] == "U0MALLORY" and "not an approver" in m["text"]
                   for m in ephemeral)

        # bob approves: a member of the approvers' user group, resolved through Slack
        sent = time.monotonic()
        body, headers = signed_request(secret, _click(record, "U0BOB"))
        got, answer = _post_raw(url, body, headers)
        assert (got, answer.get("status"), answer.get("by")) == (200, "approved", "U0BOB")
        thread.join(10)
        assert "error" not in box, box.get("error")
        # resumed by the click at a 1-s poll of the pause, not by its 120-s timeout: ~1-2 s
        # idle, with room (x3) for a loaded machine's Prefect calls and thread switches
        assert box["resumed_at"] - sent < 6.0
        assert box["result"]["decision"] == "approve" and box["result"]["user"] == "U0BOB"
        assert box["result"]["digest"] == record.approvals[-1]["digest"]

        # a replay of that exact request, and a double click: no second resume
        before = len(_audit(audit))
        got, answer = _post_raw(url, body, headers)
        assert (got, answer.get("error")) == (409, "replayed")
        assert any(e.get("code") == "replayed" for e in _audit(audit)[before:])
        body, headers = signed_request(secret, _click(record, "U0ALICE"))
        got, answer = _post_raw(url, body, headers)
        assert (got, answer.get("idempotent"), answer.get("by")) == (200, True, "U0BOB")
        accepted = [e for e in _audit(audit, release_id) if e["event"] == "approval_accepted"]
        assert len(accepted) == 1
    finally:
        if thread.is_alive():  # never leave a paused run behind
            runs.resume(box["id"], {"decision": "reject", "user": "cleanup",
                                    "release_id": release_id, "digest": {}})
            thread.join(10)


def _signed_text(secret: str, body: bytes) -> tuple[bytes, dict[str, str]]:
    from modelship.approvals.wire import sign

    ts = int(time.time())
    return body, {"Content-Type": "application/x-www-form-urlencoded",
                  "X-Slack-Request-Timestamp": str(ts),
                  "X-Slack-Signature": sign(secret, ts, body)}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_a_restarted_endpoint_finds_the_pending_approval_in_the_ledger(
        stack: dict[str, Any], tmp_path: Path) -> None:
    from modelship.approvals.server import ApprovalService, ApprovalsServer

    settings: Settings = stack["settings"]
    runs, ledger, secret = stack["runs"], stack["ledger"], stack["secret"]
    box: dict[str, Any] = {}
    thread = _in_thread(waiting_flow, box, str(settings.prefect_api_url), 120)
    _wait_for(lambda: "id" in box and runs.state(box["id"]) == "PAUSED", 60, "the pause")
    record = _record(ledger, box["id"], release_id=f"restart-{uuid.uuid4().hex[:8]}")
    audit = tmp_path / "audit.jsonl"

    def serve_once(user: str) -> tuple[int, dict[str, Any]]:
        """A fresh endpoint process (nothing in memory), one click, then it stops."""
        service = ApprovalService(secret=secret, ledger=ledger, runs=runs, audit_path=audit)
        server = ApprovalsServer(("127.0.0.1", 0), service)
        serving = threading.Thread(target=server.serve_forever, daemon=True)
        serving.start()
        try:
            return _post_raw(server.url, *signed_request(secret, _click(record, user)))
        finally:
            server.shutdown()
            server.server_close()

    try:
        assert serve_once("U0MALLORY")[0] == 403
        status, answer = serve_once("U0ALICE")
        assert (status, answer.get("status")) == (200, "approved")
        thread.join(10)
        assert box["result"]["user"] == "U0ALICE"
    finally:
        if thread.is_alive():
            runs.resume(box["id"], {"decision": "reject", "user": "cleanup",
                                    "release_id": record.id, "digest": {}})
            thread.join(10)
    events = [e["event"] for e in _audit(audit, record.id)]
    assert events == ["approval_refused", "approval_accepted"]
