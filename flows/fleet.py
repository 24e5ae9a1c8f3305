"""Fleet operations: swap, rollback, status and the canary on its own. They compose tasks.

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

from collections.abc import Callable
from typing import Any

from model_registry.client import PREVIOUS_ALIAS, PRODUCTION_ALIAS
from model_registry.ledger import (
    Ledger,
    ReleaseRecord,
    last_release,
    now_iso,
    rollback_target,
    served_before,
)
from modelship.clients import Clients
from modelship.errors import ModelNotFound, ModelshipError, PreflightError, UsageError
from modelship.locks import release_lock
from modelship.policy import Policy
from modelship.settings import Settings
from modelship.signing import key_bytes
from modelship.triton.model_config import example_request
from tasks.evidence import read_candidate_digest, require_evidence
from tasks.stage import prune_versions, staged_config

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    """The default progress sink: say nothing."""


def _require_fleet(clients: Clients) -> None:
    if not clients.replicas:
        raise UsageError("no Triton replicas are configured",
                         hint="run `modelship stack up` or set MODELSHIP_TRITON_REPLICAS")
    if clients.storage is None:
        raise UsageError("no S3 repository is configured",
                         hint="run `modelship stack up` or set MODELSHIP_S3_ENDPOINT")


def _ledger(clients: Clients) -> Ledger:
    assert clients.storage is not None
    return Ledger(clients.storage)


def swap_unlocked(settings: Settings, clients: Clients, policy: Policy, *, model: str,
                  target: int, dry_run: bool = False, converge: bool = False,
                  progress: Progress = _quiet,
                  footprint_bytes: int | None = None,
                  footprint_detail: str | None = None) -> dict[str, Any]:
    """The fleet swap itself (DESIGN §4); the caller holds the model's release lock.

    ``footprint_bytes`` is C's GPU footprint measured by the canary, for the headroom
    preflight (None: estimated from C's initializers); ``footprint_detail`` says where it
    was read (a release record)."""
    from tasks.swap import swap_fleet

    _require_fleet(clients)
    assert clients.storage is not None
    config = staged_config(clients.storage, repository_prefix=settings.repository_prefix,
                           model=model, version=target)
    report = swap_fleet(
        clients.replicas, model=model, target=target, storage=clients.storage,
        repository_prefix=settings.repository_prefix, policy=policy.swap,
        probe_feed=example_request(config), probe_outputs=[o.name for o in config.output],
        signing_key=key_bytes(settings.manifest_signing_key),
        progress=progress, http_timeout_s=settings.http_timeout_s, dry_run=dry_run,
        converge=converge, gpu=policy.triton.gpu, footprint_bytes=footprint_bytes,
        footprint_detail=footprint_detail)
    return report.to_dict()


def _recorded_footprint(records: list[ReleaseRecord], digest: dict[str, Any],
                        progress: Progress) -> dict[str, Any]:
    """C's canary-measured GPU footprint from the ledger, for the headroom preflight of a
    swap or rollback outside a release (``swap_unlocked``'s footprint keywords)."""
    from tasks.swap import recorded_footprint

    found = recorded_footprint(records, digest=digest)
    progress(f"GPU footprint for the headroom preflight: {found.detail}")
    return {"footprint_bytes": found.bytes_per_gpu, "footprint_detail": found.detail,
            "evidence": found.to_dict()}


def undo_swap(settings: Settings, clients: Clients, policy: Policy, *, model: str,
              previous: int | None, progress: Progress = _quiet) -> dict[str, Any]:
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
             progress: Progress = _quiet) -> dict[str, Any]:
    """Undo a first release: no replica serves ``model``, and its production pin is gone,
    so reconcile (and a restarted replica) cannot load the withdrawn version back."""
    from tasks.stage import CONFIG_NAME, model_prefix

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


def _serving(clients: Clients, model: str) -> tuple[int | None, dict[str, Any]]:
    """What every replica serves (None: nothing, or a mixed fleet), and the status."""
    doc = status(clients, model=model)
    return doc["production_version"], doc


def _converge_needed(doc: dict[str, Any]) -> bool:
    return not doc.get("consistent") and any(r.get("ready_versions")
                                             for r in doc.get("replicas", []))


def _finish(ledger: Ledger, record: ReleaseRecord, status_: str, code: int,
            reason: str | None) -> None:
    record.finish(status_, code, reason)
    ledger.write(record)


def swap(settings: Settings, clients: Clients, policy: Policy, *, model: str, target: int,
         force: bool = False, dry_run: bool = False, requester: str | None = None,
         progress: Progress = _quiet) -> dict[str, Any]:
    """``modelship swap``: evidence, lock, swap, aliases; recorded in the ledger."""
    _require_fleet(clients)
    assert clients.storage is not None
    ledger = _ledger(clients)
    digest = read_candidate_digest(clients.storage, repository_prefix=settings.repository_prefix,
                                   model=model, version=target)
    serving, doc = _serving(clients, model)
    records = ledger.records(model)
    converge = _converge_needed(doc)
    evidence = require_evidence(records, model=model, digest=digest, serving=serving,
                                force=force)
    footprint = _recorded_footprint(records, digest, progress)
    sized = {k: footprint[k] for k in ("footprint_bytes", "footprint_detail")}
    if dry_run:
        report = swap_unlocked(settings, clients, policy, model=model, target=target,
                               dry_run=True, converge=converge, progress=progress, **sized)
        return {**report, "evidence": evidence, "footprint": footprint["evidence"]}
    record = ReleaseRecord.start("swap", model, requester=requester, from_version=serving,
                                 to_version=target, candidate=digest,
                                 forced=evidence["basis"] == "forced")
    record.gates = {"evidence": evidence}
    with release_lock(model, storage=clients.storage, home=settings.home,
                      release_id=record.id, kind="swap"):
        ledger.write(record)
        try:
            report = swap_unlocked(settings, clients, policy, model=model, target=target,
                                   converge=converge, progress=progress, **sized)
            record.swap = {**report, "footprint": footprint["evidence"]}
            if clients.registry is not None and report.get("kind") != "noop":
                _move_aliases(clients, model, to=target, served=serving)
        except ModelshipError as exc:
            _finish(ledger, record, "failed", exc.exit_code, exc.message)
            raise
    _finish(ledger, record, "noop" if report.get("kind") == "noop" else "released", 0,
            None)
    return {**report, "release_id": record.id, "evidence": evidence,
            "footprint": footprint["evidence"]}


def status(clients: Clients, *, model: str) -> dict[str, Any]:
    """What serves where: per replica the ready versions and the config digest, the
    aliases, and the last release in the ledger."""
    from tasks.swap import fleet_status

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
    last = None
    if clients.storage is not None:
        try:
            found = last_release(_ledger(clients).records(model))
            last = None if found is None else {
                "id": found.id, "kind": found.kind, "status": found.status,
                "from_version": found.from_version, "to_version": found.to_version,
                "finished_at": found.finished_at, "exit_code": found.exit_code}
        except ModelshipError as exc:
            last = {"error": exc.message}
    return {
        **{k: v for k, v in fleet.items() if k not in ("model", "replicas", "consistent")},
        "model": model,
        "production_version": serving,
        "aliases": aliases,
        "consistent": fleet["consistent"],
        "replicas": fleet["replicas"],
        "last_release": last,
        **({"registry_error": alias_error} if alias_error else {}),
    }


def rollback(settings: Settings, clients: Clients, policy: Policy, *, model: str,
             to: int | None, force: bool = False, dry_run: bool = False,
             requester: str | None = None, progress: Progress = _quiet) -> dict[str, Any]:
    """Alias first, then the fleet; the alias is put back on any failure."""
    _require_fleet(clients)
    if clients.registry is None:
        raise UsageError("rollback needs MLflow to move the production alias",
                         hint="set MLFLOW_TRACKING_URI or run `modelship stack up`")
    assert clients.storage is not None
    ledger = _ledger(clients)
    aliases = clients.registry.aliases(model)
    if to is not None:
        clients.registry.version_number(model, version=to, alias=None)  # names what exists
    serving, doc = _serving(clients, model)
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
    converge = _converge_needed(doc)
    digest = read_candidate_digest(clients.storage, repository_prefix=settings.repository_prefix,
                                   model=model, version=to)
    footprint = _recorded_footprint(records, digest, progress)
    sized = {k: footprint[k] for k in ("footprint_bytes", "footprint_detail")}
    if dry_run:
        report = swap_unlocked(settings, clients, policy, model=model, target=to,
                               dry_run=True, converge=converge, progress=progress, **sized)
        return {"model": model, "from_version": current, "to_version": to, "dry_run": True,
                "swap": {**report, "footprint": footprint["evidence"]}}
    record = ReleaseRecord.start("rollback", model, requester=requester, from_version=current,
                                 to_version=to, forced=force and not served_before(records, to))
    record.candidate = digest
    old_production = aliases.get(PRODUCTION_ALIAS)
    with release_lock(model, storage=clients.storage, home=settings.home,
                      release_id=record.id, kind="rollback"):
        ledger.write(record)
        progress(f"moving alias {PRODUCTION_ALIAS} of {model} to v{to} (first)")
        clients.registry.set_alias(model, PRODUCTION_ALIAS, to)
        try:
            report = {**swap_unlocked(settings, clients, policy, model=model, target=to,
                                      converge=converge, progress=progress, **sized),
                      "footprint": footprint["evidence"]}
        except BaseException as exc:
            if old_production is not None:
                progress(f"rollback failed: putting alias {PRODUCTION_ALIAS} back on "
                         f"v{old_production}")
                clients.registry.set_alias(model, PRODUCTION_ALIAS, old_production)
            code = exc.exit_code if isinstance(exc, ModelshipError) else 1
            _finish(ledger, record, "failed", code, str(exc))
            raise
        record.swap = report
        if current is not None and current != to:
            clients.registry.set_alias(model, PREVIOUS_ALIAS, current)
        clients.registry.set_tags(model, to, {"modelship.rolled_back_from": str(current),
                                              "modelship.release_id": record.id})
    _finish(ledger, record, "released", 0, f"rolled back from v{current}")
    return {"model": model, "from_version": current, "to_version": to, "dry_run": False,
            "release_id": record.id, "aliases": clients.registry.aliases(model),
            "swap": report}


def history(clients: Clients, *, model: str) -> list[dict[str, Any]]:
    """Every ledger record of ``model``, newest first."""
    if clients.storage is None:
        raise UsageError("history reads the ledger in S3, and no S3 is configured",
                         hint="run `modelship stack up` or set MODELSHIP_S3_ENDPOINT")
    return [r.to_dict() for r in _ledger(clients).records(model)]


def canary(settings: Settings, clients: Clients, policy: Policy, *, model: str, version: int,
           progress: Progress = _quiet) -> dict[str, Any]:
    """Stage if needed, then the canary against the version in production, and the gates.

    No swap. The result is recorded in the ledger (kind ``canary``), so a later
    ``swap --to V`` finds its evidence. On a first release only absolute gates apply.
    """
    import tempfile
    from pathlib import Path

    from flows.check import run_check
    from tasks.canary import run_canary
    from tasks.stage import manifest_key

    if clients.storage is None or clients.canary is None:
        raise UsageError("the canary needs an S3 repository and a canary Triton",
                         hint="run `modelship stack up` or set MODELSHIP_S3_ENDPOINT and "
                         "MODELSHIP_TRITON_CANARY")
    if not clients.storage.exists(manifest_key(settings.repository_prefix, model, version)):
        progress(f"{model} v{version} is not staged yet: checking and staging it first")
        with tempfile.TemporaryDirectory(prefix="modelship-canary-") as tmp:
            run_check(settings, clients, policy, model=model, version=version,
                      workdir=Path(tmp), stage=True, progress=progress)
    baseline, doc = _serving(clients, model) if clients.replicas else (None, {})
    if baseline is None and _converge_needed(doc):
        raise PreflightError(
            f"the replicas of {model} disagree on the version they serve, so there is no "
            "baseline to compare with",
            hint=f"converge them first with `modelship rollback {model}` or `modelship swap "
            f"{model} --to V`", model=model)
    if baseline == version:
        progress(f"{model} v{version} is already in production: nothing to compare")
        return {"model": model, "candidate": version, "baseline": baseline, "verdict": "noop",
                "message": f"v{version} already serves in production"}
    ledger = _ledger(clients)
    record = ReleaseRecord.start("canary", model, from_version=baseline, to_version=version,
                                 candidate=read_candidate_digest(
                                     clients.storage,
                                     repository_prefix=settings.repository_prefix,
                                     model=model, version=version))
    with release_lock(model, storage=clients.storage, home=settings.home,
                      release_id=record.id, kind="canary"):
        result = run_canary(settings, clients, policy, model=model, candidate=version,
                            baseline=baseline, progress=progress)
    keys = {kind: ledger.attach(record, Path(path).name, Path(path))
            for kind, path in (result.report_paths or {}).items()
            if path and Path(path).exists()}
    gates = result.gate_report.to_dict()
    record.gates = {"verdict": result.verdict, "baseline": baseline, "candidate": version,
                    "results": gates.get("results", []), "report_keys": keys,
                    # C's measured GPU footprint: a later `swap --to V` sizes its headroom by it
                    "gpu": result.gpu.to_dict() if result.gpu is not None else None}
    record.candidate["canary_report_id"] = record.id
    code = {"passed": 0, "failed": 4, "inconclusive": 6}.get(result.verdict, 1)
    _finish(ledger, record, "passed" if code == 0 else "rejected", code, None)
    return {**dict(result.to_dict()), "release_id": record.id}
