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

**The share is read back after every window** (:func:`holdback_look`, pure; docs/gateway.md
"A holdback share that changes mid-bake"). A window the router did not carry the share
through is no control (the holdback's load, hence its queueing, was not the release's), so
it is held, never judged. What the bake does then:

- the router holds another split (changed by hand, or the gateway restarted at production
  only): the share is **restored once** (after checking that the canary still serves the
  previous version, else live requests sent there would fail) and the bake goes on;
- it changes **again**, the router does not answer (a dead gateway), the restore does not
  take, or the canary no longer serves the previous version: the bake fails as
  infrastructure (exit 1) and the weights return to 100 % production on the way out; the
  release, not past its point of no return, is then undone (the previous version serves
  again) like any failure during the bake.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from modelship.clients import Clients
from modelship.errors import InfrastructureError
from modelship.locks import CANARY_SLOT_WAIT_S, canary_slot
from modelship.policy import Policy
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.traffic.port import TrafficRouter, TrafficSplit
from modelship.triton.client import TritonServer
from tasks import bake as baking
from tasks.live_traffic import canary_and_router, serving_on_canary
from tasks.traffic_plan import router_problem, same_split
from tasks.traffic_state import holding, read_live

__all__ = ["MAX_RESTORES", "HoldbackLook", "holdback_applies", "holdback_look",
           "holdback_watch", "share_keeper"]

#: Restores of a changed holdback share in one bake before it fails: one is a gateway that
#: restarted or a hand that changed it; a second change is something steering the router
#: against the release.
MAX_RESTORES = 1


@dataclass(frozen=True)
class HoldbackLook:
    """What the bake does after reading the router back at a window's end.

    ``ok``: the share held. ``restore``: set it again and hold this window (``reason``
    says why it is no control). ``fail``: infrastructure (exit 1), weights back to 100 %
    production."""

    kind: Literal["ok", "restore", "fail"]
    reason: str | None = None


def _split_text(split: TrafficSplit) -> str:
    mirror = f", {split.mirror_pct:g} % mirrored" if split.mirror_pct else ""
    return f"{split.canary_pct:g} % to the canary{mirror}"


def holdback_look(share: TrafficSplit, live: TrafficSplit | None, problem: str | None, *,
                  window: int, restores: int) -> HoldbackLook:
    """The decision after window ``window`` (pure; the rules are in the module doc).

    Args:
        share: What the release set (``bake.holdback_pct`` to the canary, no mirror).
        live: What the router answered with, None when it did not answer (``problem``).
        restores: Restores already made in this bake.
    """
    if live is not None and same_split(share, live):
        return HoldbackLook("ok")
    if live is None:
        return HoldbackLook("fail", f"window {window}: {router_problem(share, live, problem)}"
                            "; the holdback cannot be kept (a dead or stuck gateway)")
    changed = (f"window {window}: the router held {_split_text(live)}, not the holdback's "
               f"{_split_text(share)} (changed by another hand, or the gateway restarted "
               "without it)")
    if restores >= MAX_RESTORES:
        return HoldbackLook("fail", f"{changed}, after {restores} restore"
                            f"{'s' if restores != 1 else ''} already: something else steers "
                            "the router; the bake cannot keep its control")
    return HoldbackLook("restore", f"{changed}: the share is restored and this window is "
                        "held (not judged: the holdback did not carry its share through it)")


def share_keeper(router: TrafficRouter, share: TrafficSplit, server: TritonServer, *,
                 model: str, previous: int, progress: Progress) -> Callable[[int], str | None]:
    """The bake's per-window check (:class:`tasks.bake.Holdback` ``check``): reads the
    router back, restores a changed share once, raises InfrastructureError otherwise (the
    ``holding`` block around the bake then returns the weights to production)."""
    restores = 0

    def check(index: int) -> str | None:
        nonlocal restores
        live, problem = read_live(router)
        look = holdback_look(share, live, problem, window=index, restores=restores)
        if look.kind == "ok":
            return None
        reason = look.reason or ""
        hint = ("check the gateway (`modelship stack status`, `modelship doctor`) and who "
                "else steers it, then promote again")
        if look.kind == "fail":
            raise InfrastructureError(f"{reason}; the weights return to 100 % production",
                                      hint=hint, component=router.name, model=model)
        try:
            served = server.is_model_ready(model, str(previous))
        except Exception:  # noqa: BLE001 - a canary that does not answer does not serve it
            served = False
        if not served:
            raise InfrastructureError(
                f"{reason}; not restored: the canary {server.name} no longer serves "
                f"{model} v{previous} (restarted?), so live requests sent there would fail; "
                "the weights return to 100 % production", hint=hint,
                component=router.name, model=model)
        progress(f"holdback: restoring {_split_text(share)} on {router.name}")
        router.set_weights(share.canary_pct)
        router.mirror(share.mirror_pct)
        after, problem = read_live(router)
        trouble = router_problem(share, after, problem)
        if trouble is not None:
            raise InfrastructureError(f"{reason}; the restore did not take ({trouble}); the "
                                      "weights return to 100 % production", hint=hint,
                                      component=router.name, model=model)
        restores += 1
        return reason

    return check


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
        InfrastructureError: the router did not take the holdback (dead or stuck), lost it
            mid-bake and it could not be kept (:func:`holdback_look`), or the previous
            version did not load on the canary (exit 1).
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
        check = share_keeper(router, share, server, model=model, previous=previous,
                        progress=progress)
        return baking.watch(clients.replicas, model=model, version=version, payload=payload,
                            policy=policy.bake, baseline=None,
                            timeout_s=settings.http_timeout_s, progress=progress,
                            holdback=baking.Holdback(server, previous, check))
