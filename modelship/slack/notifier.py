"""Where release events go: Slack when it is configured, nowhere otherwise.

The wiring picks one :class:`Notifier` once (``SlackNotifier`` when a Slack URL and token are
set, ``NullNotifier`` otherwise), so no task ever asks ``if slack_enabled:`` (flagger's null
notifier).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from modelship.slack.client import SlackClient


class Notifier(Protocol):
    """Posts one release event; the returned ts threads the next posts under it."""

    def post(
        self,
        text: str,
        blocks: Sequence[Mapping[str, Any]] | None = None,
        thread_ts: str | None = None,
    ) -> str | None:
        """Post ``text`` (and Block Kit ``blocks``), as a reply when ``thread_ts`` is given.

        Returns:
            The posted message's ts, the thread root for later posts; ``None`` when nothing
            was posted.
        """
        ...


class SlackNotifier:
    """Posts to one Slack channel through a :class:`SlackClient`.

    Failures propagate as modelship errors (``Unreachable``, ``InfrastructureError``): whether a
    lost notification may stop a release is the caller's decision, not this class's.

    Args:
        client: The Slack client, built at the edge.
        channel: Channel id or ``#name`` that receives the release threads.
    """

    def __init__(self, client: SlackClient, channel: str) -> None:
        self.client = client
        self.channel = channel

    def post(
        self,
        text: str,
        blocks: Sequence[Mapping[str, Any]] | None = None,
        thread_ts: str | None = None,
    ) -> str | None:
        """Post to the channel; returns the message ts."""
        return self.client.post_message(self.channel, text, blocks=blocks, thread_ts=thread_ts).ts


class NullNotifier:
    """Drops every event; used when Slack is not configured."""

    def post(
        self,
        text: str,
        blocks: Sequence[Mapping[str, Any]] | None = None,
        thread_ts: str | None = None,
    ) -> str | None:
        """Do nothing; ``None`` tells callers there is no thread to reply to."""
        return None
