"""The fleet tasks: the swap executor's wiring, undo and withdraw, the release's MLflow
commit, its ending (released or undone on every way out), crash recovery's effects, and
what serves. :mod:`flows.standalone` and :mod:`flows.promote` compose them.

Every function here does one job against the outside (the replicas, the pin in S3, the
ledger, MLflow); the decisions are pure and live in :mod:`tasks.recovery` and
:mod:`modelship.triton.swap_plan`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from model_registry.client import PREVIOUS_ALIAS, PRODUCTION_ALIAS
from modelship.clients import Clients, notifier_for
from modelship.errors import (
    InfrastructureError,
    ModelNotFound,
    ModelshipError,
    ReleaseCancelled,
    ReleaseIncomplete,
    ReleaseLocked,
    UsageError,
)
from modelship.ledger import (
    RELEASE_ID_TAG,
    Ledger,
    ReleaseRecord,
    last_release,
    now_iso,
    release_intent,
    rollback_target,
    served_before,
)
from modelship.policy import Policy
from modelship.progress import Progress, quiet
from modelship.repository import CONFIG_NAME, manifest_key, model_prefix, staged_config
from modelship.settings import Settings
from modelship.signals import stop_signal
from modelship.signing import key_bytes
from modelship.traffic.port import TrafficRouter
from modelship.triton.model_config import example_request, from_pbtxt
from tasks import recovery
from tasks.evidence import read_candidate_digest, require_evidence
from tasks.record import ReleaseJournal
from tasks.stage import prune_versions
from tasks.swap import SwapOptions, SwapTarget, fleet_status, recorded_footprint, swap_fleet
from tasks.traffic_state import configured_router, recovery_hook, slot_owners


def require_fleet(clients: Clients) -> None:
    if not clients.replicas:
        raise UsageError("no Triton replicas are configured",
                         hint="run `modelship stack up` or set MODELSHIP_TRITON_REPLICAS")
    if clients.storage is None:
        raise UsageError("no S3 repository is configured",
                         hint="run `modelship stack up` or set MODELSHIP_S3_ENDPOINT")


def ledger_of(clients: Clients) -> Ledger:
    assert clients.storage is not None
    return Ledger(clients.storage)


def swap_unlocked(settings: Settings, clients: Clients, policy: Policy, *, model: str,
                  target: int, dry_run: bool = False, converge: bool = False,
                  progress: Progress = quiet,
                  footprint_bytes: int | None = None,
                  footprint_detail: str | None = None,
                  config_pbtxt: str | None = None) -> dict[str, Any]:
    """The fleet swap itself (DESIGN §4); the caller holds the model's release lock.

    ``footprint_bytes`` is C's GPU footprint measured by the canary, for the headroom
    preflight (None: estimated from C's initializers); ``footprint_detail`` says where it
    was read (a release record). ``config_pbtxt`` is C's staged config when the caller has
    it (a promotion's candidate), else it is read from S3; either way the preflight
    verifies the staged bytes against the manifest."""
    require_fleet(clients)
    assert clients.storage is not None
    config = from_pbtxt(config_pbtxt) if config_pbtxt is not None else staged_config(
        clients.storage, repository_prefix=settings.repository_prefix, model=model,
        version=target)
    candidate = SwapTarget.from_settings(
        settings, clients.storage, model=model, version=target,
        probe_feed=example_request(config), probe_outputs=[o.name for o in config.output],
        footprint_bytes=footprint_bytes, footprint_detail=footprint_detail)
    options = SwapOptions(policy.swap, gpu=policy.triton.gpu,
                          http_timeout_s=settings.http_timeout_s, dry_run=dry_run,
                          converge=converge)
    return swap_fleet(clients.replicas, candidate, options, progress=progress).to_dict()


def recorded_footprint_for(records: list[ReleaseRecord], digest: dict[str, Any],
                        progress: Progress) -> dict[str, Any]:
    """C's canary-measured GPU footprint from the ledger, for the headroom preflight of a
    swap or rollback outside a release (``swap_unlocked``'s footprint keywords)."""
    found = recorded_footprint(records, digest=digest)
    progress(f"GPU footprint for the headroom preflight: {found.detail}")
    return {"footprint_bytes": found.bytes_per_gpu, "footprint_detail": found.detail,
            "evidence": found.to_dict()}


def undo_swap(settings: Settings, clients: Clients, policy: Policy, *, model: str,
              previous: int | None, progress: Progress = quiet) -> dict[str, Any]:
    """Put every reachable replica back on ``previous`` (the bake's rollback); on a first
    release, back on nothing (:func:`withdraw`)."""
    if previous is None:
        return withdraw(settings, clients, model=model, progress=progress)
    try:
        report = swap_unlocked(settings, clients, policy, model=model, target=previous,
                               converge=True, progress=progress)
    except ModelshipError as exc:
        return {"ok": False, "to_version": previous, "reason": exc.message}
    return {"ok": True, "to_version": previous, "kind": report.get("kind"),
            "total_s": report.get("total_s")}


def withdraw(settings: Settings, clients: Clients, *, model: str,
             progress: Progress = quiet) -> dict[str, Any]:
    """Undo a first release: no replica serves ``model``, and its production pin is gone,
    so reconcile (and a restarted replica) cannot load the withdrawn version back."""
    failed: dict[str, str] = {}
    for replica in clients.replicas:
        try:
            replica.unload_model(model)
            progress(f"{model}: unloaded from {replica.name} (nothing served before)")
        except ModelshipError as exc:
            failed[replica.name] = exc.message
    if clients.storage is not None:
        pin = f"{model_prefix(settings.repository_prefix, model)}/{CONFIG_NAME}"
        if clients.storage.exists(pin):
            clients.storage.delete_key(pin)
    reason = "; ".join(f"{name}: {why}" for name, why in failed.items()) or None
    return {"ok": not failed, "to_version": None, "kind": "withdraw", "reason": reason}


def _move_aliases(clients: Clients, model: str, *, to: int, served: int | None) -> None:
    """``previous`` to what served, then ``production`` to ``to`` (last)."""
    assert clients.registry is not None
    if served is not None and served != to:
        clients.registry.set_alias(model, PREVIOUS_ALIAS, served)
    clients.registry.set_alias(model, PRODUCTION_ALIAS, to)


def record_release(settings: Settings, clients: Clients, policy: Policy,
                   record: ReleaseRecord) -> dict[str, Any]:
    """After a release: MLflow tags and aliases (production last), then prune old versions."""
    assert clients.registry is not None and clients.storage is not None
    assert record.to_version is not None
    model, version = record.model, record.to_version
    verdict = str((record.gates or {}).get("verdict") or ("forced" if record.forced
                                                          else "served_before"))
    clients.registry.set_tags(model, version, {
        "modelship.release_id": record.id, "modelship.verdict": verdict,
        "modelship.released_at": now_iso(), "modelship.released_by": record.requester or "",
    })
    _move_aliases(clients, model, to=version, served=record.from_version)
    protect = {v for v in (version, record.from_version) if v is not None}
    pruned = prune_versions(clients.storage, model=model,
                            repository_prefix=settings.repository_prefix,
                            keep=policy.staging.keep_versions, protect=protect)
    return {"aliases": clients.registry.aliases(model), "pruned": pruned}


# --------------------------------------------------------------------------------------
# the transaction: intent first, then released or undone on every way out


class FleetEffects:
    """The steps of :mod:`tasks.recovery` on the real fleet, pin and MLflow (without an
    MLflow configured, the alias and tag steps have nothing to keep true)."""

    def __init__(self, settings: Settings, clients: Clients, policy: Policy, *, model: str,
                 progress: Progress = quiet) -> None:
        self.settings, self.clients, self.policy = settings, clients, policy
        self.model, self.progress = model, progress

    def fleet_to(self, version: int | None) -> None:
        done = undo_swap(self.settings, self.clients, self.policy, model=self.model,
                         previous=version, progress=self.progress)
        if not done.get("ok"):
            where = "nothing" if version is None else f"v{version}"
            raise InfrastructureError(
                f"the fleet of {self.model} could not be put on {where}: "
                f"{done.get('reason')}", hint=f"`modelship status {self.model}`; once the "
                f"replicas answer, `modelship reconcile {self.model}` finishes it",
                model=self.model)

    def set_alias(self, alias: str, version: int | None) -> None:
        registry = self.clients.registry
        if registry is None:  # no MLflow configured: no alias to keep true
            return
        if version is not None:
            registry.set_alias(self.model, alias, version)
        elif alias in registry.aliases(self.model):
            registry.delete_alias(self.model, alias)

    def tag_release(self, version: int, release_id: str) -> None:
        if self.clients.registry is None:
            return
        self.clients.registry.set_tags(self.model, version, {
            RELEASE_ID_TAG: release_id, "modelship.released_at": now_iso()})


def observer(settings: Settings, clients: Clients,
             model: str) -> Callable[[ReleaseRecord], recovery.Seen]:
    """Reads what the fleet, the pin and MLflow say about a record's model now."""
    def observe(record: ReleaseRecord) -> recovery.Seen:
        return recovery.observe_seen(
            clients, model=model, version=recovery.intent_of(record).get("to_version"),
            release_id=record.id, repository_prefix=settings.repository_prefix,
            signing_key=key_bytes(settings.manifest_signing_key))
    return observe


def recover_model(settings: Settings, clients: Clients, policy: Policy, *, model: str,
                  by: str, progress: Progress = quiet,
                  router: TrafficRouter | None = None) -> dict[str, Any]:
    """Before anything else, under the model's lock: finish or undo what dead or
    incomplete releases of ``model`` left (:func:`tasks.recovery.recover`), and unload
    what dead runs left on the canary. With a traffic router (``router``, else the
    configured one: :func:`modelship.traffic.select.router_for`), first a killed
    release's split (or an orphan) goes back to 100 % production
    (:func:`tasks.traffic_state.recovery_hook`; its report is ``traffic``).

    Returns:
        ``{"interrupted", "finished", "unloaded", "fleet"}``: ``fleet`` is the fleet step
        taken (``{"ok", "to_version"}``), None when the fleet was left as it was.

    Raises:
        ReleaseIncomplete: what was left could not be finished now; nothing else may run.
    """
    if clients.storage is None:
        return {"interrupted": [], "finished": [], "unloaded": [], "fleet": None}
    ledger = ledger_of(clients)
    effects = FleetEffects(settings, clients, policy, model=model, progress=progress)
    router = router if router is not None else configured_router(settings, progress)
    traffic = None if router is None else recovery_hook(
        router, slot_owners(clients.storage, home=settings.home), progress=progress)
    report = recovery.recover(ledger, model, by=by, observe=observer(settings, clients, model),
                              effects=effects, progress=progress, traffic=traffic)
    report["unloaded"] = []
    if report["interrupted"]:
        try:
            report["unloaded"] = recovery.unload_leftovers(clients.canary, model)
        except ModelshipError as exc:  # the canary is not production: never a blocker
            report["canary_error"] = exc.message
            progress(f"note: what dead runs left on the canary stays: {exc.message}")
    return report


def end_release(settings: Settings, clients: Clients, policy: Policy, record: ReleaseRecord,
                exc: BaseException | None, *, write: Callable[[ReleaseRecord], object],
                progress: Progress = quiet) -> recovery.Ending:
    """Every way out of a fleet change that wrote its intent: reach released or undone
    (:func:`tasks.recovery.close`), end and write the record, and say what happened.

    Raises:
        ReleaseIncomplete: the goal could not be reached now (recorded ``incomplete``).
        ReleaseCancelled: a stop request (SIGINT, SIGTERM, a cancel) undid the release.
        The original exception, for any other failure (the record ends undone).
    """
    closing = recovery.closing_for(record, exc)
    effects = FleetEffects(settings, clients, policy, model=record.model, progress=progress)
    try:
        ending = recovery.close(record, closing, observe=observer(settings, clients,
                                                                    record.model),
                                effects=effects, write=write, progress=progress)
    except ModelshipError as failed:  # the ledger could not be written: it stays running
        raise ReleaseIncomplete(
            f"release {record.id} of {record.model} ended {record.status}, but its record "
            f"could not be written: {failed.message}", hint="the next modelship command "
            f"for {record.model} finishes it from what the fleet and MLflow say (`modelship "
            f"reconcile {record.model}`)", model=record.model, release_id=record.id,
            record=record.to_dict()) from exc or failed
    if not ending.reached:
        raise ReleaseIncomplete(
            f"release {record.id} of {record.model} is incomplete: "
            f"{'; '.join(ending.incomplete['missing'])} could not be done "
            f"({ending.incomplete['error']})",
            hint=f"bring back what is down (`modelship doctor`); the next modelship command "
            f"for {record.model} finishes it (`modelship reconcile {record.model}`)",
            model=record.model, release_id=record.id, record=record.to_dict()) from exc
    signum = None if exc is None else stop_signal(exc)
    if exc is None or closing.goal == "released":
        return ending
    if signum is not None:
        raise ReleaseCancelled(f"{record.kind} of {record.model} {record.reason}",
                               signum=signum, hint=f"`modelship history {record.model}` "
                               "shows the record", model=record.model,
                               record=record.to_dict()) from exc
    if isinstance(exc, ModelshipError):
        exc.details["record"] = record.to_dict()
    raise exc


@contextmanager
def ending(settings: Settings, clients: Clients, policy: Policy, journal: ReleaseJournal, *,
           progress: Progress = quiet,
           on_stop: Callable[[BaseException], object] | None = None) -> Iterator[None]:
    """Around the stages of a fleet change that wrote its intent (promote, swap, rollback):
    every way out goes through :func:`end_release`. An exception (a stop request too)
    first calls ``on_stop``, then ends the release with it and goes on (or the error
    end_release raises instead); a normal exit ends it released. A body that ended the
    record itself (a no-op swap's finish) is left as it ended.
    """
    record = journal.record
    try:
        yield
    except BaseException as exc:
        if record.status != "running":
            raise
        if on_stop is not None:
            on_stop(exc)
        end_release(settings, clients, policy, record, exc, write=journal.write_ending,
                    progress=progress)
        raise
    if record.status == "running":
        end_release(settings, clients, policy, record, None, write=journal.write_ending,
                    progress=progress)


def repair_noop(settings: Settings, clients: Clients, policy: Policy, *, model: str,
                version: int, release_id: str, progress: Progress = quiet) -> list[str]:
    """A no-op's truth, made whole: ``version`` serves on every replica, so the pin, its
    release tag and the aliases are brought to say so (``previous`` from the ledger).

    Returns:
        What was repaired, in words (empty: nothing was wrong).

    Raises:
        ReleaseIncomplete: a repair could not be done now (MLflow down).
    """
    assert clients.storage is not None
    records = ledger_of(clients).records(model)
    tagged_by = recovery.newest_release_of(records, version) or release_id
    target = recovery.repair_target(version, previous=rollback_target(records, version),
                                    release_id=tagged_by)
    seen = recovery.observe_seen(clients, model=model, version=version, release_id=tagged_by,
                                 repository_prefix=settings.repository_prefix,
                                 signing_key=key_bytes(settings.manifest_signing_key))
    decision = recovery.Decision(release_id, "released", recovery.steps_to(target, seen),
                                 "noop", 0, f"v{version} already serves", target)
    effects = FleetEffects(settings, clients, policy, model=model, progress=progress)
    ending = recovery.carry_out(decision, effects, progress=progress)
    if not ending.reached:
        raise ReleaseIncomplete(
            f"{model} v{version} serves on every replica, but "
            f"{'; '.join(ending.incomplete['missing'])} could not be repaired "
            f"({ending.incomplete['error']})", hint="bring back what is down (`modelship "
            "doctor`), then run the same command again", model=model)
    return ending.done


def repair_stage(settings: Settings, clients: Clients, policy: Policy, journal: ReleaseJournal,
                 version: int) -> list[str]:
    """The journal's ``repair`` stage of a no-op (promote or swap; the caller holds the
    lock): :func:`repair_noop`, with what was repaired in the stage."""
    record = journal.record
    with journal.stage("repair") as entry:
        repaired = repair_noop(settings, clients, policy, model=record.model,
                               version=version, release_id=record.id,
                               progress=journal.progress)
        entry.details["repaired"] = repaired
        if not repaired:
            entry.outcome, entry.reason = "skipped", "the pin, the tag and the aliases agree"
    return repaired


def refuse_while_running(ledger: Ledger, model: str, *, what: str) -> None:
    """Name a live release of ``model`` instead of guessing around it (a rollback during a
    bake): it holds the lock, and stopping it undoes its swap."""
    live = recovery.live_runs(ledger.records(model))
    if not live:
        return
    run = live[0]
    stage = next((s.name for s in reversed(run.stages)), "start")
    flow_run = run.holder.get("flow_run_id")
    raise ReleaseLocked(
        f"cannot {what} {model}: release {run.id} ({run.kind} v{run.from_version} -> "
        f"v{run.to_version}, by {run.requester or '?'}) is running, in its {stage} stage "
        f"(pid {run.holder.get('pid')} on {run.holder.get('host')})",
        hint=f"stop it and it undoes its own swap and records it: `kill -TERM "
        f"{run.holder.get('pid')}`" + (f" or cancel flow run {flow_run} in Prefect"
                                       if flow_run else "")
        + f"; then `modelship status {model}`", model=model, release_id=run.id)


def serving_now(clients: Clients, model: str) -> tuple[int | None, dict[str, Any]]:
    """What every replica serves (None: nothing, or a mixed fleet), asked of the replicas
    alone: a fleet change must not depend on MLflow to know what serves."""
    doc = fleet_status(clients.replicas, model)
    rows = doc["replicas"]
    serving = int(rows[0]["ready_versions"][0]) if doc["consistent"] else None
    return serving, {**doc, "production_version": serving}


def converge_needed(doc: dict[str, Any]) -> bool:
    return not doc.get("consistent") and any(r.get("ready_versions")
                                             for r in doc.get("replicas", []))


def aliases_now(clients: Clients, model: str) -> dict[str, int] | None:
    """The model's aliases, {} when it has none or no MLflow is configured; None when
    MLflow does not answer (the intent then keeps ``previous`` as it is)."""
    if clients.registry is None:
        return {}
    try:
        return dict(clients.registry.aliases(model))
    except ModelNotFound:
        return {}
    except Exception:  # noqa: BLE001 - MLflow down: the intent says what it can
        return None


def journal_for(settings: Settings, clients: Clients, policy: Policy, record: ReleaseRecord,
                progress: Progress = quiet) -> ReleaseJournal:
    """The journal of a fleet change outside promote: the same ledger record, stage entries
    and Slack thread as a release (the null notifier when Slack is off)."""
    return ReleaseJournal(record, ledger_of(clients), notifier_for(clients, settings, policy),
                          progress)


def begin_change(settings: Settings, journal: ReleaseJournal, clients: Clients, *,
                 doc: dict[str, Any], target: int) -> None:
    """Write the intent and open the journal (the record and its Slack thread), before the
    first change of the fleet.

    A mixed fleet (a converge) has no one version to go back to: its undo goes to the
    recorded production (the pin); with no pin either, the only way home is forward, so
    the intent is committed from the start."""
    record = journal.record
    serving = doc.get("production_version")
    mixed = converge_needed(doc)
    back = serving
    if mixed:
        seen = recovery.observe_seen(clients, model=record.model, version=None,
                                     release_id=None,
                                     repository_prefix=settings.repository_prefix,
                                     signing_key=key_bytes(settings.manifest_signing_key))
        back = seen.pin if isinstance(seen.pin, int) else None
    record.intent = release_intent(from_version=back, to_version=target,
                                   aliases=aliases_now(clients, record.model),
                                   release_id=record.id)
    if mixed and back is None:
        record.intent["committed_at"] = now_iso()
        record.notes.append("the fleet was mixed with no recorded production: converging "
                            "forward is the only way home, so this swap is never undone")
    journal.open()


def swap_evidence(ledger: Ledger, *, model: str, digest: dict[str, Any], serving: int | None,
                  force: bool, progress: Progress = quiet
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ledger's evidence for swapping to ``digest`` (a passing canary against
    ``serving``, a version that served before, or ``force``) and the canary-measured GPU
    footprint for the headroom preflight. Raises EvidenceMissing without either."""
    records = ledger.records(model)
    evidence = require_evidence(records, model=model, digest=digest, serving=serving,
                                force=force)
    return evidence, recorded_footprint_for(records, digest, progress)


def require_version(clients: Clients, model: str, version: int) -> None:
    """Raise ModelNotFound (naming the versions that exist) unless MLflow has ``version``."""
    assert clients.registry is not None
    clients.registry.version_number(model, version=version, alias=None)


def set_production(clients: Clients, model: str, version: int) -> None:
    """Point the ``production`` alias at ``version`` (a rollback moves it first)."""
    assert clients.registry is not None
    clients.registry.set_alias(model, PRODUCTION_ALIAS, version)


def note_rolled_back(clients: Clients, journal: ReleaseJournal, *, current: int | None,
                     target: int) -> None:
    """A released rollback: the ``rolled_back_from`` tag on ``target`` and the record's
    reason. Best effort: the rollback itself is done, so a failure is only a note."""
    record = journal.record
    record.reason = f"rolled back from v{current}"
    try:
        assert clients.registry is not None
        clients.registry.set_tags(record.model, target,
                                  {"modelship.rolled_back_from": str(current)})
        journal.save()
    except ModelshipError as exc:
        journal.progress(f"note: the rolled_back_from tag was not written: {exc.message}")


def is_staged(settings: Settings, clients: Clients, *, model: str, version: int) -> bool:
    """Whether ``version`` of ``model`` is published in the S3 repository (its manifest)."""
    assert clients.storage is not None
    return clients.storage.exists(manifest_key(settings.repository_prefix, model, version))


def status(clients: Clients, *, model: str, last: bool = True) -> dict[str, Any]:
    """What serves where: per replica the ready versions and the config digest, the
    aliases, and (unless not ``last``: it reads every record of the model) the last
    release in the ledger."""
    fleet = fleet_status(clients.replicas, model, storage=clients.storage)
    aliases: dict[str, int] = {}
    alias_error = None
    if clients.registry is not None:
        try:
            aliases = clients.registry.aliases(model)
        except ModelNotFound as exc:
            alias_error = exc.message
    served = {tuple(r.get("ready_versions", [])) for r in fleet["replicas"]}
    serving = next(iter(served))[0] if fleet["consistent"] and len(served) == 1 and \
        len(next(iter(served))) == 1 else None
    found_last: dict[str, Any] | None = None
    if clients.storage is not None and last:
        try:
            found = last_release(ledger_of(clients).records(model))
            found_last = None if found is None else {
                "id": found.id, "kind": found.kind, "status": found.status,
                "from_version": found.from_version, "to_version": found.to_version,
                "finished_at": found.finished_at, "exit_code": found.exit_code}
        except ModelshipError as exc:
            found_last = {"error": exc.message}
    return {
        **{k: v for k, v in fleet.items() if k not in ("model", "replicas", "consistent")},
        "model": model,
        "production_version": serving,
        "aliases": aliases,
        "consistent": fleet["consistent"],
        "replicas": fleet["replicas"],
        "last_release": found_last,
        **({"registry_error": alias_error} if alias_error else {}),
    }


def rollback_plan(settings: Settings, clients: Clients, policy: Policy, ledger: Ledger, *,
                   model: str, to: int | None, force: bool, dry_run: bool,
                   progress: Progress) -> tuple[dict[str, Any], dict[str, Any]]:
    """Where a rollback goes (the ledger's default target, or ``to`` if it served before),
    sized for the headroom preflight; with ``dry_run`` the swap's plan too."""
    assert clients.registry is not None and clients.storage is not None
    aliases = clients.registry.aliases(model)
    serving, doc = serving_now(clients, model)
    current = serving if serving is not None else aliases.get(PRODUCTION_ALIAS)
    records = ledger.records(model)
    if to is None:
        to = rollback_target(records, current)
        if to is None:
            raise UsageError(
                f"{model} has no version to roll back to: the ledger shows nothing that "
                f"served before v{current}" if current is not None else
                f"{model} has never been released, so there is nothing to roll back",
                hint=f"pass --to V with a version that served before, or release one with "
                f"`modelship promote {model} --version V`", model=model)
    if not served_before(records, to) and not force:
        raise UsageError(
            f"refusing to roll {model} back to v{to}: it never served in production (the "
            "ledger has no release of it)",
            hint=f"release it with `modelship promote {model} --version {to}`, which checks "
            "and canaries it, or pass --force (recorded)", model=model, version=to)
    digest = read_candidate_digest(clients.storage, repository_prefix=settings.repository_prefix,
                                   model=model, version=to)
    footprint = recorded_footprint_for(records, digest, progress)
    sized = {k: footprint[k] for k in ("footprint_bytes", "footprint_detail")}
    plan = {"model": model, "from_version": current, "to_version": to, "digest": digest,
            "forced": force and not served_before(records, to), "sized": sized,
            "footprint": footprint["evidence"]}
    if dry_run:
        report = swap_unlocked(settings, clients, policy, model=model, target=to,
                               dry_run=True, converge=converge_needed(doc),
                               progress=progress, **sized)
        return {"model": model, "from_version": current, "to_version": to, "dry_run": True,
                "swap": {**report, "footprint": footprint["evidence"]}}, doc
    return plan, doc


def history(clients: Clients, *, model: str) -> list[dict[str, Any]]:
    """Every ledger record of ``model``, newest first."""
    if clients.storage is None:
        raise UsageError("history reads the ledger in S3, and no S3 is configured",
                         hint="run `modelship stack up` or set MODELSHIP_S3_ENDPOINT")
    return [r.to_dict() for r in ledger_of(clients).records(model)]
