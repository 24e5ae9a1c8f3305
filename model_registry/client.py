"""The MLflow model registry client: the only module that talks to MLflow."""

from __future__ import annotations

from modelship.http import expect_ok


class RegistryClient:
    """One MLflow tracking server. The constructor does no I/O.

    Args:
        tracking_uri: MLflow server URL, e.g. ``http://127.0.0.1:5000``.
        timeout_s: Timeout of one request, in seconds.
    """

    def __init__(self, tracking_uri: str, *, timeout_s: float) -> None:
        self.tracking_uri = tracking_uri.rstrip("/")
        self.timeout_s = timeout_s

    def ping(self) -> None:
        """Raise Unreachable/InfrastructureError unless ``/health`` answers 200."""
        expect_ok(f"{self.tracking_uri}/health", timeout_s=self.timeout_s, what="MLflow")
