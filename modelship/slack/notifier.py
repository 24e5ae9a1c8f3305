"""Where release events go: Slack when it is configured, nowhere otherwise.

The wiring picks one :class:`Notifier` once (``SlackNotifier`` when a Slack URL and token are
set and the policy enables notifications, ``NullNotifier`` otherwise), so no task ever asks
``if slack_enabled:`` (flagger's null notifier).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from modelship.slack.client import SlackClient

Blocks = Sequence[Mapping[str, Any]]


class Notifier(Protocol):
    """Posts, updates and uploads release events; ts values thread the posts."""

    channel: str | None

    def post(self, text: str, blocks: Blocks | None = None,
             thread_ts: str | None = None) -> str | None:
        """Post ``text`` (and Block Kit ``blocks``), as a reply when ``thread_ts`` is given.

        Returns:
            The posted message's ts, the thread root for later posts; ``None`` when nothing
            was posted.
        """
        ...

    def update(self, ts: str, text: str, blocks: Blocks | None = None) -> None:
        """Replace a posted message in place (``chat.update``)."""
        ...

    def upload(self, path: Path, *, title: str, thread_ts: str | None = None) -> str | None:
        """Upload a file (the canary plot) into the thread; returns the file id."""
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
        self.channel: str | None = channel
        self._posted_channel: str | None = None

    def post(self, text: str, blocks: Blocks | None = None,
             thread_ts: str | None = None) -> str | None:
        """Post to the channel; returns the message ts."""
        assert self.channel is not None
        posted = self.client.post_message(self.channel, text, blocks=blocks,
                                          thread_ts=thread_ts)
        # chat.update needs the channel id Slack answered with, not the #name.
        self._posted_channel = posted.channel
        return posted.ts

    def update(self, ts: str, text: str, blocks: Blocks | None = None) -> None:
        assert self.channel is not None
        self.client.update_message(self._posted_channel or self.channel, ts, text,
                                   blocks=blocks)

    def upload(self, path: Path, *, title: str, thread_ts: str | None = None) -> str | None:
        assert self.channel is not None
        return self.client.upload_file(self._posted_channel or self.channel, path, path.name,
                                       title=title, thread_ts=thread_ts)


class NullNotifier:
    """Drops every event; used when Slack is not configured or notifications are off."""

    channel: str | None = None

    def post(self, text: str, blocks: Blocks | None = None,
             thread_ts: str | None = None) -> str | None:
        """Do nothing; ``None`` tells callers there is no thread to reply to."""
        return None

    def update(self, ts: str, text: str, blocks: Blocks | None = None) -> None:
        """Do nothing."""

    def upload(self, path: Path, *, title: str, thread_ts: str | None = None) -> str | None:
        """Do nothing."""
        return None
