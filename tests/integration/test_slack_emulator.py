"""The Slack emulator process, driven by the real slack_sdk WebClient and by SlackClient.

One emulator subprocess serves the module; each test uses its own channel so that tests do
not see each other's messages.
"""

from __future__ import annotations

import hashlib
import json
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from modelship.errors import InfrastructureError, Unreachable
from modelship.slack.client import SlackClient
from modelship.slack.notifier import NullNotifier, SlackNotifier
from tests.silent import closed_port, connections_made

pytestmark = pytest.mark.integration

TOKEN = "xoxb-modelship-test"
START_TIMEOUT_S = 15.0


@dataclass
class Emulator:
    """A running emulator process and where it listens."""

    proc: subprocess.Popen[str]
    url: str  # http://127.0.0.1:PORT

    @property
    def api_url(self) -> str:
        return f"{self.url}/api/"

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as resp:
            return json.load(resp)

    def get_bytes(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as resp:
            return bytes(resp.read())

    def post(self, path: str, body: bytes = b"", content_type: str = "") -> Any:
        headers = {"Content-Type": content_type} if content_type else {}
        req = urllib.request.Request(f"{self.url}{path}", data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.load(resp)

    def messages(self, channel: str) -> list[dict[str, Any]]:
        return list(self.get("/_emulator/messages", channel=channel)["messages"])


def start_emulator(*extra: str) -> Emulator:
    """Start ``python -m modelship.slack.emulator`` on a free port and wait for its ready line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "modelship.slack.emulator", "--host", "127.0.0.1", "--port", "0",
         *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line:
        stop_emulator(proc)
        stderr = proc.stderr.read() if proc.stderr else ""
        raise RuntimeError(f"the Slack emulator did not start: {stderr}")
    return Emulator(proc=proc, url=json.loads(line)["url"])


def stop_emulator(proc: subprocess.Popen[str]) -> int:
    """SIGTERM, then SIGKILL if it lingers; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    return proc.returncode


@pytest.fixture(scope="module")
def emulator() -> Iterator[Emulator]:
    emu = start_emulator("--token", TOKEN)
    try:
        yield emu
    finally:
        stop_emulator(emu.proc)


@pytest.fixture
def channel(request: pytest.FixtureRequest) -> str:
    """A channel of the test's own, so module-shared state does not leak between tests."""
    return f"#{request.node.name}"


@pytest.fixture
def web(emulator: Emulator) -> WebClient:
    return WebClient(token=TOKEN, base_url=emulator.api_url, timeout=5)


@pytest.fixture
def slack(emulator: Emulator) -> SlackClient:
    return SlackClient(emulator.url, TOKEN, timeout_s=5)


APPROVAL_BLOCKS: list[dict[str, Any]] = [
    {"type": "section", "text": {"type": "mrkdwn", "text": "*fraud v7* passed the canary"}},
    {
        "type": "actions",
        "block_id": "approval",
        "elements": [
            {
                "type": "button",
                "action_id": "approve",
                "style": "primary",
                "text": {"type": "plain_text", "text": "Approve"},
                "value": json.dumps({"model": "fraud", "version": 7, "digest": "sha256:ab12"}),
            },
            {
                "type": "button",
                "action_id": "reject",
                "style": "danger",
                "text": {"type": "plain_text", "text": "Reject"},
                "value": json.dumps({"model": "fraud", "version": 7, "digest": "sha256:ab12"}),
            },
        ],
    },
]


def test_health(emulator: Emulator) -> None:
    assert emulator.get("/_emulator/health") == {"ok": True}


def test_post_message_round_trips_text_and_buttons(
    emulator: Emulator, web: WebClient, channel: str
) -> None:
    response = web.chat_postMessage(channel=channel, text="canary report", blocks=APPROVAL_BLOCKS)

    assert response["ok"] and response["channel"] == channel
    (msg,) = emulator.messages(channel)
    assert msg["ts"] == response["ts"]
    assert msg["text"] == "canary report"
    assert msg["blocks"] == APPROVAL_BLOCKS
    assert msg["thread_ts"] is None and msg["updated"] is False and msg["history"] == []
    calls = emulator.get("/_emulator/calls", method="chat.postMessage")["calls"]
    assert any(c["args"].get("channel") == channel for c in calls)
    assert all("token" not in c["args"] for c in calls)


def test_form_encoded_post_with_blocks_as_json_string(emulator: Emulator, channel: str) -> None:
    body = urllib.parse.urlencode(
        {"token": TOKEN, "channel": channel, "text": "form", "blocks": json.dumps(APPROVAL_BLOCKS)}
    ).encode()
    response = emulator.post(
        "/api/chat.postMessage", body, "application/x-www-form-urlencoded"
    )

    assert response["ok"], response
    (msg,) = emulator.messages(channel)
    assert msg["text"] == "form" and msg["blocks"] == APPROVAL_BLOCKS


def test_ts_are_unique_and_increasing(slack: SlackClient, channel: str) -> None:
    posted = [slack.post_message(channel, f"m{i}") for i in range(20)]
    ts = [float(p.ts) for p in posted]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)
    assert all(len(p.ts.split(".")[1]) == 6 for p in posted)


def test_update_changes_message_and_keeps_history(
    emulator: Emulator, slack: SlackClient, channel: str
) -> None:
    posted = slack.post_message(channel, "waiting for approval", blocks=APPROVAL_BLOCKS)
    decided = [{"type": "section", "text": {"type": "mrkdwn", "text": "Approved by <@U1>"}}]

    slack.update_message(channel, posted.ts, "approved", blocks=decided)

    (msg,) = emulator.messages(channel)
    assert msg["ts"] == posted.ts
    assert msg["text"] == "approved" and msg["blocks"] == decided
    assert msg["updated"] is True
    assert [(h["text"], h["blocks"]) for h in msg["history"]] == [
        ("waiting for approval", APPROVAL_BLOCKS)
    ]


def test_update_of_unknown_message_is_refused(slack: SlackClient, channel: str) -> None:
    with pytest.raises(InfrastructureError) as caught:
        slack.update_message(channel, "1.000001", "nope")
    assert caught.value.details["error"] == "message_not_found"


def test_thread_replies_reactions_and_ephemeral(
    emulator: Emulator, web: WebClient, slack: SlackClient, channel: str
) -> None:
    notifier = SlackNotifier(slack, channel)
    root = notifier.post("release fraud v7 started")
    assert root is not None
    reply = notifier.post("stage: export passed", thread_ts=root)
    web.reactions_add(channel=channel, timestamp=root, name="rocket")
    web.chat_postEphemeral(channel=channel, user="U123", text="only you can see this")

    thread = web.conversations_replies(channel=channel, ts=root)["messages"]
    assert [m["ts"] for m in thread] == [root, reply]
    assert thread[0]["reply_count"] == 1
    by_ts = {m["ts"]: m for m in emulator.messages(channel)}
    assert by_ts[reply]["thread_ts"] == root
    assert by_ts[root]["reactions"][0]["name"] == "rocket"
    ephemeral = emulator.get("/_emulator/ephemeral")["messages"]
    assert any(m["channel"] == channel and m["user"] == "U123" for m in ephemeral)


def test_reply_to_missing_thread_is_refused(slack: SlackClient, channel: str) -> None:
    with pytest.raises(InfrastructureError) as caught:
        slack.post_message(channel, "orphan", thread_ts="1.000001")
    assert caught.value.details["error"] == "thread_not_found"


def test_wrong_token_is_refused(emulator: Emulator, channel: str) -> None:
    web = WebClient(token="xoxb-wrong", base_url=emulator.api_url, timeout=5)
    with pytest.raises(SlackApiError) as raw:
        web.chat_postMessage(channel=channel, text="x")
    assert raw.value.response["error"] == "invalid_auth"

    wrong = SlackClient(emulator.url, "xoxb-wrong", timeout_s=5)
    with pytest.raises(InfrastructureError) as caught:
        wrong.ping()
    assert not isinstance(caught.value, Unreachable)
    assert caught.value.details["error"] == "invalid_auth"
    assert caught.value.hint and "token" in caught.value.hint
    with pytest.raises(InfrastructureError):
        wrong.post_message(channel, "x")

    assert emulator.messages(channel) == []
    refused = emulator.get("/_emulator/calls", method="auth.test")["calls"]
    assert any(c["error"] == "invalid_auth" for c in refused)


def test_missing_token_is_refused(emulator: Emulator) -> None:
    response = emulator.post("/api/auth.test")
    assert response == {"ok": False, "error": "invalid_auth"}


def test_unknown_method(emulator: Emulator, web: WebClient) -> None:
    with pytest.raises(SlackApiError) as raw:
        web.api_call("chat.doesNotExist")
    assert raw.value.response.status_code == 404
    assert raw.value.response["error"] == "unknown_method"


def test_ping_and_api_test(web: WebClient, slack: SlackClient) -> None:
    slack.ping()
    assert web.api_test(foo="bar")["args"] == {"foo": "bar"}
    with pytest.raises(SlackApiError):
        web.api_test(error="my_error")


def test_files_upload_v2_stores_bytes(emulator: Emulator, web: WebClient, channel: str) -> None:
    root = web.chat_postMessage(channel=channel, text="release thread")["ts"]
    data = bytes(range(256)) * 40  # binary, 10 KiB

    response = web.files_upload_v2(
        channel=channel, file=data, filename="canary.png", title="Canary", thread_ts=root
    )

    file_id = response["file"]["id"]
    listed = {f["id"]: f for f in emulator.get("/_emulator/files")["files"]}[file_id]
    assert listed["name"] == "canary.png" and listed["title"] == "Canary"
    assert listed["size"] == len(data)
    assert listed["sha256"] == hashlib.sha256(data).hexdigest()
    assert listed["channel"] == channel and listed["thread_ts"] == root
    assert emulator.get_bytes(f"/_emulator/files/{file_id}") == data


def test_slack_client_uploads_a_path(
    emulator: Emulator, slack: SlackClient, channel: str, tmp_path: Path
) -> None:
    plot = tmp_path / "latency.png"
    plot.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 1000)
    root = slack.post_message(channel, "release thread")

    file_id = slack.upload_file(channel, plot, "latency.png", thread_ts=root.ts)

    assert emulator.get_bytes(f"/_emulator/files/{file_id}") == plot.read_bytes()
    listed = {f["id"]: f for f in emulator.get("/_emulator/files")["files"]}[file_id]
    assert listed["thread_ts"] == root.ts


def test_ping_against_closed_port_is_unreachable_quickly() -> None:
    port = closed_port()
    timeout_s = 30.0  # never waited for: a refused connection fails at once
    client = SlackClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=timeout_s)

    started = time.monotonic()
    with pytest.raises(Unreachable) as caught:
        client.ping()

    assert time.monotonic() - started < timeout_s / 3  # far below it, loaded machine too
    assert f"127.0.0.1:{port}" in caught.value.message
    assert caught.value.details["transient"] is True


def test_ping_against_silent_server_honours_the_timeout() -> None:
    with socket.socket() as sock:  # listens (the kernel accepts) but never answers
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        port = sock.getsockname()[1]
        client = SlackClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=0.5)

        started = time.monotonic()
        with pytest.raises(Unreachable) as caught:
            client.ping()
        elapsed = time.monotonic() - started
        # one attempt that waited for the timeout: counted, not bounded in wall time
        assert connections_made(sock) == 1

    assert 0.4 < elapsed < 20 * 0.5  # the 0.5-s timeout, with room for a busy machine
    assert "0.5 s" in caught.value.message


def test_null_notifier_posts_nothing(emulator: Emulator, channel: str) -> None:
    before = len(emulator.get("/_emulator/calls")["calls"])

    assert NullNotifier().post("release started", blocks=APPROVAL_BLOCKS) is None

    assert len(emulator.get("/_emulator/calls")["calls"]) == before
    assert emulator.messages(channel) == []


def test_sigterm_exits_cleanly_and_state_file_survives_restart(tmp_path: Path) -> None:
    state_file = tmp_path / "slack.json"
    first = start_emulator("--state-file", str(state_file))
    try:
        web = WebClient(token="any", base_url=first.api_url, timeout=5)
        ts = web.chat_postMessage(channel="#persist", text="before restart")["ts"]
    finally:
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=10) == 0
        stop_emulator(first.proc)

    second = start_emulator("--state-file", str(state_file))
    try:
        (msg,) = second.messages("#persist")
        assert msg["ts"] == ts and msg["text"] == "before restart"
        web = WebClient(token="any", base_url=second.api_url, timeout=5)
        later = web.chat_postMessage(channel="#persist", text="after restart")["ts"]
        assert float(later) > float(ts)

        assert second.post("/_emulator/reset") == {"ok": True}
        assert second.messages("#persist") == []
        assert second.get("/_emulator/calls")["calls"] == []
    finally:
        assert stop_emulator(second.proc) == 0
