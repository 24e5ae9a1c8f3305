"""The progressive canary's executor: the plan (:mod:`tasks.traffic_plan`) carried out on a
:class:`~modelship.traffic.port.TrafficRouter`, one look at a time.

At each look it reads the router back, asks the judge about the live step, and does what
:func:`tasks.traffic_plan.next_action` says. Every transition is written to the release's
record **before** the router changes (``ReleaseRecord.traffic``: the split it is about to
set, and the :class:`~tasks.traffic_plan.StepEvent`), so a killed run leaves the split
where the next command finds and restores it (:mod:`tasks.traffic_state`). Every way out
(a breach, inconclusive, the hand-over to the swap, a stuck or dead router, a signal or an
error of the judge) returns the router to 100 % production.

:func:`live_canary` is promote's canary and gates stages under ``canary.traffic:
progressive``: the candidate alone on the canary Triton, the steps through the configured
router, the judge on the per-version server-side metrics of the live requests each version
served (:mod:`tasks.live_judge`), then the verdict (a pass goes on to the atomic swap).
Latency is judged only at steps where the canary server carries at most a replica's load
(:func:`tasks.traffic_plan.latency_judged`, with the fleet's replica count); errors at every
step. The plan's per-step loads are in the canary stage's details before the first step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modelship.candidate import ReleaseCandidate
from modelship.clients import Clients
from modelship.errors import GateFailed, GatesInconclusive, InfrastructureError, ModelshipError
from modelship.ledger import now_iso
from modelship.locks import CANARY_SLOT_WAIT_S, canary_slot
from modelship.policy import Policy
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.traffic.port import PRODUCTION_ONLY, TrafficRouter
from modelship.triton.client import TritonServer
from modelship.triton.metrics import Scrape
from tasks.live_judge import LiveJudge, LiveRules, arm_look
from tasks.live_traffic import canary_and_router, scrape_servers, serving_on_canary
from tasks.record import ReleaseJournal
from tasks.traffic_plan import (
    NOT_STARTED,
    ProgressivePlan,
    Status,
    StepEvent,
    StepLook,
    TrafficAction,
    load_words,
    next_action,
    step_event,
    step_loads,
)
from tasks.traffic_state import read_live, return_to_production, traffic_intent, with_event

__all__ = ["LOOK_S", "LiveEvidence", "Progressive", "ProgressiveResult", "live_canary",
           "replay_policy", "run_progressive"]

#: Seconds between two looks of the live canary (one block of evidence each).
LOOK_S = 0.5


@dataclass(frozen=True)
class ProgressiveResult:
    """How the progressive canary ended: the last action (``swap``: go on to the atomic
    swap; ``step_back``: the canary failed or was inconclusive, see its exit code), the
    record's ``traffic`` document, and the seconds from the look that decided it to the
    router read back at 100 % production (the record written and the weight set)."""

    action: TrafficAction
    traffic: dict[str, Any]
    to_production_s: float | None = None


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
            decided = run.clock()
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
    return ProgressiveResult(action, traffic, run.clock() - decided)


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


# --------------------------------------------------------------------------------------
# promote's canary under canary.traffic: progressive


class LiveEvidence:
    """The judge's I/O: at each look, what the candidate served on the canary Triton and
    production on the replicas since the previous look (one scrape of each server).
    ``latency(step)``: whether the step's looks count for latency (the plan's per-server
    load rule); every step's count for errors."""

    def __init__(self, canary: TritonServer, replicas: list[TritonServer], *, model: str,
                 candidate: int, production: int, judge: LiveJudge, timeout_s: float,
                 latency: Callable[[int], bool] = lambda _step: True) -> None:
        self.canary, self.replicas, self.model = canary, replicas, model
        self.latency = latency
        self.candidate, self.production = candidate, production
        self.live, self.timeout_s = judge, timeout_s
        self.before = self._scrape()

    def _scrape(self) -> tuple[dict[str, Scrape], dict[str, Scrape]]:
        found, failed = scrape_servers([self.canary, *self.replicas], self.timeout_s)
        if failed:
            who = "; ".join(f"{k}: {v}" for k, v in failed.items())
            raise InfrastructureError(f"the live canary could not read Triton's metrics "
                                      f"({who})", hint="check the servers (`modelship "
                                      "doctor`), then promote again")
        canary = {self.canary.name: found[self.canary.name]}
        return canary, {k: v for k, v in found.items() if k != self.canary.name}

    def __call__(self, step: int) -> Status:
        after = self._scrape()
        c = arm_look(self.before[0], after[0], model=self.model, version=self.candidate)
        p = arm_look(self.before[1], after[1], model=self.model, version=self.production)
        self.before = after
        return self.live.update(c, p, latency=self.latency(step)).status


def live_canary(settings: Settings, clients: Clients, policy: Policy,
                journal: ReleaseJournal, *, serving: int, release: ReleaseCandidate,
                progress: Progress = quiet) -> ProgressiveResult:
    """The ``canary`` and ``gates`` stages of a progressive release (see the module
    docstring); every step is an event of the record's ``traffic`` (the ledger) and a line
    of the Slack thread. Returns after a pass (the atomic swap follows).

    Raises:
        UsageError: no router or no canary Triton (exit 2).
        GateFailed: a breach: the weight went back to 0 % at once (exit 4).
        GatesInconclusive: both versions failed alike, or the last step reached its
            ceiling without the candidate shown within tolerance (exit 6).
        InfrastructureError: a dead or stuck router (weights back to 100 % production),
            or the servers' metrics unreadable (exit 1).
    """
    record = journal.record
    model, version = record.model, int(record.to_version or 0)
    server, router = canary_and_router(settings, clients, what="canary.traffic: progressive",
                                       model=model, progress=progress)
    plan = ProgressivePlan.from_policy(policy.canary, replicas=len(clients.replicas))
    loads = step_loads(plan)
    judge = LiveJudge(LiveRules.from_policy(policy))

    def write(doc: dict[str, Any]) -> None:
        record.traffic = doc
        journal.save()

    with journal.stage("canary") as entry:
        entry.details.update(mode="progressive", router=router.name,
                             steps=list(plan.steps), step_min_s=plan.min_s,
                             step_max_s=plan.max_s, step_loads=loads)
        for i in range(len(plan.steps)):
            progress(f"progressive: {plan.name(i)}: {load_words(plan.load(i))}")
        if loads["warning"]:
            progress(f"progressive: {loads['warning']}")
        with canary_slot(clients.storage, model=model, progress=progress,
                         owner=f"progressive canary of {model} v{version}",
                         wait_s=CANARY_SLOT_WAIT_S), \
                serving_on_canary(settings, clients, server, model=model, version=version,
                                  config_pbtxt=release.config_pbtxt, progress=progress):
            evidence = LiveEvidence(server, list(clients.replicas), model=model,
                                     candidate=version, production=serving, judge=judge,
                                     timeout_s=settings.http_timeout_s,
                                     latency=plan.latency_judged)
            try:
                result = run_progressive(Progressive(
                    plan, router, evidence, write, look_s=LOOK_S, progress=progress,
                    announce=lambda event: journal.thread.reply(event.line(), _section(
                        event.line()))))
            finally:
                entry.details["judge"] = judge.decision.to_dict()
        entry.details["outcome"] = result.action.outcome
        entry.details["verdict"] = result.action.reason
        entry.details["to_production_s"] = result.to_production_s
    record.gates = {"verdict": "passed" if result.action.outcome == "passed"
                    else result.action.outcome, "mode": "progressive",
                    "judge": judge.decision.to_dict()}
    with journal.stage("gates"):
        _verdict(model, version, result.action, judge.decision.reason)
    return result


def replay_policy(policy: Policy) -> Policy:
    """``policy`` with a replay canary (pure): a first release under ``progressive`` has no
    production version to share live traffic with, so the replay canary judges it."""
    canary = policy.canary.model_copy(update={"traffic": "replay", "steps": None,
                                              "step_min_s": None, "step_max_s": None})
    return policy.model_copy(update={"canary": canary})


def _section(text: str) -> list[dict[str, Any]]:
    return [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]


def _verdict(model: str, version: int, action: TrafficAction, evidence: str) -> None:
    """Raise the release's error for a step back (with the judge's ``evidence``); nothing
    after a pass."""
    if action.outcome == "failed":
        raise GateFailed(f"the progressive canary of {model} v{version} failed on live "
                         f"traffic: {action.reason} ({evidence})",
                         hint="production serves as before (the weight went back to 0 %); "
                         f"read the steps in `modelship history {model}`", model=model)
    if action.outcome == "inconclusive":
        raise GatesInconclusive(f"the progressive canary of {model} v{version} could not "
                                f"decide on live traffic: {action.reason} ({evidence})",
                                hint="more live traffic, or a larger canary.step_max_s",
                                model=model)
