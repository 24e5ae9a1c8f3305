"""What travels between Slack and the approvals endpoint: button values and signed requests.

Pure functions with no heavy imports, so that the Slack emulator's web view (a separate
process, sharing no state with the endpoint) builds its clicks with exactly the bytes and
the signature Slack would send.

A button's value binds a click to one release and one candidate digest: the model, the
version, the ONNX sha256 and the canary report id. A click whose digest differs from the
candidate that waits now is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

#: The fields of a candidate digest a click is bound to.
DIGEST_KEYS = ("model", "version", "onnx_sha256", "canary_report_id")
#: The action ids of the approval message's two buttons.
APPROVE, REJECT = "approval_approve", "approval_reject"
ACTIONS = {APPROVE: "approve", REJECT: "reject"}
#: Slack refuses button values longer than this.
MAX_VALUE_CHARS = 2000
SIGNATURE_VERSION = "v0"


def approval_digest(candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The four fields of a release's candidate digest that a click is bound to."""
    return {key: candidate.get(key) for key in DIGEST_KEYS}


def button_value(release_id: str, digest: Mapping[str, Any]) -> str:
    """The JSON value of an Approve/Reject button (release id + candidate digest)."""
    value = json.dumps({"release_id": release_id, "digest": approval_digest(digest)},
                       sort_keys=True, separators=(",", ":"))
    if len(value) > MAX_VALUE_CHARS:
        raise ValueError(f"button value is {len(value)} characters; Slack allows "
                         f"{MAX_VALUE_CHARS}")
    return value


def parse_button_value(value: str) -> tuple[str, dict[str, Any]]:
    """``(release_id, digest)`` from a button value.

    Raises:
        ValueError: the value is not one :func:`button_value` made.
    """
    data = json.loads(value)
    if not isinstance(data, dict) or not isinstance(data.get("release_id"), str) \
            or not isinstance(data.get("digest"), dict):
        raise ValueError("button value has no release_id and digest")
    return data["release_id"], approval_digest(data["digest"])


def sign(secret: str, timestamp: int | str, body: bytes) -> str:
    """Slack's ``X-Slack-Signature``: ``v0=`` + HMAC-SHA256 of ``v0:{ts}:{body}``."""
    base = f"{SIGNATURE_VERSION}:{timestamp}:".encode() + body
    digest = hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()
    return f"{SIGNATURE_VERSION}={digest}"


def block_actions_payload(*, user_id: str, user_name: str, action_id: str, value: str,
                          channel: str, message_ts: str, response_url: str | None = None,
                          team_id: str = "T0MODELSHIP") -> dict[str, Any]:
    """A ``block_actions`` interactivity payload as Slack sends it for a button click."""
    return {
        "type": "block_actions",
        "team": {"id": team_id, "domain": "modelship"},
        "user": {"id": user_id, "username": user_name, "name": user_name,
                 "team_id": team_id},
        "api_app_id": "A0MODELSHIP",
        "container": {"type": "message", "message_ts": message_ts, "channel_id": channel,
                      "is_ephemeral": False},
        "channel": {"id": channel, "name": channel.lstrip("#")},
        "message": {"ts": message_ts, "type": "message"},
        "response_url": response_url,
        "trigger_id": f"{int(time.time())}.modelship",
        "actions": [{"type": "button", "action_id": action_id, "block_id": "approval",
                     "value": value, "action_ts": f"{time.time():.6f}"}],
    }


def signed_request(secret: str, payload: Mapping[str, Any], *,
                   timestamp: int | None = None) -> tuple[bytes, dict[str, str]]:
    """The body and headers of an interactivity POST, signed as Slack signs it.

    Slack sends ``application/x-www-form-urlencoded`` with one field, ``payload``, holding
    the JSON; the signature covers these raw bytes.
    """
    body = urlencode({"payload": json.dumps(payload)}).encode()
    ts = int(time.time()) if timestamp is None else timestamp
    return body, {"Content-Type": "application/x-www-form-urlencoded",
                  "X-Slack-Request-Timestamp": str(ts),
                  "X-Slack-Signature": sign(secret, ts, body)}
