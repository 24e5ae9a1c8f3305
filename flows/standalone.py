"""The fleet commands on their own: ``swap``, ``rollback`` and the ``canary``. They compose
the fleet tasks of :mod:`tasks.fleet`; every I/O call is there or in :mod:`tasks`.

Every path that changes the fleet keeps MLflow true and leaves a ledger record:

- ``swap`` swaps only a candidate whose passing canary is on record for its digest against
  what serves now (or a version that served before, or ``--force``, recorded), under the
  model's release lock, then moves ``previous`` to what served and ``production`` to the
  target.
- ``rollback`` picks its default target from the ledger (what served before the current
  version), refuses a version that never served (unless ``--force``), moves the
  ``production`` alias **first**, swaps back, and puts the alias back on any failure.
- A fleet left mixed by a crashed coordinator is converged by ``swap --to V`` and
  ``rollback``: the plan says so.
- The GPU headroom preflight of ``swap`` and ``rollback`` uses the footprint the target's
  canary measured, read from the ledger when the staged digest matches
  (:func:`tasks.swap.recorded_footprint`), else the estimate; ``footprint`` in the output
  says which.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from model_registry.client import PRODUCTION_ALIAS
from modelship.candidate import ReleaseCandidate
from modelship.clients import Clients
from modelship.errors import PreflightError, UsageError
from modelship.ledger import Ledger, ReleaseRecord, now_iso
from modelship.locks import release_lock
from modelship.policy import Policy
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.slack.blocks import gate_lines
from tasks import fleet
from tasks.check import run_check, stage_checked
from tasks.evidence import read_candidate_digest, release_candidate
from tasks.record import ReleaseJournal


def swap(settings: Settings, clients: Clients, policy: Policy, *, model: str, target: int,
         force: bool = False, dry_run: bool = False, requester: str | None = None,
         progress: Progress = quiet) -> dict[str, Any]:
    """``modelship swap``: under the model's lock, first finish or undo what dead or
    incomplete releases left; then evidence, the intent, the swap, and released (tag,
    ``previous``, ``production`` last) or undone on every way out. A no-op repairs the
    pin, the tag and the aliases to what serves. Journaled as a release is: the record,
    its stages and the Slack thread."""
    fleet.require_fleet(clients)
    assert clients.storage is not None
    ledger = fleet.ledger_of(clients)
    digest = read_candidate_digest(clients.storage, repository_prefix=settings.repository_prefix,
                                   model=model, version=target)
    if dry_run:
        serving, doc = fleet.serving_now(clients, model)
        evidence, footprint = fleet.swap_evidence(ledger, model=model, digest=digest,
                                                  serving=serving, force=force,
                                                  progress=progress)
        report = fleet.swap_unlocked(settings, clients, policy, model=model, target=target,
                                     dry_run=True, converge=fleet.converge_needed(doc),
                                     progress=progress, **_sized(footprint))
        return {**report, "evidence": evidence, "footprint": footprint["evidence"]}
    record = ReleaseRecord.start("swap", model, requester=requester, to_version=target,
                                 candidate=digest)
    with _locked_change(settings, clients, policy, ledger, record, what="swap",
                        progress=progress) as journal:
        serving, doc = fleet.serving_now(clients, model)
        evidence, footprint = fleet.swap_evidence(ledger, model=model, digest=digest,
                                                  serving=serving, force=force,
                                                  progress=progress)
        record.from_version, record.forced = serving, evidence["basis"] == "forced"
        record.gates = {"evidence": evidence}
        fleet.begin_change(settings, journal, clients, doc=doc, target=target)
        with fleet.ending(settings, clients, policy, journal, progress=progress):
            with journal.stage("swap") as entry:
                report = fleet.swap_unlocked(settings, clients, policy, model=model,
                                             target=target, converge=fleet.converge_needed(doc),
                                             progress=progress, **_sized(footprint))
                record.swap = {**report, "footprint": footprint["evidence"]}
                entry.details.update(kind=report.get("kind"), skew_ms=report.get("skew_ms"))
                if report.get("kind") != "noop":
                    # switched: the point of no return of a plain swap, saved with the stage
                    record.intent["committed_at"] = now_iso()
            if report.get("kind") == "noop":
                repaired = fleet.repair_stage(settings, clients, policy, journal, target)
                record.notes.extend(f"repaired: {line}" for line in repaired)
                record.intent = {}  # nothing changed the fleet: nothing to finish or undo
                journal.finish("noop", 0, f"v{target} already serves"
                               + (f"; repaired {'; '.join(repaired)}" if repaired else ""))
                return {**report, "release_id": record.id, "evidence": evidence,
                        "footprint": footprint["evidence"], "repaired": repaired}
    return {**report, "release_id": record.id, "evidence": evidence,
            "footprint": footprint["evidence"], "status": record.status}


def rollback(settings: Settings, clients: Clients, policy: Policy, *, model: str,
             to: int | None, force: bool = False, dry_run: bool = False,
             requester: str | None = None, progress: Progress = quiet) -> dict[str, Any]:
    """Under the model's lock, first finish or undo what dead or incomplete releases left;
    then the intent, the ``production`` alias first, the fleet, and released (tag,
    ``previous``) or undone (fleet and alias back) on every way out. A live release of the
    model (say in its bake) is named, with how to stop it. Journaled as a release is."""
    fleet.require_fleet(clients)
    if clients.registry is None:
        raise UsageError("rollback needs MLflow to move the production alias",
                         hint="set MLFLOW_TRACKING_URI or run `modelship stack up`")
    assert clients.storage is not None
    ledger = fleet.ledger_of(clients)
    if to is not None:
        fleet.require_version(clients, model, to)  # names the versions that exist
    if dry_run:
        return fleet.rollback_plan(settings, clients, policy, ledger, model=model, to=to,
                                   force=force, dry_run=True, progress=progress)[0]
    record = ReleaseRecord.start("rollback", model, requester=requester)
    with _locked_change(settings, clients, policy, ledger, record, what="roll back",
                        progress=progress) as journal:
        plan, doc = fleet.rollback_plan(settings, clients, policy, ledger, model=model, to=to,
                                        force=force, dry_run=False, progress=progress)
        current, target = plan["from_version"], plan["to_version"]
        record.from_version, record.to_version = current, target
        record.candidate, record.forced = plan["digest"], plan["forced"]
        fleet.begin_change(settings, journal, clients, doc=doc, target=target)

        def stopped(exc: BaseException) -> None:
            progress(f"rollback stopped ({type(exc).__name__}): putting the fleet and alias "
                     f"{PRODUCTION_ALIAS} back on {'nothing' if current is None else current}")

        with fleet.ending(settings, clients, policy, journal, progress=progress,
                          on_stop=stopped):
            with journal.stage("swap") as entry:
                progress(f"moving alias {PRODUCTION_ALIAS} of {model} to v{target} (first)")
                fleet.set_production(clients, model, target)
                report = {**fleet.swap_unlocked(settings, clients, policy, model=model,
                                                target=target,
                                                converge=fleet.converge_needed(doc),
                                                progress=progress, **plan["sized"]),
                          "footprint": plan["footprint"]}
                record.swap = report
                entry.details.update(kind=report.get("kind"), skew_ms=report.get("skew_ms"))
                record.intent["committed_at"] = now_iso()  # switched: the point of no return
        fleet.note_rolled_back(clients, journal, current=current, target=target)
    return {"model": model, "from_version": current, "to_version": target, "dry_run": False,
            "release_id": record.id, "aliases": fleet.aliases_now(clients, model),
            "swap": report, "status": record.status}


def canary(settings: Settings, clients: Clients, policy: Policy, *, model: str, version: int,
           progress: Progress = quiet) -> dict[str, Any]:
    """Check and stage if needed, then the canary against the version in production, and
    the gates.

    No swap. The result is recorded in the ledger (kind ``canary``) with its stages (check
    and stage when it staged the version, then canary) and Slack thread, so a later
    ``swap --to V`` finds its evidence. On a first release only absolute gates apply.
    """
    # lazy: tasks.canary (load generator, stats) costs ~2.5 s at import; only `canary` needs it
    from tasks.canary import run_canary

    if clients.storage is None or clients.canary is None:
        raise UsageError("the canary needs an S3 repository and a canary Triton",
                         hint="run `modelship stack up` or set MODELSHIP_S3_ENDPOINT and "
                         "MODELSHIP_TRITON_CANARY")
    baseline, doc = fleet.serving_now(clients, model) if clients.replicas else (None, {})
    if baseline is None and fleet.converge_needed(doc):
        raise PreflightError(
            f"the replicas of {model} disagree on the version they serve, so there is no "
            "baseline to compare with",
            hint=f"converge them first with `modelship rollback {model}` or `modelship swap "
            f"{model} --to V`", model=model)
    if baseline == version:
        progress(f"{model} v{version} is already in production: nothing to compare")
        return {"model": model, "candidate": version, "baseline": baseline, "verdict": "noop",
                "message": f"v{version} already serves in production"}
    record = ReleaseRecord.start("canary", model, from_version=baseline, to_version=version)
    journal = fleet.journal_for(settings, clients, policy, record, progress)
    journal.open()
    try:
        release = _check_and_stage(settings, clients, policy, journal, version, progress)
        record.candidate = dict(release.digest) if release is not None else \
            read_candidate_digest(clients.storage, repository_prefix=settings.repository_prefix,
                                  model=model, version=version)
        with release_lock(model, storage=clients.storage, home=settings.home,
                          release_id=record.id, kind="canary"):
            with journal.stage("canary") as entry:
                result = run_canary(settings, clients, policy, model=model, candidate=version,
                                    baseline=baseline, progress=progress, release=release)
                journal.attach_gates(result)
                record.candidate["canary_report_id"] = record.id
                entry.details["verdict"] = result.verdict
                entry.details["_lines"] = gate_lines(record.gates)
            journal.upload(Path(result.report_paths.get("png") or ""),
                           f"canary {model} v{version} vs "
                           f"{'nothing' if baseline is None else f'v{baseline}'}")
            code = {"passed": 0, "failed": 4, "inconclusive": 6}.get(result.verdict, 1)
            journal.finish("passed" if code == 0 else "rejected", code, None)
    except BaseException as exc:
        if record.status == "running":
            journal.stopped(exc)
        raise
    return {**dict(result.to_dict()), "release_id": record.id}


def _check_and_stage(settings: Settings, clients: Clients, policy: Policy,
                     journal: ReleaseJournal, version: int,
                     progress: Progress) -> ReleaseCandidate | None:
    """The check and stage stages of a canary whose version is not staged yet; its
    candidate as they found it (None when it was staged before: the canary then reads
    its config and rows from S3 and MLflow)."""
    model = journal.record.model
    if fleet.is_staged(settings, clients, model=model, version=version):
        return None
    progress(f"{model} v{version} is not staged yet: checking and staging it first")
    with tempfile.TemporaryDirectory(prefix="modelship-canary-") as tmp:
        with journal.stage("check") as entry:
            report = run_check(settings, clients, policy, model=model, version=version,
                               workdir=Path(tmp), docs=False, progress=progress)
            entry.details["stages"] = report.stages
        with journal.stage("stage") as entry:
            stage_checked(settings, clients, policy, report, progress=progress)
            entry.details.update({k: (report.staged or {}).get(k) for k in
                                  ("bytes_uploaded", "already_staged", "manifest_key")})
    return release_candidate(report)


@contextmanager
def _locked_change(settings: Settings, clients: Clients, policy: Policy, ledger: Ledger,
                   record: ReleaseRecord, *, what: str,
                   progress: Progress) -> Iterator[ReleaseJournal]:
    """A standalone fleet change (``record.kind``: swap or rollback), journaled: refused
    while a release of the model runs, then under the model's release lock, after what
    dead or incomplete releases left is finished or undone (noted on the record)."""
    fleet.refuse_while_running(ledger, record.model, what=what)
    journal = fleet.journal_for(settings, clients, policy, record, progress)
    with release_lock(record.model, storage=clients.storage, home=settings.home,
                      release_id=record.id, kind=record.kind):
        _note_recovered(record, fleet.recover_model(settings, clients, policy,
                                                    model=record.model, by=record.id,
                                                    progress=progress))
        yield journal


def _sized(footprint: dict[str, Any]) -> dict[str, Any]:
    """The footprint keywords of :func:`tasks.fleet.swap_unlocked`."""
    return {k: footprint[k] for k in ("footprint_bytes", "footprint_detail")}


def _note_recovered(record: ReleaseRecord, recovered: dict[str, Any]) -> None:
    if recovered["finished"]:
        record.notes.append(f"finished first: {recovered['finished']}")
