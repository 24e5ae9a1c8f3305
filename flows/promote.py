"""The release: one Prefect flow from a registered version to every replica (DESIGN §2).

resolve → check → stage → canary → gates → approve → swap → bake → record. Each stage is
a Prefect task with a readable run name; this module only composes them. The journal
(:mod:`tasks.record`) keeps the release record in the ledger and the Slack thread true as
the release goes, and the model's release lock is held from the canary to the end of the
bake, so no second release of the model (from any trigger) can interleave.

If any stage fails, production keeps serving what it served, and the record says which
stage stopped the release and why. The ``production`` alias moves **last**, after the bake.
"""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from flows import fleet
from flows.check import CheckReport, run_check, stage_checked
from modelship.clients import Clients, build_clients, notifier_for
from modelship.errors import (
    BakeBreached,
    GateFailed,
    GatesInconclusive,
    InfrastructureError,
    ModelshipError,
    PreflightError,
    ReleaseCancelled,
    UsageError,
)
from modelship.ledger import Ledger, ReleaseRecord, now_iso, release_intent
from modelship.policy import Policy, policy_for
from modelship.prefect_api import keeps_outcome
from modelship.settings import Settings, load_settings
from modelship.signals import deferred, exit_code_for, stop_on_signals, stop_signal
from tasks import bake as baking
from tasks.approve import (
    ApprovalChannels,
    ApprovalRequest,
    approval_request,
    approve,
    canary_cleanup,
    channels_for,
)
from tasks.evidence import read_candidate_digest
from tasks.record import ReleaseJournal
from tasks.recovery import dead_runs, unfinished
from tasks.recovery import loaded_models as loaded_models  # moved; the crash matrix imports it
from tasks.retry import TRANSIENT_RETRIES, retry_transient

Progress = Callable[[str], None]


class PromoteParams(BaseModel):
    """One promotion: which version, under which policy, asked by whom."""

    model: str = Field(description="Registered model name (= Triton model name).")
    version: int | None = Field(default=None, description="Model version to release.")
    alias: str | None = Field(default=None, description="Or a model alias, e.g. candidate.")
    policy_file: str | None = Field(default=None, description="Policy YAML; default "
                                    "policies/MODEL.yaml, else the documented defaults.")
    dry_run: bool = Field(default=False, description="Check and print the plan; change "
                          "nothing in production.")
    force: bool = Field(default=False, description="Swap even without canary evidence "
                        "(recorded).")
    require_approval: bool | None = Field(default=None, description="Override "
                                          "approval.required for this release.")
    approvers: list[str] | None = Field(default=None, description="Override "
                                        "approval.approvers (Slack user ids).")
    requested_by: str | None = Field(default=None, description="Who asks (Slack user id), "
                                     "for four-eyes; default from settings.")
    trigger: Literal["cli", "deployment", "schedule", "webhook"] = Field(
        default="deployment", description="What started the release (recorded).")
    allow_breaking_changes: bool = Field(default=False, description="Accept an I/O change "
                                         "against production.")


def _run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params") or {}
    if isinstance(params, BaseModel):
        params = params.model_dump()
    ref = f"v{params.get('version')}" if params.get("version") is not None else \
        f"@{params.get('alias')}"
    return f"promote {params.get('model')} {ref}"


# --------------------------------------------------------------------------------------
# the tasks: one side effect each, readable run names, retries only on transient errors


@task(name="resolve", task_run_name="resolve {model}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def resolve_task(clients: Clients, model: str, version: int | None,
                 alias: str | None) -> dict[str, Any]:
    """The concrete version, and what the fleet and the registry say serves now."""
    if clients.registry is None:
        raise UsageError("promote needs MLflow", hint="run `modelship stack up` or set "
                         "MLFLOW_TRACKING_URI")
    number = clients.registry.version_number(model, version=version, alias=alias)
    status = fleet.status(clients, model=model) if clients.replicas else {}
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
    return run_check(settings, clients, policy, model=model, version=version, workdir=workdir,
                     allow_breaking_changes=allow_breaking, progress=get_run_logger().info)


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
                candidate: int, baseline: int | None, keep_loaded: bool = False) -> Any:
    """The candidate next to production on the canary Triton, under load; with
    ``keep_loaded`` (approval required) it stays loaded for the approval wait's watcher."""
    from tasks.canary import run_canary

    return run_canary(settings, clients, policy, model=model, candidate=candidate,
                      baseline=baseline, progress=get_run_logger().info,
                      keep_loaded=keep_loaded)


@task(name="gates", task_run_name="gates {model} v{candidate}", cache_policy=NO_CACHE)
def gates_task(result: Any, model: str, candidate: int) -> str:
    """Pass, or stop the release: failed (exit 4) or inconclusive (exit 6)."""
    from prefect.artifacts import create_table_artifact

    from tasks.report import artifact_key

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
              from_version: int | None, footprint_bytes: int | None = None) -> dict[str, Any]:
    """Every replica to the candidate at once, batching paused (DESIGN §4); the GPU
    headroom preflight uses the canary's measured footprint when there is one."""
    return fleet.swap_unlocked(settings, clients, policy, model=model, target=version,
                               progress=get_run_logger().info,
                               footprint_bytes=footprint_bytes)


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


# --------------------------------------------------------------------------------------
# the flow


@flow(name="modelship-promote", flow_run_name=_run_name, log_prints=True)
@keeps_outcome  # the CLI reports the release's own outcome if Prefect fails to record it
def promote_flow(params: PromoteParams) -> dict[str, Any]:
    """Release one model version to every replica: the whole pipeline, recorded."""
    settings = load_settings()
    clients = build_clients(settings)
    try:
        policy = policy_for(params.model, settings.policies_dir,
                            Path(params.policy_file) if params.policy_file else None)
        with stop_on_signals():  # SIGTERM (a cancel, a pod stop) and SIGINT: stop cleanly
            return run_promote(settings, clients, policy, params,
                               progress=get_run_logger().info)
    finally:
        clients.close()


def run_promote(settings: Settings, clients: Clients, policy: Policy, params: PromoteParams,
                *, progress: Progress) -> dict[str, Any]:
    """The stages in order, inside a flow run. Returns the release record (a dict)."""
    from modelship.locks import release_lock
    from tasks.payload import load_payload

    if clients.storage is None or not clients.replicas:
        raise UsageError("promote needs the S3 repository and a Triton fleet",
                         hint="run `modelship stack up`, or set MODELSHIP_S3_ENDPOINT and "
                         "MODELSHIP_TRITON_REPLICAS")
    ledger = Ledger(clients.storage)
    requester = params.requested_by or settings.requester
    record = ReleaseRecord.start("promote", params.model, trigger=params.trigger,
                                 requester=requester, dry_run=params.dry_run,
                                 forced=params.force)
    record.holder["flow_run_id"] = _flow_run_id()
    notifier = notifier_for(clients, settings, policy) if not params.dry_run else None
    journal = ReleaseJournal(record, None if params.dry_run else ledger,
                             notifier or notifier_for(None, settings, policy), progress)
    model = params.model
    approval = approval_request(policy.approval, require=params.require_approval,
                                approvers=params.approvers, requester=requester)
    try:
        journal.open()
        if not params.dry_run:
            _recover_first(settings, clients, policy, ledger, journal)
        with journal.stage("resolve") as entry:
            resolved = resolve_task(clients, model, params.version, params.alias)
            record.to_version, record.from_version = resolved["version"], resolved["serving"]
            entry.details.update(resolved)
        version, serving = int(resolved["version"]), resolved["serving"]
        if serving == version:
            if not params.dry_run:
                _repair_noop(settings, clients, policy, journal, version)
            journal.finish("noop", 0, f"{model} v{version} already serves on every replica")
            return record.to_dict()
        with tempfile.TemporaryDirectory(prefix="modelship-promote-") as tmp:
            with journal.stage("check") as entry:
                report = check_task(settings, clients, policy, model, version, Path(tmp),
                                    params.allow_breaking_changes)
                entry.details["stages"] = report.stages
            with journal.stage("stage") as entry:
                staged = stage_task(settings, clients, policy, report, model, version,
                                    params.dry_run)
                entry.details.update({k: staged.get(k) for k in
                                      ("bytes_uploaded", "already_staged", "manifest_key")})
        if params.dry_run:
            plan = release_plan(settings, clients, policy, record, approval, staged)
            journal.record.gates = {"plan": plan}
            journal.finish("planned", 0, "dry run: nothing in production was changed")
            return {**record.to_dict(), "plan": plan}
        record.candidate = read_candidate_digest(
            clients.storage, repository_prefix=settings.repository_prefix, model=model,
            version=version)
        with release_lock(model, storage=clients.storage, home=settings.home,
                          release_id=record.id, kind="promote") as lock, \
                _unload_kept_canary(clients, journal, keep=approval.required):
            _note_takeover(journal, lock)
            _recover_first(settings, clients, policy, ledger, journal, lock)
            with journal.stage("canary") as entry:
                result: Any = canary_task(settings, clients, policy, model, version,
                                          serving, approval.required)
                record.gates = _gates_record(ledger, record, result)
                record.candidate["canary_report_id"] = record.id
                entry.details["verdict"] = result.verdict
                entry.details["_lines"] = _gate_lines(record.gates)
            journal.upload(Path(result.report_paths.get("png", "")),
                           f"canary {model} v{version} vs "
                           f"{'nothing' if serving is None else f'v{serving}'}")
            journal.save()
            with journal.stage("gates"):
                gates_task(result, model, version)
            with journal.stage("approve") as entry:
                channels = channels_for(
                    settings, clients, model=model, version=version, baseline=serving,
                    candidate=record.candidate, notifier=journal.thread.notifier,
                    plot=Path(result.report_paths.get("png") or "") if
                    result.report_paths.get("png") else None, timeout_s=approval.timeout_s,
                    max_error_rate=policy.bake.max_error_rate, policy=policy)
                entry.details.update(approve_task(approval, journal, channels, model,
                                                  version))
            payload, _ = load_payload(clients.storage, clients.registry,
                                      repository_prefix=settings.repository_prefix,
                                      model=model, version=version)
            baseline = None
            if serving is not None and policy.bake.duration_s > 0:
                with journal.stage("baseline") as entry:
                    baseline = baseline_task(settings, clients, policy, model, serving, payload)
                    entry.details.update(baseline.to_dict())
            lock.check()
            # the intent, before the first change of the fleet; from here every way out
            # ends released or undone (flows.fleet.end_release)
            record.intent = release_intent(from_version=serving, to_version=version,
                                           aliases=fleet.aliases_now(clients, model),
                                           release_id=record.id)
            journal.save()
            try:
                with journal.stage("swap") as entry:
                    record.swap = swap_task(settings, clients, policy, model, version,
                                            serving, result.candidate_bytes)
                    entry.details["skew_ms"] = record.swap.get("skew_ms")
                with journal.stage("bake") as entry:
                    _bake(settings, clients, policy, record, payload, baseline,
                          entry.details)
                    # baked: the point of no return, decided before the stage's save (an
                    # S3 outage there then finishes forward, and the tag tells the next run)
                    record.intent["committed_at"] = now_iso()
                with journal.stage("record") as entry:
                    entry.details.update(record_task(settings, clients, policy, record,
                                                     model, version))
            except BaseException as exc:
                if record.status != "running":
                    raise
                fleet.end_release(settings, clients, policy, record, exc,
                                  write=_end(journal), progress=progress)
                raise  # end_release raises; this line is for the type checker
            fleet.end_release(settings, clients, policy, record, None, write=_end(journal),
                              progress=progress)
        _publish_record(record)
        return record.to_dict()
    except ModelshipError as exc:
        if record.status == "running":  # else end_release ended it (released or undone)
            status = ("rolled_back" if isinstance(exc, BakeBreached) or record.bake.get(
                "rolled_back") else "failed" if exc.exit_code == 1 else "rejected")
            journal.finish(status, exc.exit_code, exc.message,
                           links=[f"next: {exc.hint}"] if exc.hint else [])
        exc.details["record"] = record.to_dict()
        _publish_record(record)
        raise
    except BaseException as exc:  # a stop request (or a bug) before the fleet changed
        signum = stop_signal(exc)
        if record.status == "running":
            with deferred(f"release {record.id} records its stop", say=progress):
                if signum is not None:
                    journal.finish("cancelled", exit_code_for(signum),
                                   f"stopped by {signal.Signals(signum).name} during "
                                   f"{_last_stage(record)}; nothing in production was "
                                   "changed")
                else:
                    journal.finish("failed", 1, f"{type(exc).__name__}: {exc}")
        if signum is None:
            raise
        raise ReleaseCancelled(f"promote of {model} {record.reason}", signum=signum,
                               hint=f"`modelship history {model}` shows the record",
                               model=model, record=record.to_dict()) from exc


def _bake(settings: Settings, clients: Clients, policy: Policy, record: ReleaseRecord,
          payload: Any, baseline: baking.Reference | None, details: dict[str, Any]) -> None:
    """Watch; on a breach or a lost replica, roll the fleet back to what served.

    A bake whose latency rules held in every window (the load left what the reference
    covers; errors were judged throughout) lets the release complete: the record's bake
    says ``held`` and a note says latency was never judged, and why.
    """
    version, previous = int(record.to_version or 0), record.from_version
    report = bake_task(settings, clients, policy, record.model, version, payload, baseline)
    record.bake = report.to_dict()
    details.update(outcome=report.verdict.outcome, reason=report.verdict.reason)
    if report.verdict.outcome == "held":
        record.notes.append(f"bake: latency not judged, released on errors alone: "
                            f"{report.verdict.reason}")
    if report.verdict.outcome in ("passed", "held"):
        return
    rollback = fleet.undo_swap(settings, clients, policy, model=record.model,
                               previous=previous)
    record.bake["rolled_back"] = rollback
    where = f"v{previous}" if previous is not None else "nothing"
    if report.verdict.outcome == "breach":
        raise BakeBreached(
            f"the bake of {record.model} v{version} breached: {report.verdict.reason}; the "
            f"fleet was rolled back to {where}",
            hint=f"production serves {where} again; read the bake windows in `modelship "
            f"history {record.model}`", model=record.model)
    raise InfrastructureError(
        f"the bake of {record.model} v{version} could not watch the fleet: "
        f"{report.verdict.reason}; rolled back to {where} on the replicas that answer",
        hint=f"restart the replica that stopped, then `modelship reconcile {record.model}` "
        f"and `modelship status {record.model}`", model=record.model)


@contextmanager
def _unload_kept_canary(clients: Clients, journal: ReleaseJournal, *,
                        keep: bool) -> Iterator[None]:
    """When the canary keeps the candidate loaded for the approval wait, make sure it is
    unloaded on every path: the approve stage unloads it on its own paths; this covers a
    failure between the canary and the wait (failed gates, an unwritable record)."""
    try:
        yield
    finally:
        if keep:
            done = canary_cleanup(clients, journal.record.model)
            if done not in ("nothing loaded on the canary", "no canary server"):
                journal.note(f"canary kept for the approval wait: {done}")


def _gates_record(ledger: Ledger, record: ReleaseRecord, result: Any) -> dict[str, Any]:
    """The gate verdicts and the report files, uploaded next to the record."""
    keys = {}
    for kind, path in (result.report_paths or {}).items():
        if path and Path(path).exists():
            keys[kind] = ledger.attach(record, Path(path).name, Path(path))
    gates = result.gate_report.to_dict()
    return {"verdict": result.verdict, "baseline": result.baseline,
            "candidate": result.candidate, "required_samples": gates.get("required_samples"),
            "results": gates.get("results", []), "report_keys": keys,
            "load": result.load, "skipped_rules": result.skipped_rules,
            "gpu": result.gpu.to_dict() if result.gpu is not None else None}


def _gate_lines(gates: dict[str, Any]) -> list[str]:
    from modelship.slack.blocks import gate_lines

    return gate_lines(gates)


# --------------------------------------------------------------------------------------
# crash safety: before anything else, finish or undo what dead or incomplete runs left
# (decided in tasks/recovery.py; the same for swap, rollback and reconcile)


@task(name="recover", task_run_name="recover {model}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def recover_task(settings: Settings, clients: Clients, policy: Policy, model: str,
                 by: str) -> dict[str, Any]:
    """Finish or undo what dead or incomplete runs left (fleet, pin, aliases, tags, their
    records), and unload their canary and trial models."""
    return fleet.recover_model(settings, clients, policy, model=model, by=by,
                               progress=get_run_logger().info)


def _note_takeover(journal: ReleaseJournal, lock: Any) -> None:
    if lock.took_over is not None:
        journal.note(f"took over the release lock of {lock.took_over.describe()}: its "
                     "process on this host is gone")


def _needs_recovery(ledger: Ledger, model: str, current: str) -> bool:
    return bool(dead_runs(ledger, model, current)) or any(
        r.status == "incomplete" for r in unfinished(ledger.records(model), current))


def _recover_first(settings: Settings, clients: Clients, policy: Policy, ledger: Ledger,
                   journal: ReleaseJournal, lock: Any = None) -> None:
    """Under the model's lock (``lock`` when the caller holds it already): finish or undo
    dead and incomplete runs. A live run of the same model in another terminal is not
    dead, so it is never touched."""
    from modelship.locks import release_lock

    record = journal.record
    if not _needs_recovery(ledger, record.model, record.id):
        return
    held = nullcontext(lock) if lock is not None else release_lock(
        record.model, storage=clients.storage, home=settings.home,
        release_id=record.id, kind="promote")
    with held as taken:
        if lock is None:
            _note_takeover(journal, taken)
        with journal.stage("recover") as entry:
            entry.details.update(recover_task(settings, clients, policy, record.model,
                                              record.id))


def _repair_noop(settings: Settings, clients: Clients, policy: Policy,
                 journal: ReleaseJournal, version: int) -> None:
    """The version already serves: make the pin, its tag and the aliases say so too."""
    from modelship.locks import release_lock

    record = journal.record
    with release_lock(record.model, storage=clients.storage,
                      home=settings.home, release_id=record.id, kind="promote"), \
            journal.stage("repair") as entry:
        repaired = fleet.repair_noop(settings, clients, policy, model=record.model,
                                     version=version, release_id=record.id,
                                     progress=journal.progress)
        entry.details["repaired"] = repaired
        if not repaired:
            entry.outcome, entry.reason = "skipped", "the pin, the tag and the aliases agree"


def _last_stage(record: ReleaseRecord) -> str:
    return next((s.name for s in reversed(record.stages)), "start")


def _end(journal: ReleaseJournal) -> Callable[[ReleaseRecord], None]:
    """The journal's last write, for :func:`flows.fleet.end_release`."""
    def write(record: ReleaseRecord) -> None:
        journal.finish(record.status, int(record.exit_code or 0), record.reason)
    return write


def release_plan(settings: Settings, clients: Clients, policy: Policy,
                 record: ReleaseRecord, approval: ApprovalRequest,
                 staged: dict[str, Any]) -> dict[str, Any]:
    """What a promotion would do, for ``--dry-run``: stages, gates, sizes and targets."""
    from tasks.gates import plan_samples

    samples = plan_samples(policy.gates, min_samples=policy.canary.min_samples)
    canary = policy.canary
    return {
        "stages": ["resolve", "check", "stage", "canary", "gates", "approve", "baseline",
                   "swap", "bake", "record"],
        "model": record.model, "from_version": record.from_version,
        "to_version": record.to_version,
        "gates": [{"rule": g.name, "metric": g.metric,
                   "test": str(g.test) if g.test else None, "min": g.min, "max": g.max,
                   "max_increase_pct": g.max_increase_pct, "max_rate": g.max_rate,
                   "dry_run": g.dry_run} for g in policy.gates],
        "canary": {"samples_per_version": samples, "warmup_s": canary.warmup_s,
                   "max_duration_s": canary.max_duration_s,
                   "expected_s": f"{canary.warmup_s:g} s warm-up, then until {samples} "
                   f"answered requests per version, at most {canary.max_duration_s:g} s"},
        "replicas": [s.name for s in clients.replicas],
        "canary_server": clients.canary.name if clients.canary else None,
        "bake": baking.plan(policy.bake),
        "rollback_target": record.from_version,
        "approval": approval.to_dict(),
        "staging": staged.get("plan", []),
    }


def _flow_run_id() -> str | None:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return str(context.flow_run.id) if context and context.flow_run else None


def _publish_record(record: ReleaseRecord) -> None:
    """The release record as a Prefect artifact of the flow run."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    from tasks.report import artifact_key

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
