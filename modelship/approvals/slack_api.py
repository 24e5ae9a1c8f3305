"""The Slack calls approvals make beyond a release thread's posts.

``usergroups.users.list`` (approvers given as a user group), ``chat.update`` (the buttons
replaced by the outcome), ``chat.postEphemeral`` (telling a refused clicker why) and the
click's ``response_url``. Built at the edge; the constructor does no I/O. Every failure
becomes a modelship error.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, cast

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from modelship.errors import InfrastructureError, Unreachable
from modelship.slack.client import web_api_base_url


class ApprovalSlack:
    """Slack as the approvals need it.

    Args:
        api_url: Web API root or emulator root.
        token: Bot token.
        timeout_s: Deadline of one HTTP request, in seconds.
    """

    def __init__(self, api_url: str, token: str, *, timeout_s: float) -> None:
        self.base_url = web_api_base_url(api_url)
        self.timeout_s = timeout_s
        self._web = WebClient(token=token, base_url=self.base_url,
                              timeout=cast(int, timeout_s), retry_handlers=[])

    def group_members(self, group: str) -> list[str]:
        """The user ids of a user group (``usergroups.users.list``)."""
        response = self._call("usergroups.users.list",
                              lambda: self._web.usergroups_users_list(usergroup=group))
        return [str(u) for u in cast(list[Any], response.get("users") or [])]

    def update(self, channel: str, ts: str, text: str,
               blocks: Sequence[Mapping[str, Any]]) -> None:
        """Replace a message in place (``chat.update``)."""
        self._call("chat.update", lambda: self._web.chat_update(
            channel=channel, ts=ts, text=text, blocks=[dict(b) for b in blocks]))

    def ephemeral(self, channel: str, user: str, text: str,
                  thread_ts: str | None = None) -> None:
        """Tell one user something only they see (``chat.postEphemeral``)."""
        self._call("chat.postEphemeral", lambda: self._web.chat_postEphemeral(
            channel=channel, user=user, text=text, thread_ts=thread_ts))

    def respond(self, response_url: str, body: Mapping[str, Any]) -> None:
        """POST to a click's ``response_url`` (Slack's reply channel for that click)."""
        request = urllib.request.Request(response_url, data=json.dumps(body).encode(),
                                         method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except OSError as exc:
            raise Unreachable(f"the response_url {response_url} did not answer: {exc}",
                              hint="the click's message may be stale; the outcome is in "
                              "the release record") from exc

    def _call(self, method: str, send: Any) -> Any:
        try:
            return send()
        except SlackApiError as exc:
            raise InfrastructureError(
                f"Slack refused {method} at {self.base_url}: {exc.response.get('error')}",
                hint="check the bot token and its scopes", method=method) from exc
        except (SlackClientError, OSError) as exc:
            raise Unreachable(f"Slack at {self.base_url} did not answer {method}: {exc}",
                              hint="start the embedded stack or fix MODELSHIP_SLACK_API_URL",
                              method=method) from exc
