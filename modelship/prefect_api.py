"""The Prefect API, as modelship needs it: health now, runs and approvals later."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from modelship.http import expect_ok


class PrefectApi:
    """One Prefect server. The constructor does no I/O.

    Args:
        api_url: The API base URL, e.g. ``http://127.0.0.1:4200/api``.
        timeout_s: Timeout of one request, in seconds.
    """

    def __init__(self, api_url: str, *, timeout_s: float) -> None:
        self.api_url = api_url.rstrip("/")
        self.timeout_s = timeout_s

    def ping(self) -> None:
        """Raise Unreachable/InfrastructureError unless ``/health`` answers 200."""
        expect_ok(f"{self.api_url}/health", timeout_s=self.timeout_s, what="the Prefect API")


@contextmanager
def pointed_at(api_url: str | None) -> Iterator[None]:
    """Run Prefect code against ``api_url``, the stack's server (never an ephemeral one).

    Prefect reads its settings once at import, so setting ``PREFECT_API_URL`` later has no
    effect; ``temporary_settings`` is Prefect's own way to change them in a block.
    """
    if not api_url:
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        try:
            yield
        finally:
            _flush_to_api()


def _flush_to_api(timeout_s: float = 10.0) -> None:
    """Send the queued run logs and events while the API URL still points at the stack.

    Left for interpreter exit, Prefect's background senders would run outside the block:
    with no API URL they start an ephemeral server to send to (seconds of exit time, and
    the logs land in the wrong place), and they warn about pending items on stderr.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        try:
            service.drain_all(timeout=timeout_s, at_exit=False)
        except Exception:  # noqa: BLE001 - best effort: a log flush never fails a release
            pass
