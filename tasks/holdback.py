"""The bake with a concurrent control (issue 20 item 4, ``bake.holdback_pct``).

After the swap the fleet serves the new version. The canary Triton loads the **previous**
version alone, and the router sends it ``holdback_pct`` % of live requests. The bake
(:func:`tasks.bake.watch` with a :class:`~tasks.bake.Holdback`) then probes the fleet and
the holdback in the same runs, window by window, and judges the fleet's latency against
the holdback's windows of the same time (a :class:`~tasks.bake.Reference` of kind
``holdback``): a surge or a noisy neighbour reaches both, so it is not blamed on the new
version, and no window is held for load. Errors are judged on the fleet as always.

The holdback's weight is written to the record before the router changes and returns to
0 % when the bake ends, on every path (:func:`tasks.traffic_state.holding`): a breach
(before the fleet is rolled back), an error, a signal. All of it runs inside the canary
slot, so recovery and reconcile know the split's live owner.

**Load per server.** The holdback's server carries ``holdback_pct`` % of live traffic and
each replica ``(100 - holdback_pct) / replicas`` %: the comparison is fair for what both
share (the machine, the same requests' mix, the same moment). Queueing that grows with a
server's own load is matched only when the shares per server are close (``holdback_pct``
≈ ``100 / (replicas + 1)``).

Without a previous version (a first release) there is nothing to hold back: the bake runs
as before, with a note.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from modelship.clients import Clients
from modelship.locks import CANARY_SLOT_WAIT_S, canary_slot
from modelship.policy import Policy
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.traffic.port import TrafficSplit
from tasks import bake as baking
from tasks.live_traffic import canary_and_router, serving_on_canary
from tasks.traffic_state import holding

__all__ = ["holdback_applies", "holdback_watch"]


def holdback_applies(policy: Policy, previous: int | None) -> bool:
    """Whether the bake runs with a holdback (pure): a share is asked for, the bake runs,
    and a previous version exists to hold back."""
    return policy.bake.holdback_pct > 0 and policy.bake.duration_s > 0 \
        and previous is not None


def holdback_watch(settings: Settings, clients: Clients, policy: Policy, *, model: str,
                   version: int, previous: int, payload: Mapping[str, np.ndarray],
                   write: Callable[[dict[str, Any]], None],
                   traffic: Mapping[str, Any] | None = None,
                   progress: Progress = quiet) -> baking.BakeReport:
    """Bake ``version`` against ``previous`` held back on the canary Triton (see the
    module docstring); the router is back at 100 % production when this returns or
    raises, and ``previous`` is unloaded from the canary.

    Raises:
        UsageError: no router or no canary Triton (exit 2).
        InfrastructureError: the router did not take the holdback (dead or stuck), or the
            previous version did not load on the canary (exit 1).
    """
    server, router = canary_and_router(settings, clients, what="bake.holdback_pct",
                                       model=model, progress=progress)
    share = TrafficSplit(canary_pct=policy.bake.holdback_pct)
    with canary_slot(clients.storage, model=model, progress=progress,
                     owner=f"holdback of {model} v{previous} (bake of v{version})",
                     wait_s=CANARY_SLOT_WAIT_S), \
            serving_on_canary(settings, clients, server, model=model, version=previous,
                              progress=progress), \
            holding(router, share, write=write, traffic=traffic, progress=progress):
        return baking.watch(clients.replicas, model=model, version=version, payload=payload,
                            policy=policy.bake, baseline=None,
                            timeout_s=settings.http_timeout_s, progress=progress,
                            holdback=baking.Holdback(server, previous))
