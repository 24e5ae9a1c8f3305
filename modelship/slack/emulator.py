"""A local stand-in for the part of the Slack Web API that modelship uses.

No Slack emulator exists on PyPI or npm, and the demo and the tests must show what users
would have seen without a network. This process speaks enough of the Web API for
``slack_sdk.WebClient(base_url="http://HOST:PORT/api/")`` and records everything it receives,
so tests read the messages back instead of trusting a mock.

Run it with::

    python -m modelship.slack.emulator --host 127.0.0.1 --port 0 [--token xoxb-...]
        [--state-file F]

It prints one JSON line on stdout once it listens (``{"event": "listening", "url": ...,
"api_url": ..., "pid": ...}``; ``--port 0`` picks a free port) and exits 0 on SIGTERM or
SIGINT.

Web API (POST or GET, ``application/x-www-form-urlencoded``, ``application/json`` or
``multipart/form-data``; the token comes as ``Authorization: Bearer`` or as ``token``):

- ``/api/auth.test``, ``/api/api.test`` (``error=X`` makes it fail with X)
- ``/api/chat.postMessage``, ``/api/chat.update``, ``/api/chat.postEphemeral``
- ``/api/conversations.replies``, ``/api/reactions.add``
- ``/api/usergroups.users.list``, ``/api/users.list`` (the people in :data:`USERS`)
- ``/api/files.getUploadURLExternal``, ``POST /upload/v1/<file_id>`` (the upload URL it hands
  out; no token, as on Slack), ``/api/files.completeUploadExternal``

Refusals are Slack's: HTTP 200 with ``{"ok": false, "error": CODE}``, except
``unknown_method`` (HTTP 404). A configured token that does not match gives ``invalid_auth``.
The emulator is stricter than Slack in one place on purpose: a ``thread_ts`` that names no
message gives ``thread_not_found``, so a lost thread root fails the test that caused it.

Introspection (no token; also served under ``/api/_emulator/...``):

- ``GET /_emulator/health`` -> ``{"ok": true}``
- ``GET /_emulator/messages[?channel=C]`` -> messages posted and updated, with their history
- ``GET /_emulator/ephemeral`` -> ephemeral messages
- ``GET /_emulator/calls[?method=M]`` -> every Web API call received, refused ones included
- ``GET /_emulator/files`` -> uploads; ``GET /_emulator/files/<id>`` -> the bytes
- ``POST /_emulator/reset`` -> forget everything (timestamps and ids keep increasing)
- ``GET /_emulator/users`` -> the people and user groups of the workspace

The web view (``GET /``) shows the channels and threads as a person sees them in Slack:
Block Kit sections, fields, images and buttons. A button clicked there goes through
``POST /_emulator/click``, which sends Slack's ``block_actions`` request, signed with the
stack's signing secret, to ``--approvals-url``, with a ``response_url`` back to the emulator
(``POST /_emulator/response/<id>``: an ephemeral reply, or the message replaced). The user
picked on the page plays the clicker.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import mimetypes
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from email.parser import BytesParser
from email.policy import HTTP
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

from modelship.approvals.wire import block_actions_payload, signed_request
from modelship.slack.emulator_view import WEB_VIEW_HTML

API_PREFIX = "/api/"
INTROSPECTION_PREFIX = "/_emulator"
UPLOAD_PREFIX = "/upload/v1/"

TEAM_ID = "T0MODELSHIP"
BOT_USER_ID = "U0MODELSHIP"
BOT_ID = "B0MODELSHIP"

#: The workspace's people, for the web view's "click as" picker and ``users.list``.
USERS = {"U0ALICE": "alice", "U0BOB": "bob", "U0CAROL": "carol", "U0MALLORY": "mallory"}
#: User groups (``usergroups.users.list``): approvers may be named by group.
USERGROUPS = {"S0APPROVERS": {"handle": "release-approvers", "users": ["U0ALICE", "U0BOB"]}}

MAX_BLOCKS = 50  # Slack's limit per message
MAX_TEXT_CHARS = 40_000  # Slack truncates beyond this; we refuse, so tests notice
MAX_BODY_BYTES = 64 * 1024 * 1024  # 64 MiB: more than any report plot
STATE_FILE_VERSION = 1

JsonDict = dict[str, Any]


class ApiError(Exception):
    """A Slack-style refusal, answered as ``{"ok": false, "error": code}``.

    Args:
        code: Slack's error code, e.g. ``message_not_found``.
        status: HTTP status; Slack answers most refusals with 200.
        detail: Optional ``response_metadata.messages`` line saying which argument is wrong.
    """

    def __init__(self, code: str, *, status: int = HTTPStatus.OK, detail: str | None = None):
        super().__init__(code)
        self.code = code
        self.status = status
        self.detail = detail

    def body(self) -> JsonDict:
        """The JSON body Slack would send."""
        out: JsonDict = {"ok": False, "error": self.code}
        if self.detail:
            out["response_metadata"] = {"messages": [f"[ERROR] {self.detail}"]}
        return out


# --------------------------------------------------------------------------- pure helpers


def format_ts(micros: int) -> str:
    """Slack's message id: epoch seconds, a dot and six digits of µs (``1732990000.000100``)."""
    return f"{micros // 1_000_000}.{micros % 1_000_000:06d}"


def parse_body(content_type: str, body: bytes) -> JsonDict:
    """Arguments from a request body, in any of the encodings slack_sdk sends.

    chat.* methods arrive as JSON, most others as form data; both are accepted everywhere.
    """
    if not body:
        return {}
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type == "application/json":
        try:
            parsed = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError("invalid_json", detail=str(exc)) from exc
        if not isinstance(parsed, dict):
            raise ApiError("invalid_json", detail="the body must be a JSON object")
        return parsed
    if media_type == "multipart/form-data":
        return {name: value for name, value, _ in _multipart_parts(content_type, body)}
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
    except UnicodeDecodeError as exc:
        raise ApiError("invalid_form_data", detail=str(exc)) from exc


def _multipart_parts(content_type: str, body: bytes) -> list[tuple[str, Any, bool]]:
    """``(name, value, is_file)`` for each part; file parts keep their bytes."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = BytesParser(policy=HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise ApiError("invalid_form_data", detail="malformed multipart body")
    parts: list[tuple[str, Any, bool]] = []
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if not isinstance(name, str) or not isinstance(payload, bytes):
            continue
        if part.get_filename() is not None:
            parts.append((name, payload, True))
        else:
            parts.append((name, payload.decode("utf-8", errors="replace"), False))
    return parts


def upload_payload(content_type: str, body: bytes) -> bytes:
    """The file bytes of an upload: the raw body, or the file part of a multipart form.

    slack_sdk posts the raw bytes (with urllib's default form content type), while other
    clients send multipart; both reach Slack's upload URL.
    """
    if content_type.split(";", 1)[0].strip().lower() == "multipart/form-data":
        for _, value, is_file in _multipart_parts(content_type, body):
            if is_file:
                return cast(bytes, value)
        raise ApiError("invalid_form_data", detail="no file part in the multipart body")
    return body


def parse_json_list(raw: Any, *, error: str, argument: str) -> list[Any] | None:
    """A list argument that may arrive as a JSON string (form data) or a list (JSON body)."""
    if raw is None or raw == "":
        return None
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ApiError(error, detail=f"{argument} is not valid JSON: {exc}") from exc
    if not isinstance(value, list):
        raise ApiError(error, detail=f"{argument} must be a JSON array")
    return value


def parse_blocks(raw: Any) -> list[JsonDict] | None:
    """Block Kit blocks, checked as far as Slack refuses them with ``invalid_blocks``."""
    blocks = parse_json_list(raw, error="invalid_blocks", argument="blocks")
    if blocks is None:
        return None
    if len(blocks) > MAX_BLOCKS:
        raise ApiError("invalid_blocks", detail=f"{len(blocks)} blocks; at most {MAX_BLOCKS}")
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError("invalid_blocks", detail=f"blocks[{i}] has no string 'type'")
    return cast(list[JsonDict], blocks)


def _text(args: Mapping[str, Any], name: str) -> str | None:
    """An optional string argument; empty counts as absent, as on Slack."""
    value = args.get(name)
    if value is None or value == "":
        return None
    return str(value)


def _required(args: Mapping[str, Any], name: str, error: str = "invalid_arguments") -> str:
    value = _text(args, name)
    if value is None:
        raise ApiError(error, detail=f"missing required field: {name}")
    return value


def _api_view(msg: JsonDict) -> JsonDict:
    """A stored message as Slack returns it in API responses."""
    out: JsonDict = {
        "type": "message",
        "user": BOT_USER_ID,
        "bot_id": BOT_ID,
        "ts": msg["ts"],
        "text": msg["text"] or "",
    }
    if msg["blocks"] is not None:
        out["blocks"] = msg["blocks"]
    if msg.get("attachments") is not None:
        out["attachments"] = msg["attachments"]
    if msg["thread_ts"] is not None:
        out["thread_ts"] = msg["thread_ts"]
    if msg["updated"]:
        out["edited"] = {"user": BOT_USER_ID, "ts": msg["updated_ts"]}
    if msg["reactions"]:
        out["reactions"] = msg["reactions"]
    return out


# --------------------------------------------------------------------------- state


class EmulatorState:
    """Everything the emulator knows, behind one lock; every Web API method lives here.

    Args:
        token: The bot token callers must present; ``None`` accepts any token.
        state_file: Where to keep the state across restarts (JSON, rewritten atomically after
            each change); ``None`` keeps it in memory only.
    """

    def __init__(self, *, token: str | None = None, state_file: Path | None = None) -> None:
        self._lock = threading.RLock()
        self._token = token
        self._state_file = state_file
        self._last_micros = 0
        self._file_seq = 0
        self._messages: list[JsonDict] = []
        self._index: dict[tuple[str, str], JsonDict] = {}
        self._ephemeral: list[JsonDict] = []
        self._calls: list[JsonDict] = []
        self._files: dict[str, JsonDict] = {}
        self._responses: dict[str, JsonDict] = {}
        self._methods: dict[str, Callable[[JsonDict, str], JsonDict]] = {
            "api.test": self._api_test,
            "auth.test": self._auth_test,
            "chat.postMessage": self._chat_post_message,
            "chat.update": self._chat_update,
            "chat.postEphemeral": self._chat_post_ephemeral,
            "conversations.replies": self._conversations_replies,
            "reactions.add": self._reactions_add,
            "files.getUploadURLExternal": self._files_get_upload_url,
            "files.completeUploadExternal": self._files_complete_upload,
            "usergroups.users.list": self._usergroups_users_list,
            "users.list": self._users_list,
        }
        if state_file is not None and state_file.exists():
            self._load(state_file)

    # ----------------------------------------------------------------- Web API entry point

    def call(
        self, method: str, args: JsonDict, token: str | None, origin: str
    ) -> tuple[int, JsonDict]:
        """Run one Web API call and record it; returns the HTTP status and the JSON body.

        Args:
            method: The Web API method, e.g. ``chat.postMessage``.
            args: The request's arguments, the token already removed.
            token: The bearer token the caller sent, if any.
            origin: ``http://host:port`` as the caller reached us, for the URLs we hand out.
        """
        handler = self._methods.get(method)
        status: int
        body: JsonDict
        with self._lock:
            try:
                if handler is None:
                    raise ApiError("unknown_method", status=HTTPStatus.NOT_FOUND)
                if self._token is not None and token != self._token:
                    raise ApiError("invalid_auth")
                status, body = HTTPStatus.OK, {"ok": True, **handler(args, origin)}
            except ApiError as exc:
                status, body = exc.status, exc.body()
            self._calls.append(
                {
                    "method": method,
                    "args": args,
                    "time": time.time(),
                    "ok": body["ok"],
                    "error": body.get("error"),
                }
            )
            self._save()
            return status, copy.deepcopy(body)

    # ----------------------------------------------------------------- methods

    def _api_test(self, args: JsonDict, origin: str) -> JsonDict:
        if error := _text(args, "error"):
            raise ApiError(error)
        return {"args": args}

    def _auth_test(self, args: JsonDict, origin: str) -> JsonDict:
        return {
            "url": f"{origin}/",
            "team": "modelship-emulator",
            "user": "modelship",
            "team_id": TEAM_ID,
            "user_id": BOT_USER_ID,
            "bot_id": BOT_ID,
            "is_enterprise_install": False,
        }

    def _content(self, args: JsonDict) -> JsonDict:
        """The text, blocks and attachments of a new or updated message, validated."""
        text = _text(args, "text")
        if text is not None and len(text) > MAX_TEXT_CHARS:
            raise ApiError("msg_too_long", detail=f"{len(text)} characters; at most 40000")
        return {
            "text": text,
            "blocks": parse_blocks(args.get("blocks")),
            "attachments": parse_json_list(
                args.get("attachments"), error="invalid_attachments", argument="attachments"
            ),
        }

    def _thread_root(self, channel: str, thread_ts: str | None) -> str | None:
        """The ts of the thread a reply joins; a reply to a reply joins its parent's thread."""
        if thread_ts is None:
            return None
        parent = self._index.get((channel, thread_ts))
        if parent is None:
            raise ApiError("thread_not_found", detail=f"no message {thread_ts} in {channel}")
        return cast(str, parent["thread_ts"] or parent["ts"])

    def _next_ts(self) -> str:
        """A fresh, strictly increasing message ts close to the wall clock."""
        self._last_micros = max(time.time_ns() // 1000, self._last_micros + 1)
        return format_ts(self._last_micros)

    def _chat_post_message(self, args: JsonDict, origin: str) -> JsonDict:
        channel = _required(args, "channel", "channel_not_found")
        content = self._content(args)
        if not (content["text"] or content["blocks"] or content["attachments"]):
            raise ApiError("no_text")
        thread_ts = self._thread_root(channel, _text(args, "thread_ts"))
        ts = self._next_ts()
        msg: JsonDict = {
            "channel": channel,
            "ts": ts,
            "thread_ts": thread_ts,
            **content,
            "metadata": args.get("metadata"),
            "updated": False,
            "updated_ts": None,
            "history": [],
            "reactions": [],
            "posted_at": time.time(),
        }
        self._messages.append(msg)
        self._index[(channel, ts)] = msg
        return {"channel": channel, "ts": ts, "message": _api_view(msg)}

    def _chat_update(self, args: JsonDict, origin: str) -> JsonDict:
        channel = _required(args, "channel", "channel_not_found")
        ts = _required(args, "ts", "message_not_found")
        msg = self._index.get((channel, ts))
        if msg is None:
            raise ApiError("message_not_found", detail=f"no message {ts} in {channel}")
        content = self._content(args)
        if not (content["text"] or content["blocks"] or content["attachments"]):
            raise ApiError("no_text")
        msg["history"].append(
            {
                "text": msg["text"],
                "blocks": msg["blocks"],
                "attachments": msg["attachments"],
                "replaced_at": time.time(),
            }
        )
        # As on Slack, fields the update leaves out keep their previous value.
        for key, value in content.items():
            if value is not None:
                msg[key] = value
        msg["updated"] = True
        msg["updated_ts"] = self._next_ts()
        return {"channel": channel, "ts": ts, "text": msg["text"] or "", "message": _api_view(msg)}

    def _chat_post_ephemeral(self, args: JsonDict, origin: str) -> JsonDict:
        channel = _required(args, "channel", "channel_not_found")
        user = _required(args, "user", "user_not_in_channel")
        content = self._content(args)
        if not (content["text"] or content["blocks"] or content["attachments"]):
            raise ApiError("no_text")
        ts = self._next_ts()
        self._ephemeral.append(
            {
                "channel": channel,
                "user": user,
                "ts": ts,
                "thread_ts": _text(args, "thread_ts"),
                **content,
                "posted_at": time.time(),
            }
        )
        return {"message_ts": ts}

    def _conversations_replies(self, args: JsonDict, origin: str) -> JsonDict:
        channel = _required(args, "channel", "channel_not_found")
        ts = _required(args, "ts", "thread_not_found")
        root_ts = self._thread_root(channel, ts)
        root = self._index[(channel, cast(str, root_ts))]
        replies = [
            m for m in self._messages if m["channel"] == channel and m["thread_ts"] == root_ts
        ]
        root_view = _api_view(root)
        if replies:
            root_view["thread_ts"] = root_ts
            root_view["reply_count"] = len(replies)
            root_view["latest_reply"] = replies[-1]["ts"]
        return {
            "messages": [root_view, *(_api_view(m) for m in replies)],
            "has_more": False,
            "response_metadata": {"next_cursor": ""},
        }

    def _reactions_add(self, args: JsonDict, origin: str) -> JsonDict:
        channel = _required(args, "channel", "channel_not_found")
        ts = _required(args, "timestamp", "no_item_specified")
        name = _required(args, "name", "invalid_name").strip(":")
        msg = self._index.get((channel, ts))
        if msg is None:
            raise ApiError("message_not_found", detail=f"no message {ts} in {channel}")
        for reaction in msg["reactions"]:
            if reaction["name"] == name:
                raise ApiError("already_reacted")
        msg["reactions"].append({"name": name, "count": 1, "users": [BOT_USER_ID]})
        return {}

    def _files_get_upload_url(self, args: JsonDict, origin: str) -> JsonDict:
        filename = _required(args, "filename")
        try:
            length = int(_required(args, "length"))
        except ValueError as exc:
            raise ApiError("invalid_arguments", detail="length must be an integer") from exc
        if length < 0:
            raise ApiError("invalid_arguments", detail="length must be >= 0")
        self._file_seq += 1
        file_id = f"F{self._file_seq:010d}"
        self._files[file_id] = {
            "id": file_id,
            "name": filename,
            "title": None,
            "declared_length": length,
            "alt_txt": _text(args, "alt_txt"),
            "data": None,
            "size": None,
            "sha256": None,
            "completed": False,
            "channel": None,
            "channels": [],
            "thread_ts": None,
            "initial_comment": None,
            "created": time.time(),
        }
        return {"upload_url": f"{origin}{UPLOAD_PREFIX}{file_id}", "file_id": file_id}

    def _usergroups_users_list(self, args: JsonDict, origin: str) -> JsonDict:
        group = _required(args, "usergroup", "no_such_subteam")
        if group not in USERGROUPS:
            raise ApiError("no_such_subteam", detail=f"no user group {group}")
        return {"users": list(USERGROUPS[group]["users"])}

    def _users_list(self, args: JsonDict, origin: str) -> JsonDict:
        return {"members": [{"id": uid, "name": name, "real_name": name.capitalize(),
                             "is_bot": False} for uid, name in USERS.items()]}

    def respond(self, response_id: str, body: JsonDict) -> int:
        """A POST to a click's ``response_url``: an ephemeral reply, or the message replaced.

        Returns the HTTP status for the caller (404 for an unknown or used-up URL).
        """
        with self._lock:
            target = self._responses.get(response_id)
            if target is None or target["uses"] >= 5:  # Slack allows 5 uses in 30 min
                return HTTPStatus.NOT_FOUND
            target["uses"] += 1
            content = self._content(body)
            if body.get("replace_original") in (True, "true") and body.get(
                    "response_type") != "ephemeral":
                self._chat_update({**body, "channel": target["channel"],
                                   "ts": target["ts"]}, "")
            else:
                self._ephemeral.append({"channel": target["channel"], "user": target["user"],
                                        "ts": self._next_ts(), "thread_ts": target["ts"],
                                        **content, "via": "response_url",
                                        "posted_at": time.time()})
            self._save()
            return HTTPStatus.OK

    def new_response_url(self, origin: str, *, channel: str, ts: str, user: str) -> str:
        """A ``response_url`` for one click, as Slack hands one out with each payload."""
        with self._lock:
            response_id = hashlib.sha256(f"{channel}{ts}{user}{time.time_ns()}".encode()
                                         ).hexdigest()[:24]
            self._responses[response_id] = {"channel": channel, "ts": ts, "user": user,
                                            "uses": 0}
            return f"{origin}{INTROSPECTION_PREFIX}/response/{response_id}"

    def store_upload(self, file_id: str, data: bytes) -> int:
        """Keep the bytes POSTed to an upload URL; returns the HTTP status for the uploader."""
        with self._lock:
            record = self._files.get(file_id)
            if record is None or record["completed"]:
                return HTTPStatus.NOT_FOUND
            record["data"] = data
            record["size"] = len(data)
            record["sha256"] = hashlib.sha256(data).hexdigest()
            self._save()
            return HTTPStatus.OK

    def _files_complete_upload(self, args: JsonDict, origin: str) -> JsonDict:
        items = parse_json_list(args.get("files"), error="invalid_arguments", argument="files")
        if not items:
            raise ApiError("invalid_arguments", detail="missing required field: files")
        channels_raw = args.get("channels")
        channels = (
            [c for c in channels_raw.split(",") if c]
            if isinstance(channels_raw, str)
            else [str(c) for c in channels_raw or []]
        )
        if channel_id := _text(args, "channel_id"):
            channels.insert(0, channel_id)
        thread_ts = _text(args, "thread_ts")
        if thread_ts is not None:
            if not channels:
                raise ApiError("invalid_arguments", detail="thread_ts needs channel_id")
            thread_ts = self._thread_root(channels[0], thread_ts)
        records: list[JsonDict] = []
        for item in items:
            file_id = item.get("id") if isinstance(item, dict) else None
            record = self._files.get(file_id) if isinstance(file_id, str) else None
            if record is None or record["data"] is None or record["completed"]:
                raise ApiError("file_not_found", detail=f"no uploaded file {file_id}")
            records.append(record)
        out: list[JsonDict] = []
        for item, record in zip(items, records, strict=True):
            record.update(
                completed=True,
                title=item.get("title") or record["name"],
                channel=channels[0] if channels else None,
                channels=channels,
                thread_ts=thread_ts,
                initial_comment=_text(args, "initial_comment"),
            )
            out.append(
                {
                    "id": record["id"],
                    "name": record["name"],
                    "title": record["title"],
                    "size": record["size"],
                    "mimetype": mimetypes.guess_type(record["name"])[0]
                    or "application/octet-stream",
                    "url_private": f"{origin}{INTROSPECTION_PREFIX}/files/{record['id']}",
                    "channels": channels,
                }
            )
        return {"files": out}

    # ----------------------------------------------------------------- introspection

    def messages(self, channel: str | None = None) -> list[JsonDict]:
        """Messages posted and updated, oldest first (``/_emulator/messages``)."""
        with self._lock:
            return [
                {
                    "channel": m["channel"],
                    "ts": m["ts"],
                    "thread_ts": m["thread_ts"],
                    "text": m["text"],
                    "blocks": m["blocks"],
                    "attachments": m["attachments"],
                    "metadata": m["metadata"],
                    "updated": m["updated"],
                    "history": m["history"],
                    "reactions": m["reactions"],
                    "posted_at": m["posted_at"],
                }
                for m in copy.deepcopy(self._messages)
                if channel is None or m["channel"] == channel
            ]

    def ephemeral(self) -> list[JsonDict]:
        """Ephemeral messages, oldest first (``/_emulator/ephemeral``)."""
        with self._lock:
            return copy.deepcopy(self._ephemeral)

    def calls(self, method: str | None = None) -> list[JsonDict]:
        """Every Web API call received, oldest first (``/_emulator/calls``)."""
        with self._lock:
            return [
                c for c in copy.deepcopy(self._calls) if method is None or c["method"] == method
            ]

    def files(self) -> list[JsonDict]:
        """Uploads without their bytes (``/_emulator/files``)."""
        with self._lock:
            return [
                {k: v for k, v in record.items() if k != "data"} for record in self._files.values()
            ]

    def file_bytes(self, file_id: str) -> tuple[str, bytes] | None:
        """The name and bytes of one upload, if it has any."""
        with self._lock:
            record = self._files.get(file_id)
            if record is None or record["data"] is None:
                return None
            return record["name"], record["data"]

    def reset(self) -> None:
        """Forget messages, calls and files; ts and file ids keep increasing."""
        with self._lock:
            self._messages.clear()
            self._index.clear()
            self._ephemeral.clear()
            self._calls.clear()
            self._files.clear()
            self._save()

    # ----------------------------------------------------------------- persistence

    def _save(self) -> None:
        """Write the state file atomically (temp file + rename); a no-op without one."""
        if self._state_file is None:
            return
        files = {
            fid: {
                **{k: v for k, v in rec.items() if k != "data"},
                "data_b64": None if rec["data"] is None else base64.b64encode(rec["data"]).decode(),
            }
            for fid, rec in self._files.items()
        }
        document = {
            "version": STATE_FILE_VERSION,
            "last_micros": self._last_micros,
            "file_seq": self._file_seq,
            "messages": self._messages,
            "ephemeral": self._ephemeral,
            "calls": self._calls,
            "files": files,
        }
        tmp = self._state_file.with_name(f".{self._state_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(document), encoding="utf-8")
        os.replace(tmp, self._state_file)

    def _load(self, path: Path) -> None:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            if document.get("version") != STATE_FILE_VERSION:
                raise ValueError(f"version {document.get('version')!r}, expected 1")
            self._last_micros = int(document["last_micros"])
            self._file_seq = int(document["file_seq"])
            self._messages = list(document["messages"])
            self._ephemeral = list(document["ephemeral"])
            self._calls = list(document["calls"])
            for fid, rec in document["files"].items():
                data_b64 = rec.pop("data_b64", None)
                rec["data"] = None if data_b64 is None else base64.b64decode(data_b64)
                self._files[fid] = rec
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateFileError(f"cannot read emulator state file {path}: {exc}") from exc
        self._index = {(m["channel"], m["ts"]): m for m in self._messages}


class StateFileError(Exception):
    """The state file exists but is not one this emulator wrote."""


# --------------------------------------------------------------------------- HTTP


class EmulatorServer(ThreadingHTTPServer):
    """A threading HTTP server that carries the shared :class:`EmulatorState`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: EmulatorState, *,
                 approvals_url: str | None = None, signing_secret: str | None = None) -> None:
        super().__init__(address, EmulatorHandler)
        self.state = state
        self.approvals_url = approvals_url
        self.signing_secret = signing_secret


class EmulatorHandler(BaseHTTPRequestHandler):
    """Routes one request to the Web API, the upload URLs or introspection."""

    protocol_version = "HTTP/1.1"  # keep-alive for clients that reuse connections
    server_version = "modelship-slack-emulator/1"
    # StreamRequestHandler sets TCP_NODELAY on the accepted socket: without it Nagle plus
    # delayed ACK add ~40 ms per request (RECIPES.md, Slack).
    disable_nagle_algorithm = True
    timeout = 60  # seconds an idle keep-alive connection may hold a thread

    @property
    def state(self) -> EmulatorState:
        return cast(EmulatorServer, self.server).state

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: every call is recorded at /_emulator/calls instead."""

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # ----------------------------------------------------------------- routing

    def _dispatch(self, verb: str) -> None:
        split = urlsplit(self.path)
        path = re.sub("/{2,}", "/", split.path)
        if path.startswith("/api/_emulator"):  # callers that join onto an .../api/ base URL
            path = path[len("/api") :]
        try:
            body = self._read_body()
            if verb == "GET" and path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, WEB_VIEW_HTML.encode(), "text/html; charset=utf-8")
            elif verb == "GET" and path == f"{INTROSPECTION_PREFIX}/users":
                self._send_json(HTTPStatus.OK, {"ok": True, "users": USERS,
                                                "usergroups": USERGROUPS})
            elif verb == "POST" and path == f"{INTROSPECTION_PREFIX}/click":
                self._click(body)
            elif verb == "POST" and path.startswith(f"{INTROSPECTION_PREFIX}/response/"):
                args = parse_body(self.headers.get("Content-Type", ""), body)
                status = self.state.respond(path.rsplit("/", 1)[1], args)
                self._send_json(status, {"ok": status == HTTPStatus.OK})
            elif path == INTROSPECTION_PREFIX or path.startswith(INTROSPECTION_PREFIX + "/"):
                self._introspect(verb, path[len(INTROSPECTION_PREFIX) :], split.query)
            elif path.startswith(API_PREFIX):
                self._web_api(path[len(API_PREFIX) :], split.query, body)
            elif path.startswith(UPLOAD_PREFIX) and verb == "POST":
                self._upload(path[len(UPLOAD_PREFIX) :], body)
            else:
                self._send_json(HTTPStatus.NOT_FOUND, {"ok": False, "error": "not_found"})
        except ApiError as exc:
            self._send_json(exc.status, exc.body())

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise ApiError("invalid_request", status=HTTPStatus.LENGTH_REQUIRED)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError as exc:
            raise ApiError("invalid_request", status=HTTPStatus.BAD_REQUEST) from exc
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError("request_too_large", status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        return self.rfile.read(length) if length > 0 else b""

    def _origin(self) -> str:
        host = self.headers.get("Host")
        if not host:
            address = cast(tuple[str, int], self.server.server_address)
            host = f"{address[0]}:{address[1]}"
        return f"http://{host}"

    def _web_api(self, method: str, query: str, body: bytes) -> None:
        args: JsonDict = dict(parse_qsl(query, keep_blank_values=True))
        args.update(parse_body(self.headers.get("Content-Type", ""), body))
        args = {k: v for k, v in args.items() if v is not None}
        token = args.pop("token", None)
        auth = self.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            token = auth[7:].strip()
        status, response = self.state.call(
            method, args, None if token is None else str(token), self._origin()
        )
        self._send_json(status, response)

    def _click(self, body: bytes) -> None:
        """A button clicked on the web view: sent to ``approvals_url`` as Slack sends it.

        The emulator and the approvals service share nothing but HTTP: the click is a
        ``block_actions`` payload, form encoded and signed with the stack's signing secret,
        with a ``response_url`` back to this emulator.
        """
        server = cast(EmulatorServer, self.server)
        args = parse_body("application/json", body)
        if not server.approvals_url or not server.signing_secret:
            raise ApiError("no_approvals_url", status=HTTPStatus.SERVICE_UNAVAILABLE,
                           detail="start the emulator with --approvals-url and "
                           f"{SIGNING_SECRET_ENV}")
        channel, ts = _required(args, "channel"), _required(args, "ts")
        user = _required(args, "user")
        payload = block_actions_payload(
            user_id=user, user_name=USERS.get(user, user),
            action_id=_required(args, "action_id"), value=_required(args, "value"),
            channel=channel, message_ts=ts,
            response_url=self.state.new_response_url(self._origin(), channel=channel,
                                                     ts=ts, user=user))
        data, headers = signed_request(server.signing_secret, payload)
        request = urllib.request.Request(server.approvals_url, data=data, method="POST",
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, answer = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, answer = exc.code, exc.read()
        except OSError as exc:
            raise ApiError("approvals_unreachable", status=HTTPStatus.BAD_GATEWAY,
                           detail=str(exc)) from exc
        try:
            decoded: Any = json.loads(answer or b"{}")
        except ValueError:
            decoded = {"raw": answer.decode("utf-8", "replace")}
        self._send_json(HTTPStatus.OK, {"ok": status == HTTPStatus.OK, "status": status,
                                        "answer": decoded})

    def _upload(self, file_id: str, body: bytes) -> None:
        data = upload_payload(self.headers.get("Content-Type", ""), body)
        status = self.state.store_upload(file_id, data)
        text = f"OK - {len(data)}" if status == HTTPStatus.OK else "file not found"
        self._send(status, text.encode(), "text/plain; charset=utf-8")

    def _introspect(self, verb: str, route: str, query: str) -> None:
        params = dict(parse_qsl(query))
        state = self.state
        if verb == "GET" and route == "/health":
            self._send_json(HTTPStatus.OK, {"ok": True})
        elif verb == "GET" and route == "/messages":
            self._send_json(
                HTTPStatus.OK, {"ok": True, "messages": state.messages(params.get("channel"))}
            )
        elif verb == "GET" and route == "/ephemeral":
            self._send_json(HTTPStatus.OK, {"ok": True, "messages": state.ephemeral()})
        elif verb == "GET" and route == "/calls":
            self._send_json(HTTPStatus.OK, {"ok": True, "calls": state.calls(params.get("method"))})
        elif verb == "GET" and route == "/files":
            self._send_json(HTTPStatus.OK, {"ok": True, "files": state.files()})
        elif verb == "GET" and route.startswith("/files/"):
            found = state.file_bytes(route[len("/files/") :])
            if found is None:
                self._send_json(HTTPStatus.NOT_FOUND, {"ok": False, "error": "file_not_found"})
            else:
                name, data = found
                mimetype = mimetypes.guess_type(name)[0] or "application/octet-stream"
                self._send(HTTPStatus.OK, data, mimetype)
        elif verb == "POST" and route == "/reset":
            state.reset()
            self._send_json(HTTPStatus.OK, {"ok": True})
        else:
            self._send_json(HTTPStatus.NOT_FOUND, {"ok": False, "error": "not_found"})

    # ----------------------------------------------------------------- responses

    def _send_json(self, status: int, body: JsonDict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json; charset=utf-8")

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


# --------------------------------------------------------------------------- CLI


#: The environment variable the bot token comes from, so it never shows on the command line.
TOKEN_ENV = "MODELSHIP_SLACK_EMULATOR_TOKEN"
#: The signing secret the web view signs its clicks with (the stack's, in stack.json).
SIGNING_SECRET_ENV = "MODELSHIP_SLACK_EMULATOR_SIGNING_SECRET"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m modelship.slack.emulator",
        description="A local Slack Web API emulator for the modelship demo and tests.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    parser.add_argument("--token", default=None,
                        help=f"bot token to require (visible to other users on the command "
                        f"line: prefer the {TOKEN_ENV} environment variable); default: any")
    parser.add_argument(
        "--state-file", type=Path, default=None, help="JSON file keeping state across restarts"
    )
    parser.add_argument("--approvals-url", default=None,
                        help="where the web view's buttons send their interactivity requests "
                        f"(signed with the secret in {SIGNING_SECRET_ENV})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; returns the process exit code."""
    args = _parse_args(argv)
    try:
        token = args.token or os.environ.get(TOKEN_ENV) or None
        state = EmulatorState(token=token, state_file=args.state_file)
        server = EmulatorServer((args.host, args.port), state,
                                approvals_url=args.approvals_url,
                                signing_secret=os.environ.get(SIGNING_SECRET_ENV) or None)
    except StateFileError as exc:
        print(f"slack emulator: {exc}. Delete the file or pass another --state-file.",
              file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"slack emulator: cannot listen on {args.host}:{args.port}: {exc}. "
            "Pick another --port, or 0 for a free one.",
            file=sys.stderr,
        )
        return 1

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    serving = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="slack-emulator"
    )
    serving.start()
    host, port = server.server_address[:2]
    url = f"http://{host!s}:{port}"
    ready = {"event": "listening", "url": url, "api_url": f"{url}/api/", "pid": os.getpid()}
    print(json.dumps(ready), flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        serving.join()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
