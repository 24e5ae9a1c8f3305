"""The progressive canary's plan (pure): which weight the candidate gets next.

``canary.traffic: progressive`` gives the candidate (on the canary Triton) a growing share
of live requests through the :class:`~modelship.traffic.port.TrafficRouter`, weight by
weight (``canary.steps``, e.g. 1 → 5 → 25 → 50 %), with the sequential judge
(:mod:`tasks.sequential`) looking between steps. This module decides, from the steps and
what the executor saw at one look (:class:`StepLook`), the next action; the executor sets
the weights, asks the judge, records each :class:`StepEvent` (ledger, Slack thread) and
sleeps between looks (the shape of :mod:`tasks.canary_plan` with :mod:`tasks.canary`).

The transitions (:func:`next_action`):

- **start**: nothing is live yet (``step`` -1): advance to the first weight.
- **router first**: the router did not answer, or reads back another split than the one
  the release set (a stuck or dead gateway): ``abort``, back to 100 % production, exit 1
  (an infrastructure failure, never the candidate's verdict).
- **breach**: the judge says ``failed``: ``step_back`` to 0 % at once, whatever the step's
  age; the canary fails (exit 4).
- **both arms fail alike**: the judge says ``inconclusive``: ``step_back`` to 0 %, exit 6.
- **minimum**: a step younger than ``canary.step_min_s`` holds, even after a pass: each
  weight is exposed for at least that long.
- **pass**: the judge shows every rule within tolerance: ``advance`` to the next weight,
  or after the last one ``swap``: the weight returns to 0 % and the atomic swap moves the
  whole fleet (the router only decides who sees the candidate before it).
- **ceiling**: a step that reaches ``canary.step_max_s`` with neither a pass nor a breach
  advances (there is no evidence against it, and the next weight brings more); at the last
  step it ends the canary inconclusive (weight 0, exit 6, no swap): a fleet is never
  swapped on a candidate that was not shown within tolerance.
- otherwise ``hold``.

Every path out of the canary (``step_back``, ``swap``, ``abort``) leaves the router at
:data:`~modelship.traffic.port.PRODUCTION_ONLY`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from modelship.errors import UsageError
from modelship.policy import CanaryPolicy, Policy
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit

__all__ = ["NOT_STARTED", "SAME_PCT", "ActionKind", "Outcome", "ProgressivePlan", "Status",
           "StepEvent", "StepLook", "TrafficAction", "expected_split", "next_action",
           "not_carried_out", "router_problem", "same_split", "step_event"]

ActionKind = Literal["advance", "hold", "step_back", "swap", "abort"]
#: The sequential judge's decision (``tasks.sequential.Status``, the same four words; not
#: imported: that module loads scipy, and ``status`` and recovery read this one).
Status = Literal["continue", "failed", "passed", "inconclusive"]
Outcome = Literal["running", "passed", "failed", "inconclusive", "infrastructure"]

#: The step index while nothing is live (before the first weight, after the way out).
NOT_STARTED = -1

#: Two shares within this many percentage points are the same split: both adapters hold
#: shares to 0.01 % (nginx's split_clients, Gateway API basis points).
SAME_PCT = 0.01

_EXIT = {"failed": 4, "inconclusive": 6, "infrastructure": 1}


@dataclass(frozen=True)
class ProgressivePlan:
    """The weights and each step's time bounds, from the policy.

    Attributes:
        steps: The candidate's share at each step, in %, strictly increasing, in (0, 100).
        min_s: The least time a step's weight is live before it may advance.
        max_s: A step's ceiling (see the module docstring).
    """

    steps: tuple[float, ...]
    min_s: float
    max_s: float

    @classmethod
    def from_policy(cls, canary: CanaryPolicy) -> ProgressivePlan:
        low, high = canary.step_bounds_s
        return cls(canary.progressive_steps, low, high)

    def weight(self, step: int) -> float:
        """The candidate's share at ``step`` (0 when nothing is live)."""
        return 0.0 if step == NOT_STARTED else self.steps[step]

    def name(self, step: int) -> str:
        """``step 2/4 (5 %)`` for messages."""
        if step == NOT_STARTED:
            return "production only"
        return f"step {step + 1}/{len(self.steps)} ({self.steps[step]:g} %)"


@dataclass(frozen=True)
class StepLook:
    """What the executor saw at one look.

    Attributes:
        step: The step whose weight the release set last (:data:`NOT_STARTED`: none).
        elapsed_s: Seconds since that weight was read back live.
        decision: The sequential judge's decision at this look; None before its first.
        live: The split the router reads back now; None when it did not answer.
        problem: Why the router did not answer, in words.
    """

    step: int
    elapsed_s: float
    decision: Status | None
    live: TrafficSplit | None
    problem: str | None = None


@dataclass(frozen=True)
class TrafficAction:
    """What to do next.

    Attributes:
        kind: ``advance``, ``hold``, ``step_back`` (to 0 %, the canary ends), ``swap``
            (weight to 0 %, then the atomic swap of the fleet) or ``abort`` (back to 100 %
            production: the router failed).
        step: The step after the action (:data:`NOT_STARTED` on every way out).
        split: The split the router must hold after the action.
        outcome: ``running`` while the steps go on; ``passed`` (swap), ``failed``,
            ``inconclusive`` or ``infrastructure`` when the canary ends.
        exit_code: The release's exit code for an ending that stops it (4, 6, 1); None
            while running and after a pass (the swap follows).
        reason: One sentence for the record and the Slack thread.
    """

    kind: ActionKind
    step: int
    split: TrafficSplit
    outcome: Outcome
    exit_code: int | None
    reason: str

    @property
    def ends(self) -> bool:
        """Whether the progressive canary is over (the router is back to production)."""
        return self.kind in ("step_back", "swap", "abort")


def expected_split(plan: ProgressivePlan, step: int) -> TrafficSplit:
    """The split the release set for ``step``: the candidate answers its weight, nothing
    is mirrored."""
    return TrafficSplit(canary_pct=plan.weight(step))


def same_split(a: TrafficSplit, b: TrafficSplit) -> bool:
    """Whether two splits are the same to the routers' precision (:data:`SAME_PCT`)."""
    return abs(a.canary_pct - b.canary_pct) <= SAME_PCT + 1e-9 \
        and abs(a.mirror_pct - b.mirror_pct) <= SAME_PCT + 1e-9


def _pct(split: TrafficSplit) -> str:
    mirror = f", mirror {split.mirror_pct:g} %" if split.mirror_pct else ""
    return f"canary {split.canary_pct:g} %{mirror}"


def router_problem(expected: TrafficSplit, live: TrafficSplit | None,
                   problem: str | None = None) -> str | None:
    """Why the router cannot be trusted with the release's traffic, or None (pure): it did
    not answer, or it holds another split than the one set (stuck). Shared by every mode
    (shadow checks its mirror share the same way)."""
    if live is None:
        return f"the traffic router did not answer ({problem or 'no reason given'})"
    if not same_split(expected, live):
        return (f"the traffic router is stuck: it holds {_pct(live)}, the release set "
                f"{_pct(expected)}")
    return None


def _out(kind: ActionKind, outcome: Outcome, reason: str) -> TrafficAction:
    return TrafficAction(kind, NOT_STARTED, PRODUCTION_ONLY, outcome, _EXIT.get(outcome),
                         reason)


def _to(plan: ProgressivePlan, step: int, kind: ActionKind, reason: str) -> TrafficAction:
    return TrafficAction(kind, step, expected_split(plan, step), "running", None, reason)


def next_action(plan: ProgressivePlan, look: StepLook) -> TrafficAction:
    """The next action after ``look`` (pure; the transitions are in the module docstring)."""
    if not plan.steps:
        raise ValueError("a progressive plan needs at least one step")
    trouble = router_problem(expected_split(plan, look.step), look.live, look.problem)
    if trouble is not None:
        return _out("abort", "infrastructure",
                    f"{trouble} at {plan.name(look.step)}; weights back to 100 % production "
                    "(an infrastructure failure, not the candidate's)")
    if look.step == NOT_STARTED:
        return _to(plan, 0, "advance", f"starting: {plan.name(0)}")
    here, last = plan.name(look.step), look.step == len(plan.steps) - 1
    age = f"after {look.elapsed_s:.0f} s"
    if look.decision == "failed":
        return _out("step_back", "failed",
                    f"breach at {here} {age}: weight back to 0 %; the candidate is rejected")
    if look.decision == "inconclusive":
        return _out("step_back", "inconclusive",
                    f"both versions failed alike at {here} {age} (not the candidate's "
                    "doing): weight back to 0 %; inconclusive")
    if look.elapsed_s < plan.min_s:
        return _to(plan, look.step, "hold", f"{here}: {age}, the minimum is "
                   f"{plan.min_s:g} s")
    if look.decision == "passed":
        if last:
            return _out("swap", "passed", f"{here} passed {age}: weight back to 0 %, then "
                        "the atomic swap of the fleet")
        return _to(plan, look.step + 1, "advance",
                   f"{here} passed {age}: {plan.name(look.step + 1)}")
    if look.elapsed_s >= plan.max_s:
        if last:
            return _out("step_back", "inconclusive",
                        f"{here} reached its ceiling ({plan.max_s:g} s) without showing the "
                        "candidate within tolerance: weight back to 0 %; no swap")
        return _to(plan, look.step + 1, "advance",
                   f"{here} reached its ceiling ({plan.max_s:g} s) with no breach: "
                   f"{plan.name(look.step + 1)}")
    return _to(plan, look.step, "hold", f"{here}: {age}, the judge says continue")


@dataclass(frozen=True)
class StepEvent:
    """One transition, as the ledger and the Slack thread keep it (:meth:`to_dict` is
    JSON as it is).

    Attributes:
        at: When it was decided (ISO 8601, UTC).
        action: The action's kind.
        step, weight_pct: The step and the candidate's share after it.
        from_step, from_weight_pct: Before it.
        decision: The judge's decision it acted on (None before the first look).
        elapsed_s: The age of the step it acted on.
        live: What the router read back before it (None: it did not answer).
        outcome, exit_code, reason: As in :class:`TrafficAction`.
    """

    at: str
    action: ActionKind
    step: int
    weight_pct: float
    from_step: int
    from_weight_pct: float
    decision: Status | None
    elapsed_s: float
    live: TrafficSplit | None
    outcome: Outcome
    exit_code: int | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "action": self.action, "step": self.step,
                "weight_pct": self.weight_pct, "from_step": self.from_step,
                "from_weight_pct": self.from_weight_pct, "decision": self.decision,
                "elapsed_s": round(self.elapsed_s, 3),
                "live": None if self.live is None else self.live.to_dict(),
                "outcome": self.outcome, "exit_code": self.exit_code, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepEvent:
        live = data.get("live")
        return cls(at=data["at"], action=data["action"], step=int(data["step"]),
                   weight_pct=float(data["weight_pct"]), from_step=int(data["from_step"]),
                   from_weight_pct=float(data["from_weight_pct"]),
                   decision=data.get("decision"), elapsed_s=float(data["elapsed_s"]),
                   live=None if live is None else TrafficSplit(
                       canary_pct=float(live["canary_pct"]),
                       mirror_pct=float(live["mirror_pct"])),
                   outcome=data["outcome"], exit_code=data.get("exit_code"),
                   reason=data["reason"])

    def line(self) -> str:
        """One line for the Slack thread and the progress output."""
        return (f"progressive: {self.action} {self.from_weight_pct:g} % -> "
                f"{self.weight_pct:g} %: {self.reason}")


def step_event(plan: ProgressivePlan, look: StepLook, action: TrafficAction, *,
               at: str) -> StepEvent:
    """The record of ``action`` taken after ``look`` (pure; ``at`` is the caller's clock)."""
    return StepEvent(at=at, action=action.kind, step=action.step,
                     weight_pct=action.split.canary_pct, from_step=look.step,
                     from_weight_pct=plan.weight(look.step), decision=look.decision,
                     elapsed_s=look.elapsed_s, live=look.live, outcome=action.outcome,
                     exit_code=action.exit_code, reason=action.reason)


def not_carried_out(policy: Policy, *, bake: bool = True) -> UsageError | None:
    """The refusal of a policy whose live-traffic keys the caller does not carry out,
    naming each key (pure; None when every key is carried out). Running such a release as
    a replay canary would silently mean something else than the policy says.

    A promotion (``bake=True``) carries out every key: ``canary.traffic: shadow``
    (:func:`tasks.shadow.run_shadow`), ``progressive`` (:func:`tasks.progressive.live_canary`)
    and ``bake.holdback_pct`` (:mod:`tasks.holdback`). A standalone canary (``bake=False``)
    replays golden rows only: every mode but ``replay`` is refused there (it has no bake,
    so a holdback does not concern it).

    Args:
        bake: Whether the caller is a promotion (canary and bake); False: a standalone
            canary.
    """
    keys = []
    if not bake and policy.canary.traffic != "replay":
        keys.append(f"canary.traffic: {policy.canary.traffic}")
    if not keys:
        return None
    where = "a promotion" if bake else "a standalone canary (it replays golden rows)"
    return UsageError(
        f"the policy asks for live traffic ({', '.join(keys)}), which {where} does not "
        "carry out",
        hint="use canary.traffic: replay (the default) here; `modelship promote` carries "
        "out shadow, progressive and bake.holdback_pct",
        keys=[k.split(":")[0] for k in keys])
