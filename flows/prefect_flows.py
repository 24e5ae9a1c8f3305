"""Prefect flows for deployments (``prefect.yaml``): thin wrappers that build the clients
once from settings and call the same composed stages the CLI calls.

Parameters are pydantic models, and every flow takes ``dry_run``. Retries are left to the
stages (a failed validation or gate is final; only transient I/O is retried).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from prefect import flow
from pydantic import BaseModel, Field

from flows import standalone
from modelship.clients import build_clients
from modelship.policy import policy_for
from modelship.settings import load_settings
from modelship.signals import stop_on_signals
from tasks.check import run_check


class CheckParams(BaseModel):
    """Which version to check (and stage)."""

    model: str = Field(description="Registered model name.")
    version: int | None = Field(default=None, description="Model version.")
    alias: str | None = Field(default=None, description="Or a model alias, e.g. candidate.")
    stage: bool = Field(default=True, description="Stage in S3 after the checks pass.")
    dry_run: bool = Field(default=False, description="Check only; never stage.")


class SwapParams(BaseModel):
    """A fleet swap: no default version, so a Quick Run never changes production."""

    model: str = Field(description="Registered model name.")
    version: int = Field(description="The staged version to serve (needs a passing canary "
                         "on record, or force).")
    force: bool = Field(default=False, description="Swap without canary evidence (recorded).")
    dry_run: bool = Field(default=True, description="Plan only; change nothing.")


class RollbackParams(BaseModel):
    """A rollback to what served before."""

    model: str = Field(description="Registered model name.")
    version: int | None = Field(default=None, description="Target version (default: what "
                                "served before, as the ledger says).")
    dry_run: bool = Field(default=True, description="Plan only; change nothing.")


@flow(name="modelship-check", log_prints=True)
def check_flow(params: CheckParams) -> dict[str, Any]:
    """Resolve, export, validate, trial-load and (unless dry_run) stage one version."""
    settings = load_settings()
    clients = build_clients(settings)
    try:
        # The folder goes with the run, so no Data Docs are built into it (their paths would
        # dangle in the report), and a passed check of the same bytes and policy is reused.
        with tempfile.TemporaryDirectory(prefix="modelship-check-") as tmp:
            report = run_check(settings, clients, policy_for(params.model, settings.policies_dir),
                               model=params.model, version=params.version, alias=params.alias,
                               workdir=Path(tmp), stage=params.stage and not params.dry_run,
                               docs=False, progress=print)
            return report.to_dict()
    finally:
        clients.close()


@flow(name="modelship-swap", log_prints=True)
def swap_flow(params: SwapParams) -> dict[str, Any]:
    """Swap every replica to a staged version (atomic, batching paused by policy)."""
    settings = load_settings()
    clients = build_clients(settings)
    try:
        with stop_on_signals():  # a cancel (SIGTERM) stops it cleanly: aborted or undone
            return standalone.swap(settings, clients,
                                   policy_for(params.model, settings.policies_dir),
                              model=params.model, target=params.version, force=params.force,
                              dry_run=params.dry_run, requester="deployment", progress=print)
    finally:
        clients.close()


@flow(name="modelship-rollback", log_prints=True)
def rollback_flow(params: RollbackParams) -> dict[str, Any]:
    """Move the production alias back first, then swap every replica back."""
    settings = load_settings()
    clients = build_clients(settings)
    try:
        with stop_on_signals():  # a cancel (SIGTERM) stops it cleanly: aborted or undone
            return standalone.rollback(settings, clients,
                                  policy_for(params.model, settings.policies_dir),
                                  model=params.model, to=params.version,
                                  dry_run=params.dry_run, requester="deployment",
                                  progress=print)
    finally:
        clients.close()
