"""``modelship stack ...`` and ``doctor``: the embedded stack and its endpoints."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from modelship.cli._common import (
    JsonOpt,
    app,
    finish,
    progress,
    run_reporting,
    settings,
    stack_app,
    table,
    with_clients,
)
from modelship.stack.state import status_document


@stack_app.command("up")
def stack_up(
    replicas: Annotated[int, typer.Option(help="Number of production Triton replicas.")] = 2,
    base_port: Annotated[
        int | None,
        typer.Option(help="Use consecutive ports from this one instead of free random ports."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Start SeaweedFS, MLflow, Prefect, the Slack emulator and N+1 Tritons (idempotent)."""
    # lazy: a command imports its tasks when it runs, so the CLI starts fast
    from modelship.stack import manager
    from tasks.reconcile import reconcile_stack

    def action() -> Any:
        current = settings()
        state, report = manager.up(
            current, replicas=replicas, base_port=base_port, progress=progress,
            on_ready=lambda state: reconcile_stack(state, progress=progress))
        return current, state, report

    def render(result: Any) -> str:
        settings, state, report = result
        healed = _healed(report)
        if report.already_running:
            return f"stack already running ({settings.stack_file})" + healed
        rows = [(name, f"{secs:.1f}") for name, secs in sorted(report.ready_s.items(),
                                                                key=lambda kv: kv[1])]
        return (table(["component", "ready after (s)"], rows)
                + f"\nstack up in {report.total_s:.1f} s; endpoints in {settings.stack_file}"
                + healed + "\nnext: `modelship stack status` or `modelship doctor`")

    def to_json(result: Any) -> Any:
        # lazy: the stack manager pulls pydantic's settings (~0.5 s); only when a command runs
        from modelship.stack.manager import _live_records

        _, state, report = result
        doc = status_document(state, _live_records(state))
        doc["startup"] = {"ready_s": report.ready_s, "total_s": report.total_s,
                          "already_running": report.already_running,
                          "restarted": report.restarted, "reconciled": report.reconciled,
                          "prefect_db": report.prefect_db}
        return doc

    finish(run_reporting(action, as_json=as_json, render=render, to_json=to_json))


def _healed(report: Any) -> str:
    """One line on what ``up`` restarted and brought back to production, if anything."""
    lines = []
    if report.restarted:
        lines.append(f"restarted: {', '.join(report.restarted)}")
    reconciled = report.reconciled or {}
    if reconciled.get("changed"):
        lines.append(f"reconciled {reconciled['changed']} replica(s) to the recorded production")
    for model in reconciled.get("models", []):
        if not model.get("ok"):
            lines.append(f"{model['model']}: not reconciled: {model.get('error')}")
    return "".join(f"\n{line}" for line in lines)


@stack_app.command("down")
def stack_down(as_json: JsonOpt = False) -> None:
    """Stop every process the stack started, and nothing else."""
    # lazy: the stack manager pulls pydantic's settings (~0.5 s); only when a command runs
    from modelship.stack import manager

    def render(result: dict[str, Any]) -> str:
        if not result["stopped"] and not result["already_stopped"]:
            return "nothing to stop: no stack is running here"
        return f"stopped: {', '.join(result['stopped']) or 'none'}; all ports closed"

    finish(run_reporting(lambda: manager.down(settings(), progress=progress),
                          as_json=as_json, render=render, to_json=lambda r: r))


@stack_app.command("status")
def stack_status(as_json: JsonOpt = False) -> None:
    """Print the stack's endpoints (DESIGN §6 schema) and whether each process runs."""
    # lazy: the stack manager pulls pydantic's settings (~0.5 s); only when a command runs
    from modelship.stack import manager

    def render(doc: dict[str, Any]) -> str:
        rows = [(c["name"], c["pid"], "up" if c["alive"] else "DOWN", c["log"])
                for c in doc["components"]]
        lines = [table(["component", "pid", "state", "log"], rows),
                 f"mlflow  {doc['mlflow_uri']}", f"s3      {doc['s3_endpoint']} "
                 f"bucket={doc['bucket']}", f"prefect {doc['prefect_api_url']}",
                 f"slack   {doc['slack_api_url']}"]
        for i, r in enumerate(doc["triton"]["replicas"]):
            lines.append(f"triton-{i} {r['http']} grpc={r['grpc']}")
        if doc["triton"]["canary"]:
            lines.append(f"canary   {doc['triton']['canary']['http']}")
        return "\n".join(lines)

    def code(doc: dict[str, Any]) -> int:
        return 0 if doc["running"] else 1

    finish(run_reporting(lambda: manager.status(settings()), as_json=as_json, render=render,
                          to_json=lambda d: d, exit_code=code))


@app.command("doctor")
def doctor(as_json: JsonOpt = False) -> None:
    """Ping every endpoint and print one table: each endpoint, OK or the reason."""
    # lazy: the clients pull pydantic, numpy and the Triton client (~0.8 s); only doctor
    from modelship.clients import check_endpoints

    def action() -> Any:
        return with_clients(lambda settings, clients: check_endpoints(clients, settings))

    def render(checks: Any) -> str:
        return table(["component", "endpoint", "status"],
                     [(c.component, c.endpoint, c.reason) for c in checks])

    finish(run_reporting(
        action, as_json=as_json, render=render,
        to_json=lambda checks: {"ok": all(c.ok for c in checks),
                                "checks": [c.to_dict() for c in checks]},
        exit_code=lambda checks: 0 if all(c.ok for c in checks) else 1,
    ))


