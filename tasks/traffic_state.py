"""Router state is part of the release: a killed release's split is restored by the next
run, an orphaned split is returned to 100 % production (issue 20 item 5).

A release writes its hold on the router into its record **before** each change of the
router (:func:`traffic_intent`, ``ReleaseRecord.traffic``), the way it writes its intent
before the swap. Every way out of a canary or a bake returns the router to
:data:`~modelship.traffic.port.PRODUCTION_ONLY`, whatever the release's goal (released or
undone), so the router has one rest state and recovery needs no goal of its own:

- :func:`decide_router` (pure): from the split read back from the router and the
  :class:`TrafficClaim` of each release that could own it, ``leave`` (a live release owns
  the split: a running canary, the canary slot's live holder), ``restore`` (a dead or
  unfinished release's split, or an orphan no release claims: back to production; also
  when the router could not be read but a dead release claims a split, since setting is
  idempotent), ``none`` (it is at production already) or ``unknown`` (it could not be
  read and no release claims a split: reported, nothing to restore, so a gateway outage
  alone never blocks a rollback);
- :func:`settle_router` is the executor: it reads the router, decides, and performs the
  restore through the :class:`~modelship.traffic.port.TrafficRouter` port, confirming it
  by reading back;
- :func:`recovery_hook` and :func:`reconcile_hook` bind it for
  :func:`tasks.recovery.recover` (every command, under the model's lock, before anything
  else: a killed release's users leave its candidate first) and
  :func:`tasks.reconcile.reconcile` (an orphaned split); :func:`live_traffic` is what
  ``modelship status`` shows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from modelship.errors import InfrastructureError, ModelshipError
from modelship.ledger import ReleaseRecord, now_iso
from modelship.locks import list_locks
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.split_scope import SplitScope
from modelship.storage import S3Storage
from modelship.traffic.port import PRODUCTION_ONLY, ScopeReporting, TrafficRouter, TrafficSplit
from modelship.traffic.select import router_for
from tasks.traffic_plan import StepEvent, router_problem

__all__ = ["RouterAction", "RouterDecision", "TrafficClaim", "claim_of", "configured_router",
           "decide_router", "holding", "live_traffic", "read_live", "reconcile_hook",
           "recovery_hook", "return_to_production", "settle_router", "slot_claims",
           "slot_owners", "split_of", "traffic_intent", "with_event"]

RouterAction = Literal["none", "leave", "restore", "unknown"]


# --------------------------------------------------------------------------------------
# what a release writes


def split_of(doc: Mapping[str, Any]) -> TrafficSplit:
    """A split from its ``to_dict`` form."""
    return TrafficSplit(canary_pct=float(doc.get("canary_pct", 0.0)),
                        mirror_pct=float(doc.get("mirror_pct", 0.0)))


def traffic_intent(previous: Mapping[str, Any], *, router: str, split: TrafficSplit,
                   at: str) -> dict[str, Any]:
    """``ReleaseRecord.traffic`` before the router is set to ``split`` (pure): the router,
    the split and when; the events so far are kept."""
    return {"router": router, "split": split.to_dict(), "at": at,
            "events": list(previous.get("events", []))}


def with_event(traffic: Mapping[str, Any], event: StepEvent) -> dict[str, Any]:
    """``traffic`` with one more step event (pure)."""
    return {**traffic, "events": [*traffic.get("events", []), event.to_dict()]}


# --------------------------------------------------------------------------------------
# the pure decision


@dataclass(frozen=True)
class TrafficClaim:
    """A release's hold on the router.

    Attributes:
        owner: The release id (or the canary slot's owner) in words.
        split: The last split it set or was about to set; None: it holds the canary slot
            and may set any.
        alive: Whether its process still runs (then the split is its own).
    """

    owner: str
    split: TrafficSplit | None
    alive: bool


def claim_of(record: ReleaseRecord, *, alive: bool) -> TrafficClaim | None:
    """The claim of ``record``; None when it never touched the router."""
    if not record.traffic.get("split"):
        return None
    return TrafficClaim(f"release {record.id} ({record.kind} of {record.model})",
                        split_of(record.traffic["split"]), alive)


def slot_owners(storage: S3Storage | None, *, home: Path
                ) -> Callable[[], list[TrafficClaim]]:
    """The ``owners`` of the hooks: the canary slot's live holder, read from the lock store
    when called (:func:`slot_claims` of ``modelship.locks.list_locks``). Without S3 there
    is no shared slot (one process): no owner."""
    return lambda: slot_claims(list_locks(storage=storage, home=home))


def slot_claims(lock_rows: Iterable[Mapping[str, Any]]) -> list[TrafficClaim]:
    """The canary slot's live holder as a claim (``modelship.locks.list_locks`` rows): the
    only process that may set the router (a canary, a bake with a holdback) holds it."""
    return [TrafficClaim(f"the canary slot's holder {row['holder'].get('release_id')}",
                         None, True)
            for row in lock_rows
            if row.get("lock") == "canary" and row.get("held") and row.get("holder")
            and row.get("holder_alive")]


@dataclass(frozen=True)
class RouterDecision:
    """What to do about the router.

    Attributes:
        action: ``none`` (at production), ``leave`` (a live release owns it),
            ``restore`` (back to :data:`PRODUCTION_ONLY`) or ``unknown`` (unreadable, and
            no release claims a split).
        reason: One sentence for the report.
        live: What the router read back (None: it did not answer).
        owner: Whose split it is (the live owner, or the dead release restored).
    """

    action: RouterAction
    reason: str
    live: TrafficSplit | None
    owner: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason,
                "live": None if self.live is None else self.live.to_dict(),
                "owner": self.owner}


def _shown(split: TrafficSplit) -> str:
    return (f"{split.production_pct:g} % production / {split.canary_pct:g} % canary"
            + (f", {split.mirror_pct:g} % mirrored" if split.mirror_pct else ""))


def decide_router(live: TrafficSplit | None, claims: Sequence[TrafficClaim], *,
                  problem: str | None = None) -> RouterDecision:
    """What to do about the router (pure; the rules are in the module docstring).

    Args:
        live: The split read back now; None when the router did not answer (``problem``
            says why).
        claims: The releases that could own it: live ones (their split is theirs) and dead
            or unfinished ones (their split is restored).
    """
    owner = next((c for c in claims if c.alive), None)
    if owner is not None:
        seen = "could not be read" if live is None else f"holds {_shown(live)}"
        return RouterDecision("leave", f"the traffic router {seen}; {owner.owner} is running "
                              "and owns it", live, owner.owner)
    dead = next((c for c in claims if c.split is not None
                 and not c.split.is_production_only), None)
    if live is None:
        why = problem or "no reason given"
        if dead is None or dead.split is None:
            return RouterDecision("unknown", f"the traffic router did not answer ({why}); no "
                                  "release claims a split on it, so nothing is restored", None)
        return RouterDecision("restore", f"the traffic router did not answer ({why}); "
                              f"{dead.owner} left {_shown(dead.split)}: returning it to 100 % "
                              "production, which is idempotent", None, dead.owner)
    if live.is_production_only:
        return RouterDecision("none", "the traffic router sends 100 % to production", live)
    if dead is not None:
        return RouterDecision("restore", f"{dead.owner} stopped with the traffic router at "
                              f"{_shown(live)}: restored to 100 % production", live,
                              dead.owner)
    return RouterDecision("restore", f"the traffic router holds {_shown(live)} with no "
                          "running release: an orphaned split, returned to 100 % production",
                          live)


# --------------------------------------------------------------------------------------
# the executor


def _why(exc: Exception) -> str:
    return exc.message if isinstance(exc, ModelshipError) else f"{type(exc).__name__}: {exc}"


def read_live(router: TrafficRouter) -> tuple[TrafficSplit | None, str | None]:
    """What the router holds, or None and why it did not answer (never raises for it)."""
    try:
        return router.live(), None
    except Exception as exc:  # noqa: BLE001 - a router that does not answer is a finding
        return None, _why(exc)


def return_to_production(router: TrafficRouter) -> TrafficSplit:
    """Every live request to production, nothing mirrored, confirmed by reading back.

    The weight first (clients stop being answered by the canary), then the mirror.

    Raises:
        InfrastructureError: the router failed, or reads back another split (stuck).
    """
    try:
        router.set_weights(0.0)
        router.mirror(0.0)
        live = router.live()
    except ModelshipError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated: the router failed
        raise InfrastructureError(f"the traffic router ({router.name}) failed: {_why(exc)}",
                                  hint="check the gateway (`modelship doctor`)",
                                  component=router.name) from exc
    stuck = router_problem(PRODUCTION_ONLY, live)
    if stuck is not None:
        raise InfrastructureError(f"{stuck} after returning it to production ({router.name})",
                                  hint="check the gateway (`modelship doctor`), then run "
                                  "`modelship reconcile`", component=router.name)
    return live


def settle_router(router: TrafficRouter, claims: Callable[[], Sequence[TrafficClaim]], *,
                  progress: Progress = quiet) -> dict[str, Any]:
    """Read the router, decide (:func:`decide_router`), restore when decided. ``claims``
    is only called when the router is not at production (reading the canary slot is an S3
    list: a command whose router is at rest pays one read of the router).

    Returns:
        ``{"router", "action", "reason", "live", "owner", "restored"}`` and ``error`` (in
        words) when the restore failed: the caller decides whether that stops it;
        ``unread`` (why) when the router did not answer.
    """
    live, problem = read_live(router)
    at_rest = live is not None and live.is_production_only
    decision = decide_router(live, () if at_rest else claims(), problem=problem)
    report = {"router": router.name, **decision.to_dict(), "restored": False,
              **({"unread": problem} if live is None else {})}
    if decision.action != "restore":
        return report
    progress(f"traffic: {decision.reason}")
    try:
        report["live"] = return_to_production(router).to_dict()
        report["restored"] = True
    except ModelshipError as exc:
        report["error"] = exc.message
        progress(f"traffic: could not return the router to production: {exc.message}")
    return report


@contextmanager
def holding(router: TrafficRouter, split: TrafficSplit, *,
            write: Callable[[dict[str, Any]], None], traffic: Mapping[str, Any] | None = None,
            progress: Progress = quiet) -> Iterator[dict[str, Any]]:
    """Hold ``split`` on the router for the block: a shadow canary's mirror share, the
    bake's holdback weight. Written to the record first (``write`` gets the ``traffic``
    document), confirmed by reading back, and returned to production after the block on
    every path (production written first again). Call it inside the canary slot
    (:func:`modelship.locks.canary_slot`): the slot's live holder is who recovery and
    reconcile take to own a split (:func:`slot_claims`).

    Raises:
        InfrastructureError: the router did not take ``split`` (dead or stuck; the block
            does not run), or could not be returned to production after a block that ended
            well (exit 1). After a block that raised, that exception goes on up and the
            failed return is only said (the next command restores it from the record).
    """
    doc = traffic_intent(traffic or {}, router=router.name, split=split, at=now_iso())
    write(doc)
    try:
        router.set_weights(split.canary_pct)
        router.mirror(split.mirror_pct)
        live, problem = router.live(), None
    except Exception as exc:  # noqa: BLE001 - the read-back below says what is wrong
        live, problem = None, _why(exc)
    trouble = router_problem(split, live, problem)
    if trouble is not None:
        try:
            _back(router, doc, write, progress)
        except ModelshipError as exc:
            trouble = (f"{trouble}; and it could not be returned to 100 % production: "
                       f"{exc.message} (the next modelship command restores it)")
        else:
            trouble = f"{trouble}; weights back to 100 % production"
        raise InfrastructureError(trouble, hint="check the gateway (`modelship doctor`)",
                                  component=router.name)
    progress(f"traffic: {_shown(split)} on {router.name}")
    try:
        yield doc
    except BaseException:
        try:
            _back(router, doc, write, progress)
        except Exception as failed:  # noqa: BLE001 - the block's exception is the error
            progress(f"traffic: could not return {router.name} to production ({failed}); "
                     "the next modelship command restores it")
        raise
    _back(router, doc, write, progress)


def _back(router: TrafficRouter, doc: Mapping[str, Any],
          write: Callable[[dict[str, Any]], None], progress: Progress) -> None:
    """Production: written first when the record can be written, and set whatever the
    record says (production is the rest state: a record that still claims the split
    while the router is at production needs nothing)."""
    try:
        write(traffic_intent(doc, router=router.name, split=PRODUCTION_ONLY, at=now_iso()))
    except Exception as exc:  # noqa: BLE001 - the router matters more than the record
        progress(f"traffic: the record could not say production ({_why(exc)}); the router "
                 "goes back anyway")
    return_to_production(router)
    progress(f"traffic: {router.name} back to 100 % production")


def recovery_hook(router: TrafficRouter, owners: Callable[[], Sequence[TrafficClaim]], *,
                  progress: Progress = quiet
                  ) -> Callable[[Sequence[ReleaseRecord]], dict[str, Any]]:
    """``recover(traffic=...)``: the unfinished records of the model (dead or incomplete,
    none of them live) plus the live ``owners()`` (the canary slot's holder) decide the
    router. A router that cannot be returned to production stops the command (exit 1):
    a next canary would otherwise put a new candidate in front of live users."""

    def hook(records: Sequence[ReleaseRecord]) -> dict[str, Any]:
        def claims() -> list[TrafficClaim]:
            return [*owners(), *(c for r in records if (c := claim_of(r, alive=False)))]

        report = settle_router(router, claims, progress=progress)
        if "error" in report:
            raise InfrastructureError(
                f"the traffic router could not be returned to 100 % production: "
                f"{report['error']} ({report['reason']})",
                hint="bring the gateway back (`modelship doctor`, `modelship stack up`), "
                "then run the command again", component=router.name, traffic=report)
        return report

    return hook


def reconcile_hook(router: TrafficRouter, owners: Callable[[], Sequence[TrafficClaim]], *,
                   progress: Progress = quiet) -> Callable[[], dict[str, Any]]:
    """``reconcile(traffic=...)``: an orphaned split (no live owner) back to production;
    a failure (``error``) or an unreadable router (``unread``) is reported and fails the
    round, and the replicas are still reconciled."""
    return lambda: settle_router(router, owners, progress=progress)


def configured_router(settings: Settings, progress: Progress = quiet, *,
                      scope: SplitScope | None = None) -> TrafficRouter | None:
    """The configured traffic router (:func:`modelship.traffic.select.router_for`), its
    splits over ``scope``'s requests; a router that cannot be built (a ``stack.json`` that
    does not parse, a gateway without its process record) is a note, never a stopped
    recovery or status."""
    try:
        return router_for(settings, scope=scope)
    except ModelshipError as exc:
        progress(f"note: the traffic router is not known: {exc.message}")
        return None


def live_traffic(router: TrafficRouter | None) -> dict[str, Any] | None:
    """``status``'s ``traffic``: the live weights read back from the router, and ``scope``
    (the requests they apply to, ``applies_to`` in words) when the router reports it; None
    when no router is configured; ``error`` when it did not answer."""
    if router is None:
        return None
    scope: dict[str, Any] | None = None
    if isinstance(router, ScopeReporting):  # which requests the weights apply to
        try:
            live, scope = router.live_scoped()
            problem = None
        except Exception as exc:  # noqa: BLE001 - a router that does not answer is a finding
            live, problem = None, _why(exc)
    else:
        live, problem = read_live(router)
    if live is None:
        return {"router": router.name, "live": None, "error": problem, "at": now_iso()}
    return {"router": router.name, "live": live.to_dict(), "at": now_iso(),
            "production_only": live.is_production_only,
            **({"scope": scope} if scope is not None else {})}
