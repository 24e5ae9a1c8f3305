"""The Prefect API, as modelship needs it: health now, runs and approvals later."""

from __future__ import annotations

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
