"""The one narrow client modelship uses to talk to Slack's Web API (or the local emulator).

It wraps ``slack_sdk.WebClient`` so that the rest of the code never sees a vendor exception:
every ``SlackApiError``, ``SlackClientError`` and connection error is turned into a modelship
error here, in :meth:`SlackClient._call`, with ``raise ... from exc``.

- A server that does not answer (refused, reset, timed out) -> :class:`Unreachable`, naming
  the URL and the timeout.
- Slack answering ``{"ok": false}`` (bad token, unknown channel, rate limit) or a failed
  upload -> :class:`InfrastructureError`, with the Slack error code in ``details["error"]`` and
  ``details["transient"]`` true when a retry may help (rate limits, 5xx).
- Bad arguments we can see before sending (an empty token, a missing file) -> :class:`UsageError`.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.web import SlackResponse

from modelship.errors import InfrastructureError, Unreachable, UsageError

# Slack error codes that mean "fix the settings", with what to fix.
_SETTINGS_HINTS: dict[str, str] = {
    "invalid_auth": "Check the Slack bot token (MODELSHIP_SLACK_TOKEN) for this workspace",
    "not_authed": "Set the Slack bot token (MODELSHIP_SLACK_TOKEN)",
    "token_revoked": "The Slack bot token was revoked; install the app again and set the new one",
    "token_expired": "The Slack bot token expired; set a fresh one (MODELSHIP_SLACK_TOKEN)",
    "account_inactive": "The Slack bot token belongs to a deleted user or workspace",
    "missing_scope": "Give the Slack app the scope it lacks (chat:write, files:write, ...)",
    "channel_not_found": "Check the Slack channel (MODELSHIP_SLACK_CHANNEL or the policy)",
    "not_in_channel": "Invite the Slack app to the channel, or pick another channel",
    "is_archived": "The Slack channel is archived; pick another one",
}
# Slack error codes after which the same call may succeed later.
_TRANSIENT_ERRORS = frozenset(
    {"ratelimited", "internal_error", "fatal_error", "service_unavailable", "request_timeout"}
)


def web_api_base_url(api_url: str) -> str:
    """The ``base_url`` slack_sdk wants: the Web API root, ending in ``/api/``.

    Settings and ``stack.json`` may give the server root (``http://127.0.0.1:P``, where the
    emulator's ``/_emulator/...`` also lives) or the API root (``https://slack.com/api/``);
    both mean the same API.

    Raises:
        UsageError: The URL is not an absolute http(s) URL.
    """
    parts = urlsplit(api_url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(
            f"Slack API URL {api_url!r} is not an http(s) URL",
            hint="Set MODELSHIP_SLACK_API_URL to e.g. https://slack.com/api/ or "
            "http://127.0.0.1:PORT for the local emulator",
            url=api_url,
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/api"):
        path = f"{path}/api"
    return f"{parts.scheme}://{parts.netloc}{path}/"


@dataclass(frozen=True)
class PostedMessage:
    """Where a message landed: ``ts`` is Slack's id for it and the root of its thread."""

    channel: str
    ts: str


class SlackClient:
    """Slack's one port: posts, updates and uploads (the release thread), and what the
    approvals need beyond them (a user group's members, an ephemeral reply, a click's
    ``response_url``); the only code that imports slack_sdk's client.

    Built at the edge from settings and passed in; the constructor does no I/O.

    Args:
        api_url: Web API root (``https://slack.com/api/``) or emulator root
            (``http://127.0.0.1:P``).
        token: Bot token (``xoxb-...``), already unwrapped from its ``SecretStr``.
        timeout_s: Deadline of one HTTP request, in seconds.
    """

    def __init__(self, api_url: str, token: str, *, timeout_s: float) -> None:
        if not token.strip():
            raise UsageError(
                "the Slack bot token is empty", hint="Set MODELSHIP_SLACK_TOKEN (xoxb-...)"
            )
        if timeout_s <= 0:
            raise UsageError(f"the Slack timeout must be > 0 s, got {timeout_s}")
        self.base_url = web_api_base_url(api_url)
        self.timeout_s = timeout_s
        self._web = WebClient(
            token=token,
            base_url=self.base_url,
            # urllib takes float seconds; slack_sdk's annotation says int.
            timeout=cast(int, timeout_s),
            # No hidden retries: retrying is the caller's decision (Prefect retry_condition_fn
            # on ``details["transient"]``), and a dead server must fail within timeout_s.
            retry_handlers=[],
        )

    def __repr__(self) -> str:
        return f"SlackClient({self.base_url!r}, timeout_s={self.timeout_s})"

    def ping(self) -> None:
        """Check that Slack answers and accepts the token (``auth.test``), for preflight.

        Raises:
            Unreachable: Nothing answered at the URL within the timeout.
            InfrastructureError: Slack answered but refused, e.g. ``invalid_auth``.
        """
        self._call("auth.test", self._web.auth_test)

    def post_message(
        self,
        channel: str,
        text: str,
        *,
        blocks: Sequence[Mapping[str, Any]] | None = None,
        thread_ts: str | None = None,
    ) -> PostedMessage:
        """Post a message, or a reply when ``thread_ts`` is given.

        ``text`` is always sent: it is the notification and the fallback when blocks cannot
        be shown.
        """
        response = self._call(
            "chat.postMessage",
            lambda: self._web.chat_postMessage(
                channel=channel, text=text, blocks=_blocks(blocks), thread_ts=thread_ts
            ),
            channel=channel,
        )
        return PostedMessage(channel=str(response["channel"]), ts=str(response["ts"]))

    def update_message(
        self,
        channel: str,
        ts: str,
        text: str,
        *,
        blocks: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Replace a posted message, e.g. swap approval buttons for the decision.

        ``blocks=None`` keeps the message's blocks; pass ``[]`` to remove them.
        """
        self._call(
            "chat.update",
            lambda: self._web.chat_update(
                channel=channel, ts=ts, text=text, blocks=_blocks(blocks)
            ),
            channel=channel,
            ts=ts,
        )

    def group_members(self, group: str) -> list[str]:
        """The user ids of a user group (``usergroups.users.list``), for approvers given
        as a group."""
        response = self._call("usergroups.users.list",
                              lambda: self._web.usergroups_users_list(usergroup=group),
                              group=group)
        return [str(u) for u in cast(list[Any], response.get("users") or [])]

    def ephemeral(self, channel: str, user: str, text: str,
                  thread_ts: str | None = None) -> None:
        """Tell one user something only they see (``chat.postEphemeral``), e.g. why their
        approval click was refused."""
        self._call("chat.postEphemeral", lambda: self._web.chat_postEphemeral(
            channel=channel, user=user, text=text, thread_ts=thread_ts), channel=channel)

    def respond(self, response_url: str, body: Mapping[str, Any]) -> None:
        """POST to a click's ``response_url`` (Slack's reply channel for that click).

        Raises:
            Unreachable: The URL did not answer within the timeout.
        """
        request = urllib.request.Request(response_url, data=json.dumps(body).encode(),
                                         method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except OSError as exc:
            raise Unreachable(f"the response_url {response_url} did not answer: {exc}",
                              hint="the click's message may be stale; the outcome is in "
                              "the release record", endpoint=response_url,
                              transient=True) from exc

    def upload_file(
        self,
        channel: str,
        path_or_bytes: str | Path | bytes,
        filename: str,
        *,
        title: str | None = None,
        thread_ts: str | None = None,
    ) -> str:
        """Upload a file (e.g. the canary plot) into a channel or a release thread.

        Returns:
            Slack's file id.

        Raises:
            UsageError: The path cannot be read.
        """
        if isinstance(path_or_bytes, bytes):
            data = path_or_bytes
        else:
            try:
                data = Path(path_or_bytes).read_bytes()
            except OSError as exc:
                raise UsageError(
                    f"cannot read {path_or_bytes} to upload to Slack: {exc.strerror}",
                    path=str(path_or_bytes),
                ) from exc
        response = self._call(
            "files_upload_v2",
            lambda: self._web.files_upload_v2(
                channel=channel,
                file=data,
                filename=filename,
                title=title or filename,
                thread_ts=thread_ts,
            ),
            channel=channel,
            filename=filename,
        )
        return str(cast(Mapping[str, Any], response["file"])["id"])

    def _call(
        self, method: str, send: Callable[[], SlackResponse], **context: Any
    ) -> SlackResponse:
        """Run one slack_sdk call, translating every failure into a modelship error."""
        try:
            return send()
        except SlackApiError as exc:
            error = str(exc.response.get("error") or f"HTTP {exc.response.status_code}")
            status = exc.response.status_code
            transient = error in _TRANSIENT_ERRORS or status == 429 or status >= 500
            raise InfrastructureError(
                f"Slack refused {method} at {self.base_url}: {error}",
                hint=_SETTINGS_HINTS.get(error)
                or ("Retry later" if transient else "See the Slack error code above"),
                endpoint=self.base_url,
                method=method,
                error=error,
                status=status,
                transient=transient,
                **context,
            ) from exc
        except SlackClientError as exc:
            # Raised by slack_sdk itself, e.g. when the upload URL answers non-200.
            raise InfrastructureError(
                f"Slack {method} at {self.base_url} failed: {exc}",
                hint="Retry later; if it persists, check the Slack API URL",
                endpoint=self.base_url,
                method=method,
                transient=True,
                **context,
            ) from exc
        except OSError as exc:  # URLError, ConnectionError, TimeoutError, socket errors
            reason = getattr(exc, "reason", None) or exc
            raise Unreachable(
                f"Slack API at {self.base_url} did not answer {method} within "
                f"{self.timeout_s:g} s: {reason}",
                hint="Start the embedded stack (modelship stack up) or fix "
                "MODELSHIP_SLACK_API_URL",
                endpoint=self.base_url,
                method=method,
                transient=True,
                **context,
            ) from exc


def _blocks(blocks: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Plain dicts for slack_sdk; ``None`` leaves the argument out of the request."""
    return None if blocks is None else [dict(b) for b in blocks]
