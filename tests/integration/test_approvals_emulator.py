"""The Slack emulator's approval parts: user groups, response_url, the web view, and the
clicks it sends to the approvals endpoint, checked by a receiver with Slack's own verifier.

The emulator is its own process (as in the stack); the receiver is a plain HTTP server in
the test, so the only link between them is the signed request on the wire.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import pytest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.signature import SignatureVerifier

from modelship.approvals.wire import APPROVE, button_value
from modelship.slack.emulator import SIGNING_SECRET_ENV
from tests.integration.test_slack_emulator import Emulator, start_emulator, stop_emulator

SECRET = "emulator-test-secret"
TOKEN = "xoxb-approvals-test"


class _Receiver(BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        valid = SignatureVerifier(SECRET).is_valid_request(body, dict(self.headers.items()))
        payload = json.loads(parse_qs(body.decode())["payload"][0])
        self.received.append({"valid": valid, "payload": payload,
                              "content_type": self.headers["Content-Type"]})
        answer = json.dumps({"ok": valid, "error": None if valid else "bad_signature"})
        self.send_response(200 if valid else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer.encode())


@pytest.fixture(scope="module")
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/slack/interactivity"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def emulator(receiver: str) -> Iterator[Emulator]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SIGNING_SECRET_ENV, SECRET)
        emu = start_emulator("--token", TOKEN, "--approvals-url", receiver)
    try:
        yield emu
    finally:
        stop_emulator(emu.proc)


def test_user_groups_resolve_through_the_web_api(emulator: Emulator) -> None:
    web = WebClient(token=TOKEN, base_url=emulator.api_url, timeout=5)
    assert web.usergroups_users_list(usergroup="S0APPROVERS")["users"] == ["U0ALICE", "U0BOB"]
    with pytest.raises(SlackApiError) as caught:
        web.usergroups_users_list(usergroup="S0NOBODY")
    assert caught.value.response["error"] == "no_such_subteam"
    assert {m["id"] for m in web.users_list()["members"]} >= {"U0ALICE", "U0MALLORY"}
    assert web.auth_test()["user_id"]


def test_a_web_view_click_is_signed_as_slack_signs_it(emulator: Emulator) -> None:
    web = WebClient(token=TOKEN, base_url=emulator.api_url, timeout=5)
    posted = web.chat_postMessage(channel="#clicks", text="approve?")
    value = button_value("R1", {"model": "m", "version": 2, "onnx_sha256": "ab" * 32,
                                "canary_report_id": "R1"})
    answer = emulator.post("/_emulator/click", json.dumps({
        "channel": "#clicks", "ts": posted["ts"], "action_id": APPROVE, "value": value,
        "user": "U0BOB"}).encode(), "application/json")
    assert answer == {"ok": True, "status": 200, "answer": {"ok": True, "error": None}}
    got = _Receiver.received[-1]
    assert got["valid"] and got["content_type"] == "application/x-www-form-urlencoded"
    payload = got["payload"]
    assert payload["type"] == "block_actions" and payload["user"]["id"] == "U0BOB"
    assert payload["actions"][0]["value"] == value
    assert payload["container"]["message_ts"] == posted["ts"]

    # the click's response_url: an ephemeral reply for the clicker, then the message replaced
    response_url = str(payload["response_url"])
    path = response_url.split("://", 1)[1].split("/", 1)[1]
    emulator.post(f"/{path}", json.dumps({"response_type": "ephemeral",
                                          "text": "you may not"}).encode(),
                  "application/json")
    ephemeral = emulator.get("/_emulator/ephemeral")["messages"]
    assert ephemeral[-1]["user"] == "U0BOB" and ephemeral[-1]["text"] == "you may not"
    emulator.post(f"/{path}", json.dumps({"replace_original": True,
                                          "text": "approved by bob"}).encode(),
                  "application/json")
    shown = [m for m in emulator.messages("#clicks") if m["ts"] == posted["ts"]][0]
    assert shown["text"] == "approved by bob" and shown["updated"]


def test_the_web_view_is_served_at_the_root(emulator: Emulator) -> None:
    page = emulator.get_bytes("/").decode()
    assert "<select id=\"user\">" in page and "/_emulator/click" in page
    users = emulator.get("/_emulator/users")
    assert users["usergroups"]["S0APPROVERS"]["users"] == ["U0ALICE", "U0BOB"]
