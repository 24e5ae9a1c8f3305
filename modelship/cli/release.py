"""``modelship promote`` and ``history``: the release as one Prefect flow run, and the
ledger it leaves."""

from __future__ import annotations

import getpass
from typing import Annotated, Any

import typer

from modelship.cli._common import (
    AliasOpt,
    BreakingOpt,
    ForceOpt,
    JsonOpt,
    ModelArg,
    PolicyOpt,
    VersionOpt,
    app,
    finish,
    run_reporting,
    settings,
    table,
    with_clients,
)


def _stage_rows(record: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(s["name"], s["outcome"], (s.get("reason") or "")[:100])
            for s in record.get("stages", [])]


def render_record(record: dict[str, Any]) -> str:
    """A release record for people: the stages, the outcome, where to look next."""
    lines = [table(["stage", "outcome", "reason"], _stage_rows(record))]
    head = (f"{record['kind']} {record['model']} {_v(record.get('from_version'))} -> "
            f"{_v(record.get('to_version'))}: {record['status']} (exit {record.get('exit_code')})")
    lines.append(head)
    if record.get("reason"):
        lines.append(record["reason"])
    if record.get("plan"):
        plan = record["plan"]
        lines.append("plan (dry run, nothing changed):")
        lines.append(f"  stages: {' -> '.join(plan['stages'])}")
        for gate in plan["gates"]:
            limit = ", ".join(f"{k}={gate[k]}" for k in ("min", "max", "max_increase_pct",
                                                         "max_rate") if gate.get(k) is not None)
            lines.append(f"  gate {gate['rule']}: {gate['metric']} {limit}"
                         + (" (dry run)" if gate.get("dry_run") else ""))
        lines.append(f"  canary: {plan['canary']['expected_s']}")
        loads = plan["canary"].get("step_loads") or {}
        for step in loads.get("steps", []):
            ratio = step["load_ratio"]
            lines.append(f"  step {step['weight_pct']:g} %: canary server at "
                         + ("? (replicas unknown)" if ratio is None else f"{ratio:.2f}×")
                         + " a replica's load; latency "
                         + ("judged" if step["latency_judged"]
                            else "NOT judged (above equal load; errors still are)"))
        if loads.get("warning"):
            lines.append(f"  WARNING: {loads['warning']}")
        lines.append(f"  replicas touched: {', '.join(plan['replicas'])}")
        bake = plan.get("bake") or {}
        if bake.get("effective_tolerance"):
            lines.append(f"  bake: {bake['duration_s']:g} s; {bake['effective_tolerance']}")
        lines.append(f"  rollback target: v{plan['rollback_target']}")
        approval = plan["approval"]
        lines.append(f"  approval: {'required by ' + ', '.join(approval['approvers']) if approval['required'] else 'not required'}")  # noqa: E501
    for note in record.get("notes", []):
        lines.append(f"note: {note}")
    lines.append(f"record: releases/{record['model']}/{record['id']}.json; "
                 f"`modelship history {record['model']}`")
    return "\n".join(lines)


@app.command("promote")
def promote(model: ModelArg, version: VersionOpt = None, alias: AliasOpt = None,
            policy: PolicyOpt = None,
            dry_run: Annotated[bool, typer.Option(
                "--dry-run", help="Check, then print the plan; change nothing.")] = False,
            force: ForceOpt = False,
            require_approval: Annotated[bool | None, typer.Option(
                "--require-approval/--no-require-approval",
                help="Override approval.required for this release.")] = None,
            approvers: Annotated[str | None, typer.Option(
                help="Comma-separated Slack user ids allowed to approve (overrides the "
                "policy).")] = None,
            requested_by: Annotated[str | None, typer.Option(
                help="Slack user id of the requester (four-eyes); default from settings.")]
            = None,
            allow_breaking_changes: BreakingOpt = False, as_json: JsonOpt = False) -> None:
    """The whole pipeline as one Prefect flow run; prints the release record."""

    def action() -> Any:
        # lazy: a command imports its flow and tasks when it runs, so the CLI starts fast
        from flows.promote import PromoteParams, promote_flow
        from modelship.prefect_api import require_api, run_flow
        from tasks.check import parse_ref

        parse_ref(version, alias)
        current = settings()
        params = PromoteParams(
            model=model, version=version, alias=alias,
            policy_file=str(policy) if policy else None, dry_run=dry_run, force=force,
            require_approval=require_approval,
            approvers=[a.strip() for a in approvers.split(",") if a.strip()]
            if approvers else None,
            requested_by=requested_by or current.requester or getpass.getuser(),
            trigger="cli", allow_breaking_changes=allow_breaking_changes)
        return run_flow(lambda: promote_flow(params),
                        api_url=require_api(current.prefect_api_url))

    finish(run_reporting(action, as_json=as_json, render=render_record, to_json=lambda d: d,
                         exit_code=lambda d: int(d.get("exit_code") or 0)))


@app.command("history")
def history(model: ModelArg, as_json: JsonOpt = False) -> None:
    """The release records of a model (the ledger), newest first, rollbacks included."""
    from tasks import fleet  # lazy: a command imports its tasks when it runs

    def render(records: list[dict[str, Any]]) -> str:
        if not records:
            return f"no release of {model} is on record"
        rows = [(r["id"], r["kind"], f"{_v(r.get('from_version'))} -> {_v(r.get('to_version'))}",
                 r["status"], r.get("exit_code"), r.get("requester") or "",
                 (r.get("gates") or {}).get("verdict") or "",
                 (r.get("reason") or "")[:60]) for r in records]
        return table(["release", "kind", "versions", "status", "exit", "requester", "canary",
                      "reason"], rows)

    finish(run_reporting(
        lambda: with_clients(lambda _s, clients: fleet.history(clients, model=model)),
        as_json=as_json, render=render, to_json=lambda d: {"model": model, "releases": d}))


def _v(version: Any) -> str:
    return "nothing" if version is None else f"v{version}"
