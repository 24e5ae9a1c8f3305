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
from typing import TYPE_CHECKING, Any, Literal

from prefect import get_run_logger
from prefect.context import FlowRunContext
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from modelship.candidate import ReleaseCandidate
from modelship.clients import Clients, build_clients, notifier_for
from modelship.errors import (
    BakeBreached,
    InfrastructureError,
    ModelshipError,
    ReleaseCancelled,
    UsageError,
)
from modelship.ledger import Ledger, ReleaseRecord, now_iso, release_intent
from modelship.locks import release_lock
from modelship.policy import Policy, policy_for
from modelship.prefect_api import keeps_outcome
from modelship.progress import Progress
from modelship.settings import Settings, load_settings
from modelship.signals import deferred, exit_code_for, stop_on_signals, stop_signal
from modelship.slack.blocks import gate_lines
from tasks import bake as baking
from tasks import fleet
from tasks.approve import (
    ApprovalRequest,
    approval_request,
    canary_cleanup,
    channels_for,
)
from tasks.canary_sizing import SEQUENTIAL_SHARE, plan_rules
from tasks.check import CheckReport
from tasks.evidence import release_candidate
from tasks.holdback import holdback_applies, holdback_watch
from tasks.prefect_tasks import (
    approve_task,
    bake_task,
    baseline_task,
    canary_task,
    check_task,
    gates_task,
    model_params_flow,
    needs_recovery,
    publish_record,
    record_task,
    recover_task,
    resolve_task,
    stage_task,
    swap_task,
)
from tasks.progressive import live_canary, replay_policy
from tasks.record import ReleaseJournal
from tasks.traffic_plan import ProgressivePlan, not_carried_out, step_loads

if TYPE_CHECKING:  # annotation only: the canary imports the load generator
    from tasks.canary import CanaryResult

#: The baseline window and the bake probe with the golden feed's first rows.
BAKE_ROWS = 64


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
    params = flow_run.parameters.get("params") or {}
    if isinstance(params, BaseModel):
        params = params.model_dump()
    ref = f"v{params.get('version')}" if params.get("version") is not None else \
        f"@{params.get('alias')}"
    return f"promote {params.get('model')} {ref}"


# --------------------------------------------------------------------------------------
# the tasks: one side effect each, readable run names, retries only on transient errors


# --------------------------------------------------------------------------------------
# the flow


@model_params_flow(name="modelship-promote", flow_run_name=_run_name, log_prints=True)
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
    if clients.storage is None or not clients.replicas:
        raise UsageError("promote needs the S3 repository and a Triton fleet",
                         hint="run `modelship stack up`, or set MODELSHIP_S3_ENDPOINT and "
                         "MODELSHIP_TRITON_REPLICAS")
    if (refusal := not_carried_out(policy)) is not None:  # a mode promote cannot run
        raise refusal
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
        staged, report = _check_and_stage(settings, clients, policy, params, journal, version)
        if params.dry_run:
            plan = release_plan(settings, clients, policy, record, approval, staged)
            journal.record.gates = {"plan": plan}
            journal.finish("planned", 0, "dry run: nothing in production was changed")
            return {**record.to_dict(), "plan": plan}
        release = release_candidate(report)  # what the stage verified: nothing read again
        record.candidate = dict(release.digest)
        _release(settings, clients, policy, ledger, journal, approval, serving, release,
                 progress=progress)
        publish_record(record)
        return record.to_dict()
    except ModelshipError as exc:
        _ended_by_error(journal, exc)
        raise
    except BaseException as exc:  # a stop request (or a bug) before the fleet changed
        cancelled = _stopped(journal, exc, progress)
        if cancelled is None:
            raise
        raise cancelled from exc


def _check_and_stage(settings: Settings, clients: Clients, policy: Policy,
                     params: PromoteParams, journal: ReleaseJournal,
                     version: int) -> tuple[dict[str, Any], CheckReport]:
    """The check and stage stages, in a work folder removed after them: what was staged
    (or, in a dry run, the staging plan), and the check's report."""
    with tempfile.TemporaryDirectory(prefix="modelship-promote-") as tmp:
        with journal.stage("check") as entry:
            report = check_task(settings, clients, policy, params.model, version, Path(tmp),
                                params.allow_breaking_changes)
            entry.details["stages"] = report.stages
        with journal.stage("stage") as entry:
            staged = stage_task(settings, clients, policy, report, params.model, version,
                                params.dry_run)
            entry.details.update({k: staged.get(k) for k in
                                  ("bytes_uploaded", "already_staged", "manifest_key")})
    return staged, report


def _release(settings: Settings, clients: Clients, policy: Policy, ledger: Ledger,
             journal: ReleaseJournal, approval: ApprovalRequest, serving: int | None,
             release: ReleaseCandidate, *, progress: Progress) -> None:
    """Under the model's release lock: canary, gates and approval, then the fleet
    (baseline, swap, bake, record), ended by :func:`tasks.fleet.end_release`."""
    record = journal.record
    model, version = record.model, int(record.to_version or 0)
    assert clients.storage is not None  # run_promote refused a promotion without it
    with release_lock(model, storage=clients.storage, home=settings.home,
                      release_id=record.id, kind="promote") as lock, \
            _unload_kept_canary(clients, journal, keep=approval.required):
        _note_takeover(journal, lock)
        _recover_first(settings, clients, policy, ledger, journal, lock)
        result = _canary_to_approval(settings, clients, policy, journal, approval, serving,
                                     release)
        payload = release.rows(BAKE_ROWS)
        baseline = None
        if serving is not None and policy.bake.duration_s > 0 \
                and not holdback_applies(policy, serving):  # a holdback is the control
            with journal.stage("baseline") as entry:
                baseline = baseline_task(settings, clients, policy, model, serving, payload)
                entry.details.update(baseline.to_dict())
        lock.check()
        # the intent, before the first change of the fleet; from here every way out
        # ends released or undone (tasks.fleet.end_release)
        record.intent = release_intent(from_version=serving, to_version=version,
                                       aliases=fleet.aliases_now(clients, model),
                                       release_id=record.id)
        journal.save()
        with fleet.ending(settings, clients, policy, journal, progress=progress):
            with journal.stage("swap") as entry:
                record.swap = swap_task(settings, clients, policy, model, version,
                                        serving, result.candidate_bytes if result else None,
                                        release.config_pbtxt)
                entry.details["skew_ms"] = record.swap.get("skew_ms")
            with journal.stage("bake") as entry:
                _bake(settings, clients, policy, record, payload, baseline,
                      entry.details, save=journal.save, progress=progress)
                # baked: the point of no return, decided before the stage's save (an
                # S3 outage there then finishes forward, and the tag tells the next run)
                record.intent["committed_at"] = now_iso()
            with journal.stage("record") as entry:
                entry.details.update(record_task(settings, clients, policy, record,
                                                 model, version))


def _canary_to_approval(settings: Settings, clients: Clients, policy: Policy,
                        journal: ReleaseJournal, approval: ApprovalRequest,
                        serving: int | None, release: ReleaseCandidate) -> CanaryResult | None:
    """The canary, gates and approve stages; returns the replay canary's result (None
    after a progressive canary: its steps are in the record's ``traffic``)."""
    record = journal.record
    model, version = record.model, int(record.to_version or 0)
    if policy.canary.traffic == "progressive" and serving is not None:
        live_canary(settings, clients, policy, journal, serving=serving, release=release,
                    progress=journal.progress)
        return _approve(settings, clients, policy, journal, approval, serving, release, None)
    if policy.canary.traffic == "progressive":
        journal.note("canary.traffic: progressive: no production version to share live "
                     "traffic with on a first release; the replay canary judges it")
        policy = replay_policy(policy)
    with journal.stage("canary") as entry:
        if policy.canary.traffic == "shadow":  # live requests mirrored (tasks.shadow)
            from tasks.shadow import shadow_task  # lazy: it imports the load generator

            result = shadow_task(settings, clients, policy, journal, model, version, serving,
                                 approval.required, release)
        else:
            result = canary_task(settings, clients, policy, model, version, serving,
                                 approval.required, release)
        journal.attach_gates(result)
        record.candidate["canary_report_id"] = record.id
        entry.details["verdict"] = result.verdict
        entry.details["_lines"] = _gate_lines(record.gates)
    journal.upload(Path(result.report_paths.get("png", "")),
                   f"canary {model} v{version} vs "
                   f"{'nothing' if serving is None else f'v{serving}'}")
    journal.save()
    with journal.stage("gates"):
        gates_task(result, model, version)
    return _approve(settings, clients, policy, journal, approval, serving, release, result)


def _approve(settings: Settings, clients: Clients, policy: Policy, journal: ReleaseJournal,
             approval: ApprovalRequest, serving: int | None, release: ReleaseCandidate,
             result: CanaryResult | None) -> CanaryResult | None:
    """The approve stage (the replay canary's plot with it, when there is one)."""
    record = journal.record
    model, version = record.model, int(record.to_version or 0)
    png = (result.report_paths.get("png") or "") if result is not None else ""
    with journal.stage("approve") as entry:
        channels = channels_for(
            settings, clients, release=release, baseline=serving,
            notifier=journal.thread.notifier,
            plot=Path(png) if png else None, timeout_s=approval.timeout_s,
            max_error_rate=policy.bake.max_error_rate, policy=policy)
        entry.details.update(approve_task(approval, journal, channels, model,
                                          version))
    return result


def _ended_by_error(journal: ReleaseJournal, exc: ModelshipError) -> None:
    """A release stopped by a modelship error: its record ends (unless end_release ended
    it, released or undone), the error carries it, and Prefect shows it."""
    record = journal.record
    if record.status == "running":  # else end_release ended it (released or undone)
        status = ("rolled_back" if isinstance(exc, BakeBreached) or record.bake.get(
            "rolled_back") else "failed" if exc.exit_code == 1 else "rejected")
        journal.finish(status, exc.exit_code, exc.message,
                       links=[f"next: {exc.hint}"] if exc.hint else [])
    exc.details["record"] = record.to_dict()
    publish_record(record)


def _stopped(journal: ReleaseJournal, exc: BaseException,
             progress: Progress) -> ReleaseCancelled | None:
    """A stop request (or a bug) before the fleet changed: the record ends cancelled (or
    failed). Returns the error to raise for a stop signal, None to re-raise ``exc``."""
    record, model = journal.record, journal.record.model
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
        return None
    return ReleaseCancelled(f"promote of {model} {record.reason}", signum=signum,
                            hint=f"`modelship history {model}` shows the record",
                            model=model, record=record.to_dict())


def _bake(settings: Settings, clients: Clients, policy: Policy, record: ReleaseRecord,
          payload: Any, baseline: baking.Reference | None, details: dict[str, Any], *,
          save: Callable[[], None], progress: Progress) -> None:
    """Watch; on a breach or a lost replica, roll the fleet back to what served. With
    ``bake.holdback_pct`` the previous version answers that share of live traffic on the
    canary Triton during the watch, as its control (:mod:`tasks.holdback`); the share is
    back to 0 before any rollback.

    A bake whose latency rules held in every window (the load left what the reference
    covers; errors were judged throughout) lets the release complete: the record's bake
    says ``held`` and a note says latency was never judged, and why.
    """
    version, previous = int(record.to_version or 0), record.from_version
    if previous is not None and holdback_applies(policy, previous):
        def write(doc: dict[str, Any]) -> None:
            record.traffic = doc
            save()

        report = holdback_watch(settings, clients, policy, model=record.model,
                                version=version, previous=previous, payload=payload,
                                write=write, traffic=record.traffic, progress=progress)
    else:
        report = bake_task(settings, clients, policy, record.model, version, payload,
                           baseline)
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


def _gate_lines(gates: dict[str, Any]) -> list[str]:
    return gate_lines(gates)


# --------------------------------------------------------------------------------------
# crash safety: before anything else, finish or undo what dead or incomplete runs left
# (decided in tasks/recovery.py; the same for swap, rollback and reconcile)


def _note_takeover(journal: ReleaseJournal, lock: Any) -> None:
    if lock.took_over is not None:
        journal.note(f"took over the release lock of {lock.took_over.describe()}: its "
                     "process on this host is gone")


def _recover_first(settings: Settings, clients: Clients, policy: Policy, ledger: Ledger,
                   journal: ReleaseJournal, lock: Any = None) -> None:
    """Under the model's lock (``lock`` when the caller holds it already): finish or undo
    dead and incomplete runs. A live run of the same model in another terminal is not
    dead, so it is never touched."""
    record = journal.record
    if not needs_recovery(ledger, record.model, record.id):
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
    record = journal.record
    with release_lock(record.model, storage=clients.storage,
                      home=settings.home, release_id=record.id, kind="promote"):
        fleet.repair_stage(settings, clients, policy, journal, version)


def _last_stage(record: ReleaseRecord) -> str:
    return next((s.name for s in reversed(record.stages)), "start")


def release_plan(settings: Settings, clients: Clients, policy: Policy,
                 record: ReleaseRecord, approval: ApprovalRequest,
                 staged: dict[str, Any]) -> dict[str, Any]:
    """What a promotion would do, for ``--dry-run``: stages, gates, sizes and targets."""
    # the canary's own planner: the watch's share of α grows the plan when it is on
    samples = plan_rules(policy.gates, baseline_latency_ms=None, baseline_error_rate=0.0,
                         floor=policy.canary.min_samples,
                         share=SEQUENTIAL_SHARE if policy.canary.sequential else 0.0)
    canary = policy.canary
    return {
        "stages": ["resolve", "check", "stage", "canary", "gates", "approve",
                   *([] if holdback_applies(policy, record.from_version) else ["baseline"]),
                   "swap", "bake", "record"],
        "model": record.model, "from_version": record.from_version,
        "to_version": record.to_version,
        "gates": [{"rule": g.name, "metric": g.metric, "test": g.test, **g.bounds(),
                   "dry_run": g.dry_run} for g in policy.gates],
        "canary": {"traffic": canary.traffic,
                   **({"steps": list(canary.progressive_steps),
                       "step_bounds_s": list(canary.step_bounds_s),
                       "step_loads": step_loads(ProgressivePlan.from_policy(
                           canary, replicas=len(clients.replicas)))}
                      if canary.traffic == "progressive" else {}),
                   "samples_per_version": samples, "warmup_s": canary.warmup_s,
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
    context = FlowRunContext.get()
    return str(context.flow_run.id) if context and context.flow_run else None
