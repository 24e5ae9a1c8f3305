"""Which live requests a release's traffic split applies to (pure, no I/O).

A release scopes the router to its own model (:func:`tasks.live_traffic.split_scope`); the
local gateway renders the scope (:mod:`modelship.nginx`), the TrafficRouter adapters take it
(:mod:`modelship.traffic`), ``status`` shows it. It sits in the kernel so that each of them
takes it from here, none from another's module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from modelship.errors import UsageError

__all__ = ["MODEL_NAME", "UNSCOPED", "SplitScope", "scope_report"]

#: Model names a scope can hold: Triton's model directory names, nothing a regex reads.
MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class SplitScope:
    """Which live requests a split applies to; every other request goes to production and
    is never mirrored (the canary Triton serves only the release's candidate, so another
    model's request sent there would fail).

    Attributes:
        model: HTTP requests whose path names it (``/v2/models/<model>[/...]``).
        grpc: gRPC requests too. KServe gRPC names the model inside the message body,
            which the local gateway does not read, so only when the gateway fronts this
            model alone.

    Raises:
        UsageError: ``model`` is not a Triton model name (exit 2: such a model cannot be
            served, so no split of it can be asked for).
    """

    model: str
    grpc: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not MODEL_NAME.fullmatch(self.model):
            raise UsageError(
                f"a traffic split cannot be scoped to model {self.model!r}: a Triton model "
                "name is letters, digits, '_', '.' and '-'",
                hint="give the model's name as Triton serves it (its repository directory)",
                key="model")

    @property
    def uri_pattern(self) -> str:
        """The ``$request_uri`` regex of its HTTP requests ('.' in a class, not escaped:
        nginx reads backslashes in a quoted string itself)."""
        return f"^/v2/models/{self.model.replace('.', '[.]')}(/|[?]|$)"

    @property
    def described(self) -> str:
        """The scope in words, for ``status`` and progress lines."""
        grpc = ("its gRPC requests too (the fleet serves no other model)" if self.grpc else
                "gRPC requests stay on production (gRPC names the model inside the body, "
                "which the gateway does not read)")
        return f"{self.model}'s HTTP requests (/v2/models/{self.model}/...); {grpc}"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "grpc": self.grpc}

    @classmethod
    def from_dict(cls, data: Any) -> SplitScope | None:
        """The scope a router reported (``to_dict``'s form), None for an unscoped split or
        a document that is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            return None
        try:
            return cls(data["model"], grpc=bool(data.get("grpc")))
        except UsageError:
            return None


#: What an unscoped split applies to (a router set by hand, or an older modelship).
UNSCOPED = "every request through the gateway, HTTP and gRPC, of every model (unscoped)"


def scope_report(scope: SplitScope | None) -> dict[str, Any]:
    """``status``'s ``traffic.scope`` for the local gateway (pure): the scope's fields and
    ``applies_to``, the requests the live weights and mirror apply to, in words."""
    if scope is None:
        return {"model": None, "grpc": True, "applies_to": UNSCOPED}
    return {**scope.to_dict(), "applies_to": scope.described}
