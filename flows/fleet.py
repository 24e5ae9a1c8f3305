"""Fleet operations: swap, rollback, status and load. They only compose tasks and clients.

``swap`` moves every replica to a staged version under the model's release lock.
``rollback`` moves the MLflow ``production`` alias **first**, then swaps back (previous
versions stay in the S3 repository, so no export and no canary are needed); if the swap
aborts, the alias is put back so the record never lies about what serves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from model_registry.client import PREVIOUS_ALIAS, PRODUCTION_ALIAS
from modelship.clients import Clients
from modelship.errors import ModelNotFound, SwapAborted, UsageError
from modelship.locks import release_lock
from modelship.policy import Policy
from modelship.settings import Settings
from modelship.triton.model_config import example_request
from tasks.stage import staged_config

Progress = Callable[[str], None]


def _require_fleet(clients: Clients) -> None:
    if not clients.replicas:
        raise UsageError("no Triton replicas are configured",
                         hint="run `modelship stack up` or set MODELSHIP_TRITON_REPLICAS")
    if clients.storage is None:
        raise UsageError("no S3 repository is configured",
                         hint="run `modelship stack up` or set MODELSHIP_S3_ENDPOINT")


def swap(settings: Settings, clients: Clients, policy: Policy, *, model: str, target: int,
         dry_run: bool = False, progress: Progress = lambda _: None) -> dict[str, Any]:
    """The fleet swap alone, for a staged version, under the model's release lock."""
    from tasks.swap import swap_fleet

    _require_fleet(clients)
    assert clients.storage is not None
    config = staged_config(clients.storage, repository_prefix=settings.repository_prefix,
                           model=model, version=target)
    with release_lock(model, prefect_api_url=settings.prefect_api_url, home=settings.home):
        report = swap_fleet(
            clients.replicas, model=model, target=target, storage=clients.storage,
            repository_prefix=settings.repository_prefix, policy=policy.swap,
            probe_feed=example_request(config), probe_outputs=[o.name for o in config.output],
            progress=progress, http_timeout_s=settings.http_timeout_s, dry_run=dry_run)
    return report.to_dict()


def status(clients: Clients, *, model: str) -> dict[str, Any]:
    """What serves where: per replica the ready versions and the config digest."""
    from tasks.swap import fleet_status

    fleet = fleet_status(clients.replicas, model)
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
    return {
        "model": model,
        "production_version": serving,
        "aliases": aliases,
        "consistent": fleet["consistent"],
        "replicas": fleet["replicas"],
        **({"registry_error": alias_error} if alias_error else {}),
    }


def rollback(settings: Settings, clients: Clients, policy: Policy, *, model: str,
             to: int | None, dry_run: bool = False,
             progress: Progress = lambda _: None) -> dict[str, Any]:
    """Alias first, then the fleet; previous versions are still staged in S3."""
    from tasks.stage import staged_versions

    _require_fleet(clients)
    if clients.registry is None:
        raise UsageError("rollback needs MLflow to move the production alias",
                         hint="set MLFLOW_TRACKING_URI or run `modelship stack up`")
    assert clients.storage is not None
    aliases = clients.registry.aliases(model)
    current = status(clients, model=model)["production_version"] or aliases.get(PRODUCTION_ALIAS)
    if to is None:
        to = aliases.get(PREVIOUS_ALIAS)
        if to is None or to == current:
            older = [v for v in staged_versions(clients.storage, model=model,
                                                repository_prefix=settings.repository_prefix)
                     if current is None or v < current]
            if not older:
                raise UsageError(
                    f"{model} has no previous version to roll back to (serving v{current})",
                    hint="pass --to V with a staged version")
            to = max(older)
    if to == current:
        progress(f"{model} v{to} is already in production; nothing to roll back")
    if dry_run:
        result = swap(settings, clients, policy, model=model, target=to, dry_run=True,
                      progress=progress)
        return {"model": model, "from_version": current, "to_version": to, "dry_run": True,
                "swap": result}
    old_production = aliases.get(PRODUCTION_ALIAS)
    progress(f"moving alias {PRODUCTION_ALIAS} of {model} to v{to} (first)")
    clients.registry.set_alias(model, PRODUCTION_ALIAS, to)
    try:
        result = swap(settings, clients, policy, model=model, target=to, progress=progress)
    except SwapAborted:
        if old_production is not None:
            progress(f"swap aborted: putting alias {PRODUCTION_ALIAS} back on v{old_production}")
            clients.registry.set_alias(model, PRODUCTION_ALIAS, old_production)
        raise
    if current is not None and current != to:
        clients.registry.set_alias(model, PREVIOUS_ALIAS, current)
    clients.registry.set_tags(model, to, {"modelship.rolled_back_from": str(current)})
    return {"model": model, "from_version": current, "to_version": to, "dry_run": False,
            "aliases": clients.registry.aliases(model), "swap": result}


def canary(settings: Settings, clients: Clients, policy: Policy, *, model: str, version: int,
           progress: Progress = lambda _: None) -> dict[str, Any]:
    """Stage if needed, then the canary against the version in production, and the gates.

    No swap. The baseline is what the fleet serves (else the ``production`` alias); on a
    first release there is none and only absolute gates apply.
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
    baseline = status(clients, model=model)["production_version"] if clients.replicas else None
    if baseline is None and clients.registry is not None:
        baseline = clients.registry.aliases(model).get(PRODUCTION_ALIAS)
    if baseline == version:
        progress(f"{model} v{version} is already in production: nothing to compare")
        return {"model": model, "candidate": version, "baseline": baseline, "verdict": "noop",
                "message": f"v{version} already serves in production"}
    with release_lock(model, prefect_api_url=settings.prefect_api_url, home=settings.home):
        result = run_canary(settings, clients, policy, model=model, candidate=version,
                            baseline=baseline, progress=progress)
    return dict(result.to_dict())
