"""Approvals, pure parts: who may decide, what a click carries, how it is signed and parsed,
and the endpoint's replay and double-click handling (in process, no network)."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlencode

import pytest
from slack_sdk.signature import SignatureVerifier

from modelship.approvals.rules import check_decision, pending_entry, resolve_approvers
from modelship.approvals.server import ApprovalService, parse_click
from modelship.approvals.wire import (
    APPROVE,
    REJECT,
    block_actions_payload,
    button_value,
    parse_button_value,
    sign,
    signed_request,
)
from modelship.ledger import ReleaseRecord
from modelship.slack import blocks

NOW = 1_800_000_000.0
DIGEST = {"model": "fraud", "version": 7, "onnx_sha256": "ab" * 32,
          "canary_report_id": "R1"}
PENDING = {"kind": "request", "status": "pending", "release_id": "R1", "flow_run_id": "F",
           "digest": DIGEST, "approvers": ["U1", "S1"], "requester": "U9",
           "expires_at": NOW + 60}


@pytest.mark.parametrize(("pending", "decision", "user", "release", "digest", "code"), [
    (PENDING, "approve", "U1", "R1", DIGEST, "ok"),
    (PENDING, "approve", "U2", "R1", DIGEST, "ok"),  # through group S1
    (PENDING, "reject", "U1", "R1", DIGEST, "ok"),
    (PENDING, "reject", "U9", "R1", DIGEST, "ok"),  # the requester may withdraw
    (PENDING, "approve", "U9", "R1", DIGEST, "requester_cannot_approve"),
    ({**PENDING, "approvers": ["U9"]}, "approve", "U9", "R1", DIGEST,
     "requester_cannot_approve"),  # four-eyes even when listed as an approver
    (PENDING, "approve", "U3", "R1", DIGEST, "not_an_approver"),
    (PENDING, "reject", "U3", "R1", DIGEST, "not_an_approver"),
    (PENDING, "approve", "U1", "R1", {**DIGEST, "canary_report_id": "R0"}, "stale_digest"),
    (PENDING, "approve", "U1", "R1", {**DIGEST, "onnx_sha256": "cd" * 32}, "stale_digest"),
    (PENDING, "approve", "U1", "R1", {**DIGEST, "version": 6}, "stale_digest"),
    (PENDING, "approve", "U1", "R2", DIGEST, "no_pending_approval"),
    (None, "approve", "U1", "R1", DIGEST, "no_pending_approval"),
    ({**PENDING, "status": "approved"}, "approve", "U1", "R1", DIGEST, "already_decided"),
    ({**PENDING, "expires_at": NOW}, "approve", "U1", "R1", DIGEST, "expired"),
    (PENDING, "merge", "U1", "R1", DIGEST, "malformed_payload"),
])
def test_check_decision(pending: dict[str, Any] | None, decision: str, user: str,
                        release: str, digest: dict[str, Any], code: str) -> None:
    allowed, _ = resolve_approvers(PENDING["approvers"], {"S1": ["U2"]}.__getitem__)
    verdict = check_decision(pending, decision=decision, user=user, release_id=release,
                             digest=digest, allowed=allowed, now=NOW)
    assert verdict.code == code
    assert verdict.ok == (code == "ok")
    assert verdict.status == {"ok": 200, "malformed_payload": 400, "not_an_approver": 403,
                              "requester_cannot_approve": 403}.get(code, 409)


def test_an_unresolvable_group_grants_nobody() -> None:
    def down(group: str) -> list[str]:
        raise ConnectionError("slack is down")

    assert resolve_approvers(["U1", "S1"], down) == ({"U1"}, ["S1"])
    assert resolve_approvers(["S1"], None) == (set(), ["S1"])


def test_button_value_round_trips_and_binds_only_the_digest_fields() -> None:
    value = button_value("R1", {**DIGEST, "manifest_sha256": "x"})
    assert parse_button_value(value) == ("R1", DIGEST)
    with pytest.raises(ValueError):
        parse_button_value(json.dumps({"release_id": 1}))


def test_signed_request_verifies_with_slacks_verifier_and_not_when_changed() -> None:
    payload = block_actions_payload(user_id="U1", user_name="alice", action_id=APPROVE,
                                    value=button_value("R1", DIGEST), channel="C1",
                                    message_ts="1.2")
    body, headers = signed_request("s3cret", payload)
    verifier = SignatureVerifier("s3cret")
    assert verifier.is_valid_request(body, headers)
    assert not verifier.is_valid_request(body + b"x", headers)
    assert not SignatureVerifier("other").is_valid_request(body, headers)
    click = parse_click(body)
    assert (click.decision, click.user, click.release_id, click.digest) == (
        "approve", "U1", "R1", DIGEST)


def _form(payload: Any) -> bytes:
    return urlencode({"payload": payload if isinstance(payload, str)
                      else json.dumps(payload)}).encode()


GOOD = block_actions_payload(user_id="U1", user_name="a", action_id=REJECT,
                             value=button_value("R1", DIGEST), channel="C", message_ts="1")


@pytest.mark.parametrize("body", [
    b"", b"\xff\xfe", b"payload=%7B", _form("[]"), _form({**GOOD, "type": "view_submission"}),
    _form({**GOOD, "actions": []}), _form({**GOOD, "actions": GOOD["actions"] * 2}),
    _form({**GOOD, "user": {}}), _form({**GOOD, "actions": [{**GOOD["actions"][0],
                                                            "action_id": "delete"}]}),
    _form({**GOOD, "actions": [{**GOOD["actions"][0], "value": "{}"}]}),
    b"payload=1&payload=2",
])
def test_parse_click_refuses_anything_but_one_approval_click(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_click(body)


class _Ledger:
    def __init__(self, record: ReleaseRecord) -> None:
        self.record = record

    def read(self, model: str, release_id: str) -> ReleaseRecord:
        assert (model, release_id) == (self.record.model, self.record.id)
        return self.record


class _Runs:
    """Prefect as the endpoint sees it: a run that stays paused; resumes are counted."""

    def __init__(self) -> None:
        self.resumed: list[dict[str, Any]] = []

    def state(self, flow_run_id: str) -> str:
        return "PAUSED"

    def resume(self, flow_run_id: str, run_input: dict[str, Any]) -> None:
        self.resumed.append(run_input)


def _service() -> tuple[ApprovalService, _Runs]:
    record = ReleaseRecord(id="R1", kind="promote", model="fraud")
    record.approvals.append({**PENDING, "expires_at": time.time() + 60, "approvers": ["U1"]})
    runs = _Runs()
    return ApprovalService(secret="s3cret", ledger=_Ledger(record),  # type: ignore[arg-type]
                           runs=runs), runs


def test_the_endpoint_resumes_once_for_a_replay_and_a_double_click() -> None:
    service, runs = _service()
    click = block_actions_payload(user_id="U1", user_name="a", action_id=APPROVE,
                                  value=button_value("R1", DIGEST), channel="C",
                                  message_ts="1")
    body, headers = signed_request("s3cret", click)
    first = service.handle(headers, body)
    assert (first.status, first.body["status"]) == (200, "approved")
    replay = service.handle(headers, body)
    assert (replay.status, replay.body["error"]) == (409, "replayed")
    again = service.handle(*reversed(signed_request("s3cret", click, timestamp=int(
        time.time()) - 1)))
    assert (again.status, again.body.get("idempotent")) == (200, True)
    assert len(runs.resumed) == 1 and runs.resumed[0]["user"] == "U1"


def test_the_endpoint_checks_the_signature_before_anything_else() -> None:
    service, runs = _service()
    body = _form(GOOD)
    ts = int(time.time())
    cases = [({}, 401, "missing_signature"),
             ({"X-Slack-Request-Timestamp": str(ts), "X-Slack-Signature": "v0=00"}, 401,
              "bad_signature"),
             ({"X-Slack-Request-Timestamp": str(ts - 301),
               "X-Slack-Signature": sign("s3cret", ts - 301, body)}, 401, "stale_timestamp"),
             ({"X-Slack-Request-Timestamp": "soon", "X-Slack-Signature": "v0=00"}, 401,
              "stale_timestamp")]
    for headers, status, code in cases:
        reply = service.handle(headers, body)
        assert (reply.status, reply.body["error"]) == (status, code)
    big = b"payload=" + b"x" * 70_000
    reply = service.handle({"X-Slack-Request-Timestamp": str(ts),
                            "X-Slack-Signature": sign("s3cret", ts, big)}, big)
    assert (reply.status, reply.body["error"]) == (413, "oversized_body")
    assert runs.resumed == []


def test_approval_blocks_carry_the_buttons_and_the_outcome_replaces_them() -> None:
    request = {**PENDING, "expires_at_iso": "2027-01-15T08:00:00+00:00"}
    record = {"from_version": 6, "gates": {"verdict": "passed", "baseline": 6, "results": [
        {"rule": "p99", "verdict": "passed", "message": "p99 +2% <= +10%"}]}}
    shown = blocks.approval_blocks(request, record, file_id="F1")
    buttons = [e for b in shown if b["type"] == "actions" for e in b["elements"]]
    assert [b["action_id"] for b in buttons] == [APPROVE, REJECT]
    assert [parse_button_value(b["value"]) for b in buttons] == [("R1", DIGEST)] * 2
    assert {"type": "image", "slack_file": {"id": "F1"}}.items() <= next(
        b for b in shown if b["type"] == "image").items()
    assert "p99 +2% <= +10%" in json.dumps(shown)
    done = blocks.approval_outcome_blocks({**request, "status": "approved"}, record,
                                          outcome="Approved by <@U1>")
    assert not [b for b in done if b["type"] == "actions"]
    assert "Approved by <@U1>" in json.dumps(done)


def test_notices_are_quiet_for_info_and_loud_for_failures() -> None:
    assert blocks.notice_blocks("still waiting", "info")[0]["type"] == "context"
    loud = blocks.notice_blocks("the watcher rejected it", "critical")[0]
    assert loud["type"] == "section" and "CRITICAL" in loud["text"]["text"]


def test_pending_entry_is_the_newest_request() -> None:
    approvals = [{"kind": "request", "release_id": "A"}, {"kind": "decision"},
                 {"kind": "request", "release_id": "B"}, {"kind": "decision"}]
    assert pending_entry(approvals) == {"kind": "request", "release_id": "B"}
    assert pending_entry([]) is None


def _scrape(success: int, failure: int) -> Any:
    from modelship.triton.metrics import parse_metrics

    labels = 'model="m",version="1"'
    return parse_metrics(f"nv_inference_request_success{{{labels}}} {success}\n"
                         f'nv_inference_request_failure{{{labels},reason="X"}} {failure}\n')


@pytest.mark.parametrize(("before", "after", "breach"), [
    (None, (100, 50), False),  # the first look has nothing to compare
    ((100, 0), (110, 9), True),  # 9 of 19 at a 1% budget: few requests, certain evidence
    ((100, 0), (1090, 10), False),  # exactly 1%
    ((100, 0), (1089, 11), False),  # 1.1%: above, but not with always-valid evidence
    ((100, 0), (1060, 40), True),  # 4% of 1000
    ((1000, 10), (50, 40), True),  # counters reset by a reload: the after values count
    ((100, 0), (100, 0), False),  # no traffic is no breach
])
def test_error_rate_breach(before: tuple[int, int] | None, after: tuple[int, int],
                           breach: bool) -> None:
    """Production's error rule during the wait is the bake's e-process (H0: rate ≤ the
    budget), so it can look at every scrape without a "twice in a row" crutch."""
    from tasks.approve import error_rate_breach

    found = error_rate_breach(_scrape(*before) if before else None, _scrape(*after),
                              model="m", version=1, max_rate=0.01, where="triton-0")
    assert (found is not None) == breach
    if found:
        assert "on triton-0: production m v1 failed" in found and "1/α = 100" in found


@pytest.mark.parametrize(("in_file", "override", "ok"), [
    ("http://127.0.0.1:4100/slack/interactivity", None, True),
    ("http://127.0.0.1:4100/slack/interactivity", "https://approvals.example.com/slack/x",
     False),  # settings point at a real endpoint: never click for a human there
    ("http://approvals.example.com/slack/interactivity", None, False),  # not loopback
    (None, "http://127.0.0.1:4100/slack/interactivity", False),  # no embedded stack here
])
def test_the_local_click_helper_works_only_on_the_embedded_stack(
        tmp_path: Any, in_file: str | None, override: str | None, ok: bool) -> None:
    from modelship.approvals.click import embedded_only
    from modelship.errors import UsageError
    from modelship.settings import Settings

    if in_file is not None:
        (tmp_path / "stack.json").write_text(json.dumps({
            "approvals_url": in_file, "slack_signing_secret": "s"}))
    extra = {"approvals_url": override} if override else {}
    settings = Settings(home=tmp_path, **extra)
    if ok:
        assert embedded_only(settings) == in_file
    else:
        with pytest.raises(UsageError, match="approvals click"):
            embedded_only(settings)
