"""The ``modelship`` command (DESIGN §6).

Every command that reports something takes ``--json`` and prints exactly one JSON document
on stdout; human output and progress go to stderr. The exit code is the outcome (0 done,
1 infrastructure, 2 usage, 3 validation, 4 gates, 5 approval, 6 inconclusive).
Heavy libraries are imported inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from modelship.output import progress, run_reporting, table

app = typer.Typer(
    help="Release pipeline that promotes MLflow-registered models to NVIDIA Triton.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
stack_app = typer.Typer(help="The embedded local stack of real servers.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def _settings() -> Any:
    from modelship.settings import load_settings

    return load_settings()


def _finish(code: int) -> None:
    raise typer.Exit(code)


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
    from modelship.stack import manager

    def action() -> Any:
        settings = _settings()
        state, report = manager.up(settings, replicas=replicas, base_port=base_port,
                                   progress=progress)
        return settings, state, report

    def render(result: Any) -> str:
        settings, state, report = result
        if report.already_running:
            return f"stack already running ({settings.stack_file})"
        rows = [(name, f"{secs:.1f}") for name, secs in sorted(report.ready_s.items(),
                                                                key=lambda kv: kv[1])]
        return (table(["component", "ready after (s)"], rows)
                + f"\nstack up in {report.total_s:.1f} s; endpoints in {settings.stack_file}"
                + "\nnext: `modelship stack status` or `modelship doctor`")

    def to_json(result: Any) -> Any:
        from modelship.stack.manager import _live_records
        from modelship.stack.state import status_document

        _, state, report = result
        doc = status_document(state, _live_records(state))
        doc["startup"] = {"ready_s": report.ready_s, "total_s": report.total_s,
                          "already_running": report.already_running}
        return doc

    _finish(run_reporting(action, as_json=as_json, render=render, to_json=to_json))


@stack_app.command("down")
def stack_down(as_json: JsonOpt = False) -> None:
    """Stop every process the stack started, and nothing else."""
    from modelship.stack import manager

    def render(result: dict[str, Any]) -> str:
        if not result["stopped"] and not result["already_stopped"]:
            return "nothing to stop: no stack is running here"
        return f"stopped: {', '.join(result['stopped']) or 'none'}; all ports closed"

    _finish(run_reporting(lambda: manager.down(_settings(), progress=progress),
                          as_json=as_json, render=render, to_json=lambda r: r))


@stack_app.command("status")
def stack_status(as_json: JsonOpt = False) -> None:
    """Print the stack's endpoints (DESIGN §6 schema) and whether each process runs."""
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

    _finish(run_reporting(lambda: manager.status(_settings()), as_json=as_json, render=render,
                          to_json=lambda d: d, exit_code=code))


@app.command("doctor")
def doctor(as_json: JsonOpt = False) -> None:
    """Ping every endpoint and print one table: each endpoint, OK or the reason."""
    from modelship.clients import check_endpoints

    def action() -> Any:
        return _with_clients(lambda settings, clients: check_endpoints(clients, settings))

    def render(checks: Any) -> str:
        return table(["component", "endpoint", "status"],
                     [(c.component, c.endpoint, c.reason) for c in checks])

    _finish(run_reporting(
        action, as_json=as_json, render=render,
        to_json=lambda checks: {"ok": all(c.ok for c in checks),
                                "checks": [c.to_dict() for c in checks]},
        exit_code=lambda checks: 0 if all(c.ok for c in checks) else 1,
    ))


ModelArg = Annotated[str, typer.Argument(help="Registered model name (= Triton model name).")]
VersionOpt = Annotated[int | None, typer.Option("--version", "-v", help="Model version.")]
AliasOpt = Annotated[str | None, typer.Option("--alias", help="Model alias, e.g. candidate.")]
PolicyOpt = Annotated[
    Path | None, typer.Option("--policy", help="Release policy YAML (default policies/MODEL.yaml).")
]
BreakingOpt = Annotated[
    bool, typer.Option("--allow-breaking-changes",
                       help="Accept an I/O change against the production version.")
]


def _run_artifact_gate(model: str, version: int | None, alias: str | None, policy_file:
                       Path | None, *, stage: bool, allow_breaking: bool, as_json: bool,
                       dry_run: bool = False) -> None:
    from flows.check import parse_ref, run_check
    from modelship.clients import build_clients
    from modelship.policy import policy_for

    def action() -> Any:
        ref_version, ref_alias = parse_ref(version, alias)
        settings = _settings()
        policy = policy_for(model, settings.policies_dir, policy_file)
        workdir = _workdir(settings, model)
        clients = build_clients(settings)
        try:
            return run_check(settings, clients, policy, model=model, version=ref_version,
                             alias=ref_alias, workdir=workdir, stage=stage,
                             allow_breaking_changes=allow_breaking, dry_run=dry_run,
                             progress=progress)
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

    _finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda r: r.to_dict()))


def _workdir(settings: Any, model: str) -> Path:
    """A fresh folder for this run's artifacts (exported graph, GX results, Data Docs)."""
    import time

    path = settings.home / "runs" / f"{model}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@app.command("check")
def check(model: ModelArg, version: VersionOpt = None, alias: AliasOpt = None,
          policy: PolicyOpt = None, allow_breaking_changes: BreakingOpt = False,
          as_json: JsonOpt = False) -> None:
    """Resolve, export, validate and trial-load a version. No side effects on production."""
    _run_artifact_gate(model, version, alias, policy, stage=False,
                       allow_breaking=allow_breaking_changes, as_json=as_json)


@app.command("stage")
def stage(model: ModelArg, version: VersionOpt = None, alias: AliasOpt = None,
          policy: PolicyOpt = None, allow_breaking_changes: BreakingOpt = False,
          dry_run: Annotated[bool, typer.Option(
              "--dry-run", help="Run the checks and print the staging plan; write nothing.")]
          = False, as_json: JsonOpt = False) -> None:
    """Check, then stage the version in the S3 model repository (idempotent)."""
    _run_artifact_gate(model, version, alias, policy, stage=True,
                       allow_breaking=allow_breaking_changes, as_json=as_json, dry_run=dry_run)


DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")]


def _with_clients(body: Any) -> Any:
    """Run ``body(settings, clients)`` with clients built once and closed after."""
    from modelship.clients import build_clients

    settings = _settings()
    clients = build_clients(settings)
    try:
        return body(settings, clients)
    finally:
        clients.close()


def _render_swap(doc: dict[str, Any]) -> str:
    lines = list(doc.get("plan") or [])
    if doc.get("dry_run"):
        return "\n".join(["dry run: nothing was changed", *lines])
    if doc["kind"] == "noop":
        return f"{doc['model']} v{doc['to_version']} already serves on every replica"
    rows = [(p["name"], f"{p['seconds']:.2f}",
             ", ".join(f"{r}:{'ok' if v['ok'] else 'FAILED'}" for r, v in p["replicas"].items()))
            for p in doc["phases"]]
    skew = "n/a" if doc["skew_ms"] is None else f"{doc['skew_ms']:.0f} ms"
    return (table(["phase", "seconds", "replicas"], rows)
            + f"\n{doc['model']}: v{doc['from_version']} -> v{doc['to_version']} on every "
            f"replica in {doc['total_s']:.1f} s (skew {skew})")


@app.command("swap")
def swap(model: ModelArg,
         to: Annotated[int, typer.Option("--to", help="The staged version to serve.")],
         policy: PolicyOpt = None, dry_run: DryRunOpt = False, as_json: JsonOpt = False) -> None:
    """Swap every Triton replica to a staged version, atomically (no mixed fleet)."""
    from flows import fleet
    from modelship.policy import policy_for

    def action() -> Any:
        return _with_clients(lambda settings, clients: fleet.swap(
            settings, clients, policy_for(model, settings.policies_dir, policy), model=model,
            target=to, dry_run=dry_run, progress=progress))

    _finish(run_reporting(action, as_json=as_json, render=_render_swap, to_json=lambda d: d))


@app.command("rollback")
def rollback(model: ModelArg,
             to: Annotated[int | None, typer.Option("--to", help="Version to go back to "
                                                    "(default: the previous one).")] = None,
             policy: PolicyOpt = None, dry_run: DryRunOpt = False,
             as_json: JsonOpt = False) -> None:
    """Move the production alias back first, then swap every replica back."""
    from flows import fleet
    from modelship.policy import policy_for

    def action() -> Any:
        return _with_clients(lambda settings, clients: fleet.rollback(
            settings, clients, policy_for(model, settings.policies_dir, policy), model=model,
            to=to, dry_run=dry_run, progress=progress))

    def render(doc: dict[str, Any]) -> str:
        return (_render_swap(doc["swap"]) + f"\nrolled back {model} "
                f"v{doc['from_version']} -> v{doc['to_version']}")

    _finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d))


@app.command("status")
def status(model: ModelArg, as_json: JsonOpt = False) -> None:
    """Per replica: the ready versions and the config digest; flags an inconsistent fleet."""
    from flows import fleet

    def render(doc: dict[str, Any]) -> str:
        rows = [(r.get("name"), r["url"], ",".join(map(str, r.get("ready_versions", []))) or "-",
                 (r.get("config_digest") or "-")[:12], r.get("error", ""))
                for r in doc["replicas"]]
        state = "consistent" if doc["consistent"] else "INCONSISTENT"
        return (table(["replica", "url", "ready", "config", "error"], rows)
                + f"\n{model}: production v{doc['production_version']} ({state}); "
                f"aliases {doc['aliases']}")

    _finish(run_reporting(
        lambda: _with_clients(lambda _s, clients: fleet.status(clients, model=model)),
        as_json=as_json, render=render, to_json=lambda d: d,
        exit_code=lambda d: 0 if d["consistent"] else 1))


@app.command("load")
def load(model: ModelArg, version: VersionOpt = None,
         concurrency: Annotated[int | None, typer.Option(help="Closed-loop clients.")] = None,
         rate: Annotated[float | None, typer.Option(help="Open-loop requests/s.")] = None,
         duration: Annotated[float | None, typer.Option(
             help="Run this many seconds (default: until 3 windows are stable).")] = None,
         protocol: Annotated[str, typer.Option(help="grpc or http.")] = "grpc",
         canary: Annotated[bool, typer.Option("--canary",
                                              help="Load the canary, not the fleet.")] = False,
         as_json: JsonOpt = False) -> None:
    """The canary load generator on its own: latency percentiles, throughput, errors."""
    from flows import fleet
    from modelship.loadgen import LoadSpec, run_load_sync

    def action() -> Any:
        def body(settings: Any, clients: Any) -> Any:
            if concurrency is not None and rate is not None:
                from modelship.errors import UsageError

                raise UsageError("pass --concurrency or --rate, not both",
                                 hint="e.g. `--concurrency 8` or `--rate 200`")
            servers = [clients.canary] if canary else clients.replicas
            if not servers or servers[0] is None:
                from modelship.errors import UsageError

                raise UsageError("no Triton servers are configured",
                                 hint="run `modelship stack up`")
            served = version
            if served is None:
                served = fleet.status(clients, model=model)["production_version"]
            if served is None:
                from modelship.errors import UsageError

                raise UsageError(f"{model} is not served consistently; cannot pick payloads",
                                 hint="pass --version V (a staged version)")
            from tasks.payload import load_payload

            payload, source = load_payload(clients.storage, clients.registry,
                                           repository_prefix=settings.repository_prefix,
                                           model=model, version=served)
            progress(f"loading {model} (payload: {source} rows of v{served})")
            spec = LoadSpec(protocol=protocol,  # type: ignore[arg-type]
                            concurrency=concurrency if rate is None else None,
                            rate_rps=rate,
                            duration_s=duration, timeout_s=settings.http_timeout_s)
            if spec.concurrency is None and spec.rate_rps is None:
                spec = LoadSpec(protocol=spec.protocol, concurrency=4, duration_s=duration,
                                timeout_s=settings.http_timeout_s)
            urls = [s.endpoint.grpc if protocol == "grpc" else s.endpoint.http for s in servers]
            report = run_load_sync(urls, model, payload, spec,
                                   version=str(version) if version is not None else "")
            return report.to_dict()

        return _with_clients(body)

    def render(doc: dict[str, Any]) -> str:
        lat = doc["latency_ms"]
        return table(["requests", "errors", "req/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms"],
                     [(doc["requests"], doc["errors"], f"{doc['throughput_rps']:.0f}",
                       *(f"{lat[k]:.2f}" if lat[k] is not None else "-"
                         for k in ("p50", "p90", "p95", "p99")))])

    def code(doc: dict[str, Any]) -> int:
        # Nothing answered: the run measured nothing (wrong model, version or server).
        return 1 if doc["requests"] == 0 or doc["errors"] == doc["requests"] else 0

    _finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d,
                          exit_code=code))


VERDICT_EXIT = {"passed": 0, "noop": 0, "failed": 4, "inconclusive": 6, "error": 1}


@app.command("canary")
def canary(model: ModelArg,
           version: Annotated[int, typer.Option("--version", "-v", help="Candidate version.")],
           policy: PolicyOpt = None, as_json: JsonOpt = False) -> None:
    """Canary the candidate against production on the canary Triton; apply the gates."""
    from flows import fleet
    from modelship.policy import policy_for

    def action() -> Any:
        return _with_clients(lambda settings, clients: fleet.canary(
            settings, clients, policy_for(model, settings.policies_dir, policy), model=model,
            version=version, progress=progress))

    def render(doc: dict[str, Any]) -> str:
        if doc["verdict"] == "noop":
            return doc["message"]
        paths = doc.get("report") or {}
        markdown = ""
        if paths.get("markdown"):
            markdown = Path(paths["markdown"]).read_text()
        return (markdown + f"\nverdict: {doc['verdict']}; report: {paths.get('markdown')}, "
                f"plot: {paths.get('png')}")

    _finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d,
                          exit_code=lambda d: VERDICT_EXIT.get(d["verdict"], 1)))


@app.command("demo")
def demo(as_json: JsonOpt = False) -> None:
    """The whole story on the embedded stack: release v1, then a better v2."""
    from modelship.demo import DEMO_MODEL, run_demo
    from modelship.policy import policy_for

    def action() -> Any:
        return _with_clients(lambda settings, clients: run_demo(
            settings, clients, policy_for(DEMO_MODEL, settings.policies_dir),
            progress=progress))

    def render(doc: dict[str, Any]) -> str:
        rows = [(s["step"], s.get("verdict") or s.get("kind") or "",
                 f"{s['seconds']:.1f}" if "seconds" in s else "") for s in doc["steps"]]
        return (table(["step", "result", "seconds"], rows)
                + f"\n{doc['model']}: {doc['outcome']} ({doc['seconds']:.0f} s in all)"
                + "\nexplore: `modelship status demo-fraud`, `modelship rollback demo-fraud`; "
                "stop everything with `modelship stack down`")

    _finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d))


def main() -> None:
    """Console-script entry point."""
    # No network but loopback here, and progress bars would garble stderr progress lines.
    for key, value in {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "GX_ANALYTICS_ENABLED": "false",
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}.items():
        os.environ.setdefault(key, value)
    app()


if __name__ == "__main__":
    main()
