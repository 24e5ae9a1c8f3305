"""The TrafficRouter port: set the weights, mirror a share, read back what is live.

Shaped like Flagger's routers: one small interface, one adapter per data plane (the embedded
stack's local gateway, the Kubernetes Gateway API). A split is always between two backends:
``production`` (the fleet's replicas) and ``canary`` (the canary Triton).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from modelship.errors import UsageError


@dataclass(frozen=True)
class TrafficSplit:
    """What the router does with live requests.

    Attributes:
        canary_pct: share of live requests (0-100) *answered* by the canary backend; the rest
            go to production.
        mirror_pct: share of live requests (0-100) *copied* to the canary backend; their
            answers are thrown away and never reach a client.
    """

    canary_pct: float = 0.0
    mirror_pct: float = 0.0

    def __post_init__(self) -> None:
        for name in ("canary_pct", "mirror_pct"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 100):
                raise UsageError(f"traffic split: {name} must be a percentage in [0, 100], "
                                 f"got {value!r}",
                                 hint="give a number between 0 and 100")

    @property
    def production_pct(self) -> float:
        return 100.0 - self.canary_pct

    @property
    def is_production_only(self) -> bool:
        """True when every client is answered by production and nothing is mirrored."""
        return self.canary_pct == 0 and self.mirror_pct == 0

    def to_dict(self) -> dict[str, float]:
        return {"production_pct": self.production_pct, "canary_pct": self.canary_pct,
                "mirror_pct": self.mirror_pct}


#: Where every release starts and every failure path returns to.
PRODUCTION_ONLY = TrafficSplit()


@runtime_checkable
class TrafficRouter(Protocol):
    """One data plane's router. Every method is idempotent and bounded by a timeout; a
    router that cannot be reached raises ``modelship.errors.InfrastructureError`` (exit 1)."""

    #: A short name for records and ``status`` ("local-gateway", "gateway-api").
    name: str

    def set_weights(self, canary_pct: float) -> None:
        """Answer ``canary_pct`` % of live requests from the canary backend, the rest from
        production; the mirror share is left as it is. Drops no request."""
        ...

    def mirror(self, share_pct: float) -> None:
        """Copy ``share_pct`` % of live requests to the canary backend, answers discarded
        (0 turns mirroring off); the weights are left as they are. Drops no request."""
        ...

    def live(self) -> TrafficSplit:
        """What the data plane does now, read back from it (never from a cache)."""
        ...


@runtime_checkable
class ScopeReporting(Protocol):
    """A router that also says which requests its live split applies to (``status``)."""

    def live_scoped(self) -> tuple[TrafficSplit, dict[str, Any]]:
        """:meth:`TrafficRouter.live` and its scope (``applies_to`` in words, and the
        adapter's fields), from one read."""
        ...
