"""Tiny HTTP helpers for health checks, with explicit timeouts and typed errors."""

from __future__ import annotations

import urllib.error
import urllib.request

from modelship.errors import InfrastructureError, Unreachable


def get(url: str, *, timeout_s: float, what: str) -> tuple[int, bytes]:
    """GET ``url``; connection failures become :class:`Unreachable` naming ``what``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read() or b"")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(
            f"{what} at {url} did not answer ({reason})",
            hint=f"check that {what} is running and its URL is right (`modelship doctor`)",
            endpoint=url,
        ) from exc


def expect_ok(url: str, *, timeout_s: float, what: str) -> None:
    """Raise unless ``url`` answers 200."""
    status, _ = get(url, timeout_s=timeout_s, what=what)
    if status != 200:
        raise InfrastructureError(
            f"{what} at {url} answered HTTP {status}, not 200",
            hint=f"it may still be starting; see the log of {what}",
            endpoint=url,
            status=status,
        )
