"""The progressive canary's executor: the plan (:mod:`tasks.traffic_plan`) carried out on a
:class:`~modelship.traffic.port.TrafficRouter`, one look at a time.

At each look it reads the router back, asks the judge about the live step, and does what
:func:`tasks.traffic_plan.next_action` says. Every transition is written to the release's
record **before** the router changes (``ReleaseRecord.traffic``: the split it is about to
set, and the :class:`~tasks.traffic_plan.StepEvent`), so a killed run leaves the split
where the next command finds and restores it (:mod:`tasks.traffic_state`). Every way out
(a breach, inconclusive, the hand-over to the swap, a stuck or dead router, a signal or an
error of the judge) returns the router to 100 % production.

Not wired into ``promote`` yet: the judge on live traffic (per-version server metrics
through the gateway) is the canary's part.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modelship.errors import InfrastructureError, ModelshipError
from modelship.ledger import now_iso
from modelship.progress import Progress, quiet
from modelship.traffic.port import PRODUCTION_ONLY, TrafficRouter
from tasks.traffic_plan import (
    NOT_STARTED,
    ProgressivePlan,
    Status,
    StepEvent,
    StepLook,
    TrafficAction,
    next_action,
    step_event,
)
from tasks.traffic_state import read_live, return_to_production, traffic_intent, with_event

__all__ = ["Progressive", "ProgressiveResult", "run_progressive"]


@dataclass(frozen=True)
class ProgressiveResult:
    """How the progressive canary ended: the last action (``swap``: go on to the atomic
    swap; ``step_back``: the canary failed or was inconclusive, see its exit code) and the
    record's ``traffic`` document."""

    action: TrafficAction
    traffic: dict[str, Any]


@dataclass
class Progressive:
    """What one progressive canary needs.

    Attributes:
        plan: The weights and step bounds.
        router: The data plane's router.
        judge: ``judge(step)``: the sequential judge's decision on the live requests of the
            candidate and production since ``step``'s weight went live.
        write: Puts the ``traffic`` document on the release's record and writes it.
        look_s: Seconds between looks.
        announce: Receives each transition (the Slack thread); None: none.
    """

    plan: ProgressivePlan
    router: TrafficRouter
    judge: Callable[[int], Status | None]
    write: Callable[[dict[str, Any]], None]
    look_s: float = 1.0
    announce: Callable[[StepEvent], None] | None = None
    progress: Progress = quiet
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    now: Callable[[], str] = now_iso


def run_progressive(run: Progressive) -> ProgressiveResult:
    """Carry out the plan until it ends (see the module docstring).

    Raises:
        InfrastructureError: the router did not answer, is stuck, or could not be returned
            to production (exit 1); the weights were returned to production where it
            answered. Anything the judge or a signal raises goes on up, after the weights
            were returned to production.
    """
    traffic: dict[str, Any] = {}
    step, since = NOT_STARTED, run.clock()
    try:
        while True:
            live, problem = read_live(run.router)
            decision = None if step == NOT_STARTED else run.judge(step)
            look = StepLook(step, run.clock() - since, decision, live, problem)
            action = next_action(run.plan, look)
            if action.kind != "hold":
                traffic = _record(run, traffic, action,
                                  step_event(run.plan, look, action, at=run.now()))
            if action.ends:
                break
            if action.kind == "advance":
                _set_weight(run, action)
                step, since = action.step, run.clock()
            run.sleep(run.look_s)
    except BaseException as exc:
        _production_on_the_way_out(run, traffic, exc)
        raise
    _leave(run, action)
    return ProgressiveResult(action, traffic)


def _record(run: Progressive, traffic: dict[str, Any], action: TrafficAction,
            event: StepEvent) -> dict[str, Any]:
    """Write the transition, and the split it sets, before the router changes."""
    doc = with_event(traffic_intent(traffic, router=run.router.name, split=action.split,
                                    at=event.at), event)
    run.write(doc)
    run.progress(event.line())
    if run.announce is not None:
        run.announce(event)
    return doc


def _set_weight(run: Progressive, action: TrafficAction) -> None:
    """Set the next weight; a failure is left to the next look, which reads the router
    back and aborts on what it finds (a dead or stuck router)."""
    try:
        run.router.set_weights(action.split.canary_pct)
    except Exception as exc:  # noqa: BLE001 - the read-back at the next look decides
        why = exc.message if isinstance(exc, ModelshipError) else f"{type(exc).__name__}: {exc}"
        run.progress(f"progressive: setting {action.split.canary_pct:g} % failed: {why}")


def _leave(run: Progressive, action: TrafficAction) -> None:
    """The way out: the router back to production; an abort is an infrastructure failure
    (exit 1) even when the router answers again."""
    try:
        return_to_production(run.router)
    except ModelshipError as exc:
        raise InfrastructureError(
            f"{action.reason}; and the router could not be returned to 100 % production: "
            f"{exc.message}",
            hint="bring the gateway back (`modelship doctor`); the next modelship command "
            "returns it to production", component=run.router.name) from exc
    if action.kind == "abort":
        raise InfrastructureError(action.reason, hint="check the gateway (`modelship "
                                  "doctor`), then promote again", component=run.router.name)


def _production_on_the_way_out(run: Progressive, traffic: dict[str, Any],
                               exc: BaseException) -> None:
    """A signal or an error stopped the steps: write production as the intent, then return
    the router to it; what fails here is said, and the original exception goes on (the next
    command restores the router from the record)."""
    why = f"stopped by {type(exc).__name__}: weights back to 100 % production"
    try:
        run.write(traffic_intent(traffic, router=run.router.name, split=PRODUCTION_ONLY,
                                 at=run.now()))
    except Exception as failed:  # noqa: BLE001 - the router matters more than the record
        run.progress(f"progressive: the record could not say production ({failed})")
    try:
        return_to_production(run.router)
        run.progress(f"progressive: {why}")
    except Exception as failed:  # noqa: BLE001 - the original exception is the error
        run.progress(f"progressive: {why} FAILED ({failed}); the next modelship command "
                     "restores it")
