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

**Per-server load** (:func:`server_load`). The one canary Triton serves the candidate's
share ``w`` of the model's live requests alone; each of the ``N`` replicas serves
``(1 - w)/N``. So the canary server carries ``w·N/(1 - w)`` times a replica's load: with
2 replicas, 0.1× at 5 %, 0.67× at 25 %, **2×** at 50 %. A server's latency grows with its
load, without bound as it nears saturation (queueing time ~ 1/(1 - utilisation)), so at a
step above equal load a good model can look slower only because its server is busier: the
complaint about real traffic ("a good model rolled back because the morning traffic
arrived"). The rule (:func:`latency_judged`): **latency is judged only at steps where the
canary server carries at most a replica's load**; errors are judged at every step (they
do not depend on load). No multiplier of the gap would be conservative past equal load
(the canary may be past saturation while the replicas are at 60 %), so none is used: a
slow candidate is stepped back at the first step of fair load, where its looks count
(one e-process over every judged look); a plan with no step of fair load cannot show the
candidate within the latency tolerance, so it ends inconclusive (exit 6, no swap), and
the plan (``--dry-run``, the canary stage's details) says so before any step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from modelship.errors import UsageError
from modelship.policy import CanaryPolicy, Policy
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit

__all__ = ["EQUAL_LOAD", "NOT_STARTED", "SAME_PCT", "ActionKind", "Outcome", "ProgressivePlan",
           "Status", "StepEvent", "StepLook", "TrafficAction", "expected_split",
           "latency_judged", "load_words", "next_action", "not_carried_out",
           "router_problem", "same_split", "server_load", "step_event", "step_loads"]

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

#: The canary server's load relative to a replica's up to which latency is judged (equal
#: load; the routers' 0.01-point precision is far inside the tolerance below).
EQUAL_LOAD = 1.0
_LOAD_SLACK = 1e-6


def server_load(weight_pct: float, replicas: int) -> float | None:
    """The canary server's per-server load relative to one replica's (pure): the canary
    serves ``w`` of the model's live requests alone, each of the ``replicas`` serves
    ``(1 - w)/replicas``, so ``w·N/(1 - w)``. None when ``replicas`` is unknown (< 1);
    ``inf`` at 100 %; 0 at 0 %."""
    if replicas < 1:
        return None
    w = weight_pct / 100.0
    if w >= 1.0:
        return float("inf")
    return max(w, 0.0) * replicas / (1.0 - w)


def latency_judged(load: float | None) -> bool:
    """Whether latency is judged at a step whose canary server carries ``load`` times a
    replica's load (pure): at most :data:`EQUAL_LOAD`; an unknown load is judged (the
    behaviour without the replicas' count)."""
    return load is None or load <= EQUAL_LOAD + _LOAD_SLACK


def load_words(load: float | None) -> str:
    """``canary server at 2.00× a replica's load: latency not judged`` (pure)."""
    if load is None:
        return "canary server's load unknown: latency judged"
    judged = "latency judged" if latency_judged(load) else \
        "latency NOT judged (above equal load; errors still are)"
    return f"canary server at {load:.2f}× a replica's load: {judged}"


@dataclass(frozen=True)
class ProgressivePlan:
    """The weights and each step's time bounds, from the policy.

    Attributes:
        steps: The candidate's share at each step, in %, strictly increasing, in (0, 100).
        min_s: The least time a step's weight is live before it may advance.
        max_s: A step's ceiling (see the module docstring).
        replicas: The production replicas sharing the rest of the live requests (0:
            unknown; then every step's latency is judged).
    """

    steps: tuple[float, ...]
    min_s: float
    max_s: float
    replicas: int = 0

    @classmethod
    def from_policy(cls, canary: CanaryPolicy, replicas: int = 0) -> ProgressivePlan:
        low, high = canary.step_bounds_s
        return cls(canary.progressive_steps, low, high, replicas)

    def load(self, step: int) -> float | None:
        """The canary server's load relative to a replica's at ``step``
        (:func:`server_load`); 0 when nothing is live."""
        return server_load(self.weight(step), self.replicas)

    def latency_judged(self, step: int) -> bool:
        """Whether the judge counts ``step``'s looks for latency (:func:`latency_judged`)."""
        return latency_judged(self.load(step))

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


def step_loads(plan: ProgressivePlan) -> dict[str, Any]:
    """The plan's per-server load, step by step, for ``--dry-run`` and the canary stage's
    details (pure; JSON as it is): each step's weight, the canary server's load relative to
    a replica's, whether latency is judged there and whether it is above equal load; and a
    warning when no step is of fair load (the canary then cannot pass on latency)."""
    steps = []
    for i, weight in enumerate(plan.steps):
        load = plan.load(i)
        steps.append({"weight_pct": weight,
                      "load_ratio": None if load is None else round(load, 4),
                      "latency_judged": latency_judged(load),
                      "above_equal_load": not latency_judged(load)})
    warning = None
    if plan.steps and not any(s["latency_judged"] for s in steps):
        warning = (f"no step leaves the canary server at or below a replica's load (with "
                   f"{plan.replicas} replicas): latency is judged at no step, so the canary "
                   "ends inconclusive (no swap); add a step of at most "
                   f"{100.0 / (1 + plan.replicas):.3g} %")
    return {"replicas": plan.replicas, "steps": steps, "warning": warning}


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
        load_ratio: The canary server's load relative to a replica's after it (0 when
            nothing is live; None: the replicas' count unknown).
        latency_judged: Whether the judge counts latency at the step after it.
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
    load_ratio: float | None = None
    latency_judged: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "action": self.action, "step": self.step,
                "weight_pct": self.weight_pct, "from_step": self.from_step,
                "from_weight_pct": self.from_weight_pct, "decision": self.decision,
                "elapsed_s": round(self.elapsed_s, 3),
                "live": None if self.live is None else self.live.to_dict(),
                "outcome": self.outcome, "exit_code": self.exit_code, "reason": self.reason,
                "load_ratio": None if self.load_ratio is None else round(self.load_ratio, 4),
                "latency_judged": self.latency_judged}

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
                   reason=data["reason"], load_ratio=data.get("load_ratio"),
                   latency_judged=bool(data.get("latency_judged", True)))

    def line(self) -> str:
        """One line for the Slack thread and the progress output."""
        load = "" if self.step == NOT_STARTED else f" [{load_words(self.load_ratio)}]"
        return (f"progressive: {self.action} {self.from_weight_pct:g} % -> "
                f"{self.weight_pct:g} %: {self.reason}{load}")


def step_event(plan: ProgressivePlan, look: StepLook, action: TrafficAction, *,
               at: str) -> StepEvent:
    """The record of ``action`` taken after ``look`` (pure; ``at`` is the caller's clock)."""
    return StepEvent(at=at, action=action.kind, step=action.step,
                     weight_pct=action.split.canary_pct, from_step=look.step,
                     from_weight_pct=plan.weight(look.step), decision=look.decision,
                     elapsed_s=look.elapsed_s, live=look.live, outcome=action.outcome,
                     exit_code=action.exit_code, reason=action.reason,
                     load_ratio=plan.load(action.step),
                     latency_judged=plan.latency_judged(action.step))


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
