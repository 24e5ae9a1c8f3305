"""An in-memory :class:`~modelship.traffic.port.TrafficRouter` for unit tests.

It holds a split, logs every call, and can play the two infrastructure failures the
release must survive: a dead router (every call raises ``Unreachable``, exit 1) and a stuck
one (calls succeed but nothing changes, so what it reads back is not what was set).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelship.errors import Unreachable
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit


@dataclass
class FakeRouter:
    """A router in memory.

    Attributes:
        split: What it holds now.
        dead: Every call raises ``Unreachable``.
        stuck: Writes succeed and change nothing.
        calls: ``("set_weights", pct)``, ``("mirror", pct)``, ``("live",)`` in order.
    """

    split: TrafficSplit = PRODUCTION_ONLY
    dead: bool = False
    stuck: bool = False
    name: str = "fake-router"
    calls: list[tuple[object, ...]] = field(default_factory=list)

    def _answer(self) -> None:
        if self.dead:
            raise Unreachable("the fake router does not answer (connection refused)",
                              hint="start it", component=self.name)

    def set_weights(self, canary_pct: float) -> None:
        self.calls.append(("set_weights", canary_pct))
        self._answer()
        if not self.stuck:
            self.split = TrafficSplit(canary_pct=canary_pct, mirror_pct=self.split.mirror_pct)

    def mirror(self, share_pct: float) -> None:
        self.calls.append(("mirror", share_pct))
        self._answer()
        if not self.stuck:
            self.split = TrafficSplit(canary_pct=self.split.canary_pct, mirror_pct=share_pct)

    def live(self) -> TrafficSplit:
        self.calls.append(("live",))
        self._answer()
        return self.split

    @property
    def writes(self) -> list[tuple[object, ...]]:
        """The calls that change the router."""
        return [c for c in self.calls if c[0] != "live"]
