"""``modelship check`` and ``stage``: the artifact gate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from modelship.cli._common import (
    AliasOpt,
    BreakingOpt,
    JsonOpt,
    ModelArg,
    PolicyOpt,
    VersionOpt,
    app,
    finish,
    progress,
    run_reporting,
    settings,
    table,
    workdir,
)

NoCacheOpt = Annotated[bool, typer.Option(
    "--no-cache", help="Check afresh: reuse no earlier passed check of the same bytes "
    "(MODELSHIP_CHECK_CACHE=0 does the same for every command).")]


def _run_artifact_gate(model: str, version: int | None, alias: str | None, policy_file:
                       Path | None, *, stage: bool, allow_breaking: bool, as_json: bool,
                       dry_run: bool = False, no_cache: bool = False) -> None:
    # lazy: a command imports its flow and tasks when it runs, so the CLI starts fast
    from flows.check import parse_ref, run_check
    from modelship.clients import build_clients
    from modelship.policy import policy_for

    def action() -> Any:
        ref_version, ref_alias = parse_ref(version, alias)
        current = settings()
        policy = policy_for(model, current.policies_dir, policy_file)
        folder = workdir(current, model)
        clients = build_clients(current)
        try:
            return run_check(current, clients, policy, model=model, version=ref_version,
                             alias=ref_alias, workdir=folder, stage=stage,
                             allow_breaking_changes=allow_breaking, dry_run=dry_run,
                             cache=False if no_cache else None, progress=progress)
        finally:
            clients.close()

    def render(report: Any) -> str:
        rows = [(s["stage"], "ok" if s["ok"] else "FAILED", f"{s.get('seconds', 0):.1f}")
                for s in report.stages]
        lines = [table(["stage", "result", "seconds"], rows)]
        if report.golden and report.golden.source == "synthetic":
            lines.append("note: golden inputs were synthetic (generated from the signature)")
        verb = "staged" if stage else "passed every check"
        if report.staged and report.staged.get("dry_run"):
            verb = "passed every check; dry run, nothing staged. The plan:"
            lines.append(f"{model} v{report.version} {verb}")
            lines.extend(f"  {line}" for line in report.staged["plan"])
            return "\n".join(lines)
        lines.append(f"{model} v{report.version} {verb}")
        if report.staged:
            lines.append(f"manifest: s3://.../{report.staged['manifest_key']} "
                         f"({report.staged['bytes_uploaded']} bytes uploaded)")
        elif not stage:
            lines.append(f"next: `modelship stage {model} --version {report.version}`")
        return "\n".join(lines)

    finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda r: r.to_dict()))


@app.command("check")
def check(model: ModelArg, version: VersionOpt = None, alias: AliasOpt = None,
          policy: PolicyOpt = None, allow_breaking_changes: BreakingOpt = False,
          no_cache: NoCacheOpt = False, as_json: JsonOpt = False) -> None:
    """Resolve, export, validate and trial-load a version. No side effects on production."""
    _run_artifact_gate(model, version, alias, policy, stage=False,
                       allow_breaking=allow_breaking_changes, as_json=as_json,
                       no_cache=no_cache)


@app.command("stage")
def stage(model: ModelArg, version: VersionOpt = None, alias: AliasOpt = None,
          policy: PolicyOpt = None, allow_breaking_changes: BreakingOpt = False,
          dry_run: Annotated[bool, typer.Option(
              "--dry-run", help="Run the checks and print the staging plan; write nothing.")]
          = False, no_cache: NoCacheOpt = False, as_json: JsonOpt = False) -> None:
    """Check, then stage the version in the S3 model repository (idempotent)."""
    _run_artifact_gate(model, version, alias, policy, stage=True,
                       allow_breaking=allow_breaking_changes, as_json=as_json, dry_run=dry_run,
                       no_cache=no_cache)


