"""The promote flow's Prefect tasks: one side effect each, readable run names, retries only
on transient errors (STYLE §7). :mod:`flows.promote` only composes them.

Each task is a thin wrapper over a plain function of ``tasks/`` (the CLI's standalone
commands call those functions directly: outside a flow run a Prefect task would need the
API). Also here: what the flow writes to Prefect itself (the gate table, the release
record artifact) and to the ledger next to the record (the canary's report files).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from prefect import Flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext
from pydantic import BaseModel

from modelship.candidate import ReleaseCandidate
from modelship.clients import Clients
from modelship.errors import GateFailed, GatesInconclusive, PreflightError, UsageError
from modelship.ledger import Ledger, ReleaseRecord
from modelship.policy import Policy
from modelship.settings import Settings
from tasks import bake as baking
from tasks import fleet
from tasks.approve import ApprovalChannels, ApprovalRequest, approve
from tasks.canary import CanaryResult, run_canary
from tasks.check import CheckReport, run_check, stage_checked
from tasks.record import ReleaseJournal
from tasks.recovery import dead_runs, unfinished
from tasks.report import artifact_key
from tasks.retry import TRANSIENT_RETRIES, retry_transient

P = ParamSpec("P")
R = TypeVar("R")


class ModelParamsFlow(Flow[P, R]):
    """A Prefect flow whose parameters are pydantic models, sent to the API as pydantic's
    own JSON of them (``model_dump(mode="json", by_alias=True)``: what FastAPI's
    ``jsonable_encoder``, Prefect's default, returns for a model). The default imports
    FastAPI (0.4-1.2 s) in every process that starts a flow run, for this call alone."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        if parameters and all(isinstance(value, BaseModel) and not isinstance(value, State)
                              for value in parameters.values()):
            return {key: value.model_dump(mode="json", by_alias=True)
                    for key, value in parameters.items()}
        return super().serialize_parameters(parameters)


def model_params_flow(**options: Any) -> Callable[[Callable[P, R]], ModelParamsFlow[P, R]]:
    """``@flow(**options)`` building a :class:`ModelParamsFlow`."""

    def build(fn: Callable[P, R]) -> ModelParamsFlow[P, R]:
        return ModelParamsFlow(fn, **options)

    return build


@task(name="resolve", task_run_name="resolve {model}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def resolve_task(clients: Clients, model: str, version: int | None,
                 alias: str | None) -> dict[str, Any]:
    """The concrete version, and what the fleet and the registry say serves now."""
    if clients.registry is None:
        raise UsageError("promote needs MLflow", hint="run `modelship stack up` or set "
                         "MLFLOW_TRACKING_URI")
    number = clients.registry.version_number(model, version=version, alias=alias)
    # what serves and the aliases; the last release (every record of the model) is unused
    status = fleet.status(clients, model=model, last=False) if clients.replicas else {}
    serving = status.get("production_version")
    if serving is None and any(r.get("ready_versions") for r in status.get("replicas", [])):
        raise PreflightError(
            f"the replicas of {model} disagree on what they serve, so a release has no "
            "baseline; nothing was changed",
            hint=f"converge the fleet first: `modelship rollback {model}` or `modelship swap "
            f"{model} --to V` (`modelship status {model}` shows each replica)", model=model)
    return {"version": number, "serving": serving, "consistent": status.get("consistent"),
            "aliases": status.get("aliases", {})}


@task(name="check", task_run_name="check {model} v{version}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def check_task(settings: Settings, clients: Clients, policy: Policy, model: str, version: int,
               workdir: Path, allow_breaking: bool) -> CheckReport:
    """Export, validate (contract, config lint, GX), and trial-load the candidate."""
    # no Data Docs: the promote flow removes the check's folder after the stage
    return run_check(settings, clients, policy, model=model, version=version, workdir=workdir,
                     allow_breaking_changes=allow_breaking, docs=False,
                     progress=get_run_logger().info)


@task(name="stage", task_run_name="stage {model} v{version}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def stage_task(settings: Settings, clients: Clients, policy: Policy, report: CheckReport,
               model: str, version: int, dry_run: bool) -> dict[str, Any]:
    """Publish the candidate in the S3 repository (idempotent; the manifest goes last)."""
    stage_checked(settings, clients, policy, report, dry_run=dry_run,
                  progress=get_run_logger().info)
    return report.staged or {}


@task(name="canary", task_run_name="canary {model} v{candidate} vs {baseline}",
      cache_policy=NO_CACHE)
def canary_task(settings: Settings, clients: Clients, policy: Policy, model: str,
                candidate: int, baseline: int | None, keep_loaded: bool = False,
                release: ReleaseCandidate | None = None) -> CanaryResult:
    """The candidate next to production on the canary Triton, under load; with
    ``keep_loaded`` (approval required) it stays loaded for the approval wait's watcher.
    ``release`` carries C's config and golden rows (nothing about C is read again)."""
    return run_canary(settings, clients, policy, model=model, candidate=candidate,
                      baseline=baseline, progress=get_run_logger().info,
                      keep_loaded=keep_loaded, release=release)


@task(name="gates", task_run_name="gates {model} v{candidate}", cache_policy=NO_CACHE)
def gates_task(result: CanaryResult, model: str, candidate: int) -> str:
    """Pass, or stop the release: failed (exit 4) or inconclusive (exit 6)."""
    rows = [{k: r.get(k) for k in ("rule", "metric", "verdict", "value", "baseline",
                                    "threshold", "p_value", "message")}
            for r in result.gate_report.to_dict()["results"]]
    create_table_artifact(table=rows, key=artifact_key(f"gates-{model}-v{candidate}"),
                          description=f"Gate verdicts of {model} v{candidate}")
    failing = "; ".join(r["message"] for r in rows if r["verdict"] not in ("passed",))
    if result.verdict == "failed":
        raise GateFailed(f"the gates stopped {model} v{candidate}: {failing}",
                         hint=f"production is unchanged; read the canary report "
                         f"({result.report_paths.get('markdown')})", model=model)
    if result.verdict != "passed":
        raise GatesInconclusive(
            f"the gates could not decide on {model} v{candidate} ({result.verdict}): "
            f"{failing}", hint="production is unchanged; run the promotion again with a "
            "longer canary (canary.max_duration_s) or fix the cause named above", model=model)
    return str(result.verdict)


@task(name="approve", task_run_name="approve {model} v{version}", cache_policy=NO_CACHE)
def approve_task(request: ApprovalRequest, journal: ReleaseJournal,
                 channels: ApprovalChannels, model: str, version: int) -> dict[str, Any]:
    """Wait for an approval when one is required: the run pauses, and only a checked
    decision resumes it; expiry fails closed (exit 5)."""
    return approve(request, journal, channels, model=model, version=version)


@task(name="swap", task_run_name="swap {model} v{from_version} -> v{version}",
      cache_policy=NO_CACHE)
def swap_task(settings: Settings, clients: Clients, policy: Policy, model: str, version: int,
              from_version: int | None, footprint_bytes: int | None = None,
              config_pbtxt: str | None = None) -> dict[str, Any]:
    """Every replica to the candidate at once, batching paused (DESIGN §4); the GPU
    headroom preflight uses the canary's measured footprint when there is one.
    ``config_pbtxt`` is C's staged config when the release carries it (the preflight
    still verifies the staged bytes against the manifest)."""
    return fleet.swap_unlocked(settings, clients, policy, model=model, target=version,
                               progress=get_run_logger().info,
                               footprint_bytes=footprint_bytes, config_pbtxt=config_pbtxt)


@task(name="baseline", task_run_name="pre-swap window {model} v{version}",
      cache_policy=NO_CACHE)
def baseline_task(settings: Settings, clients: Clients, policy: Policy, model: str,
                  version: int, payload: Any) -> baking.Reference:
    """The bake's reference: the same probe load on production just before the swap, in
    windows (blocks) with the load each saw."""
    return baking.measure_reference(clients.replicas, model=model, version=version,
                                    payload=payload, policy=policy.bake,
                                    timeout_s=settings.http_timeout_s,
                                    progress=get_run_logger().info)


@task(name="bake", task_run_name="bake {model} v{version}", cache_policy=NO_CACHE)
def bake_task(settings: Settings, clients: Clients, policy: Policy, model: str, version: int,
              payload: Any, baseline: baking.Reference | None) -> baking.BakeReport:
    """Watch the fleet after the swap; the verdict decides whether to roll back."""
    return baking.watch(clients.replicas, model=model, version=version, payload=payload,
                        policy=policy.bake, baseline=baseline,
                        timeout_s=settings.http_timeout_s, progress=get_run_logger().info)


@task(name="record", task_run_name="record {model} v{version}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def record_task(settings: Settings, clients: Clients, policy: Policy, record: ReleaseRecord,
                model: str, version: int) -> dict[str, Any]:
    """MLflow last: version tags, ``previous``, then ``production``; prune old versions."""
    return fleet.record_release(settings, clients, policy, record)


@task(name="recover", task_run_name="recover {model}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def recover_task(settings: Settings, clients: Clients, policy: Policy, model: str,
                 by: str) -> dict[str, Any]:
    """Finish or undo what dead or incomplete runs left (fleet, pin, aliases, tags, their
    records), and unload their canary and trial models."""
    return fleet.recover_model(settings, clients, policy, model=model, by=by,
                               progress=get_run_logger().info)


def publish_record(record: ReleaseRecord) -> None:
    """The release record as a Prefect artifact of the flow run."""
    if FlowRunContext.get() is None:
        return
    rows = "\n".join(f"| {s.name} | {s.outcome} | {s.started_at} | {s.ended_at or ''} | "
                     f"{(s.reason or '').replace('|', '/')[:200]} |" for s in record.stages)
    markdown = (f"# Release {record.id}\n\n{record.kind} **{record.model}** "
                f"v{record.from_version} → v{record.to_version}: **{record.status}** "
                f"(exit {record.exit_code})\n\n{record.reason or ''}\n\n"
                "| stage | outcome | started | ended | reason |\n|---|---|---|---|---|\n"
                f"{rows}\n")
    try:
        create_markdown_artifact(markdown=markdown,
                                 key=artifact_key(f"release-{record.model}"),
                                 description=f"Release record {record.id}")
    except Exception as exc:  # noqa: BLE001 - the ledger holds the record either way
        record.notes.append(f"the Prefect artifact could not be written: {exc}")


def needs_recovery(ledger: Ledger, model: str, current: str) -> bool:
    """Whether ``model`` has dead (``running``, process gone) or ``incomplete`` records
    other than ``current``'s, which the release must finish or undo first.

    The model's records are read once (a list and one read per record) for both
    questions: the ledger grows with every release, and a promote asks twice."""
    records = ledger.records(model)
    return bool(dead_runs(_ReadOnce(records), model, current)) or any(
        r.status == "incomplete" for r in unfinished(records, current))


class _ReadOnce:
    """Records already read, in the shape :func:`tasks.recovery.dead_runs` reads."""

    def __init__(self, records: list[ReleaseRecord]) -> None:
        self._records = records

    def records(self, model: str) -> list[ReleaseRecord]:
        return self._records
