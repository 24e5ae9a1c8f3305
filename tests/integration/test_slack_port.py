"""One Slack port (issue 19 item 7): what the approvals need beyond a release thread's posts
(a user group's members, an ephemeral reply, a click's ``response_url``) is on
:class:`modelship.slack.client.SlackClient`, against the Slack emulator (its own process,
no stack: a few seconds)."""

from __future__ import annotations

import pytest

from modelship.errors import InfrastructureError, Unreachable
from modelship.slack.client import SlackClient
from modelship.slack.emulator import USERGROUPS
from tests.integration.test_slack_emulator import Emulator, channel, emulator, slack

pytestmark = pytest.mark.integration
__all__ = ["channel", "emulator", "slack"]  # the emulator module's fixtures, used here


def test_group_members_and_an_unknown_group(slack: SlackClient) -> None:
    assert slack.group_members("S0APPROVERS") == USERGROUPS["S0APPROVERS"]["users"]
    with pytest.raises(InfrastructureError) as refused:
        slack.group_members("S0NOBODY")
    assert refused.value.details["error"] == "no_such_subteam"
    assert refused.value.details["transient"] is False


def test_an_ephemeral_reply_reaches_only_its_user(emulator: Emulator, slack: SlackClient,
                                                  channel: str) -> None:
    root = slack.post_message(channel, "approve fraud v7?")
    slack.ephemeral(channel, "U0ALICE", "you cannot approve your own release",
                    thread_ts=root.ts)
    shown = [m for m in emulator.get("/_emulator/ephemeral")["messages"]
             if m["channel"] == channel]
    assert [(m["user"], m["text"]) for m in shown] == [
        ("U0ALICE", "you cannot approve your own release")]


def test_a_dead_response_url_is_unreachable(emulator: Emulator, slack: SlackClient) -> None:
    url = f"{emulator.url}/_emulator/response/no-such-click"
    with pytest.raises(Unreachable) as dead:
        slack.respond(url, {"response_type": "ephemeral", "text": "too late"})
    assert url in dead.value.message and dead.value.details["transient"] is True
