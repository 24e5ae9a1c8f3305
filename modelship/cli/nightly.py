"""``modelship nightly``, ``deploy`` and ``worker``: the scheduled side of modelship.

- ``nightly`` runs the retrain-and-deploy flow once, now (the deployment runs it on cron).
- ``deploy`` registers ``prefect.yaml``'s deployments on the Prefect server (the stack's by
  default), creating the process work pool first; ``make deploy`` calls it.
- ``worker`` runs a Prefect process worker on that pool, so deployment runs (the nightly
  schedule, a webhook-started promote, a Quick Run) execute from this checkout.
- ``webhooks serve | register``: the MLflow registry webhook receiver (alias ``candidate``
  set on a version -> a ``promote`` deployment run), and its registration in MLflow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from modelship.cli._common import JsonOpt, PolicyOpt, app, finish, run_reporting, settings, table
from modelship.errors import InfrastructureError, ModelshipError, UsageError
from modelship.prefect_api import service_env

#: The work pool of the embedded stack (prefect.yaml `definitions.work_pools.process`).
PROCESS_POOL = "modelship-process"


def repo_dir() -> Path:
    """The checkout holding ``prefect.yaml`` (the deployments' working directory)."""
    here = Path(__file__).resolve().parents[2]
    for candidate in (here, Path.cwd()):
        if (candidate / "prefect.yaml").is_file():
            return candidate
    raise UsageError("prefect.yaml was not found next to the modelship package or here",
                     hint="run the command from the modelship checkout")


def prefect_env(api_url: str | None, home: Path) -> dict[str, str]:
    """The environment of ``prefect`` commands and of the worker's flow runs (pure)."""
    if not api_url:
        raise UsageError("no Prefect server is configured",
                         hint="run `modelship stack up`, or set PREFECT_API_URL")
    return {**os.environ, "PREFECT_API_URL": api_url,
            "MODELSHIP_HOME": str(home.resolve()), "MODELSHIP_REPO_DIR": str(repo_dir()),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true",
            "MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false"}


def _prefect(*args: str, env: dict[str, str], timeout_s: float) -> str:
    prefect = str(Path(sys.executable).parent / "prefect")
    try:
        done = subprocess.run([prefect, *args], env=env, cwd=repo_dir(), capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise InfrastructureError(f"`prefect {' '.join(args)}` took over {timeout_s:g} s",
                                  hint="check the Prefect server (`modelship doctor`)") from exc
    if done.returncode != 0:
        raise InfrastructureError(
            f"`prefect {' '.join(args)}` failed (exit {done.returncode}): "
            f"{(done.stdout + done.stderr).strip()[-1500:]}",
            hint="check the Prefect server (`modelship doctor`) and prefect.yaml")
    return done.stdout


@app.command("nightly")
def nightly(
    model: Annotated[str, typer.Option(help="Registered model name.")] = "demo-fraud",
    drift: Annotated[float, typer.Option(
        help="How far tonight's data drifted (built-in trainer: 0 none, 1 a quarter turn).")]
    = 0.0,
    seed: Annotated[int | None, typer.Option(help="Data seed (default: the day number).")]
    = None,
    train: Annotated[str | None, typer.Option(
        help="Training entry point module:function (default: the built-in trainer).")]
    = None,
    min_improvement: Annotated[float | None, typer.Option(
        help="Promote only if the held-out metric improves by at least this much (default: "
        "the policy's nightly.min_absolute_change, 0.01).")] = None,
    metric: Annotated[str | None, typer.Option(
        help="accuracy or f1_macro (default: the policy's nightly.metric).")] = None,
    policy: PolicyOpt = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Train, register and compare; never promote.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run the retrain-and-deploy flow once: promoted, or skipped with the numbers."""

    def action() -> Any:
        # lazy: a command imports its flow and tasks when it runs, so the CLI starts fast
        from flows.nightly import NightlyParams, nightly_flow
        from modelship.prefect_api import pointed_at, require_api

        current = settings()
        try:
            fields: dict[str, Any] = {
                "model": model, "drift": drift, "seed": seed, "metric": metric,
                "min_absolute_change": min_improvement, "dry_run": dry_run,
                "policy_file": str(policy) if policy else None}
            fields = {k: v for k, v in fields.items() if v is not None}
            if train:
                fields["train"] = train
            params = NightlyParams.model_validate(fields)
        except ValueError as exc:
            raise UsageError(f"invalid nightly options: {exc}",
                             hint="see `modelship nightly --help`") from exc
        with pointed_at(require_api(current.prefect_api_url)):
            return nightly_flow(params)

    def render(doc: dict[str, Any]) -> str:
        comparison = doc["comparison"]
        metric_name = comparison["metric"]
        champion = comparison.get("champion") or {}
        rows = [("challenger", f"v{doc['version']}",
                 f"{comparison['challenger'].get(metric_name, float('nan')):.4f}")]
        if comparison.get("champion_version") is not None:
            rows.append(("champion", f"v{comparison['champion_version']}",
                         f"{champion.get(metric_name, float('nan')):.4f}"))
        lines = [table(["role", "version", f"held-out {metric_name}"], rows),
                 f"nightly {doc['model']}: {doc['status']} (exit {doc['exit_code']})",
                 doc.get("reason") or ""]
        if doc.get("release"):
            lines.append(f"release {doc['release'].get('id')}: "
                         f"{doc['release'].get('status')}; `modelship history {doc['model']}`")
        if doc.get("notice"):
            lines.append("skipped notice posted to Slack" if doc["notice"].get("posted")
                         else "no Slack notice (Slack is off or failed)")
        return "\n".join(line for line in lines if line)

    finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d,
                         exit_code=lambda d: int(d.get("exit_code") or 0)))


@app.command("deploy")
def deploy(
    pool: Annotated[str, typer.Option(help="Work pool the deployments target; the process "
                                      "pool is created when missing.")] = PROCESS_POOL,
    as_json: JsonOpt = False,
) -> None:
    """Register prefect.yaml's deployments on the Prefect server (the stack's by default)."""

    def action() -> Any:
        import yaml  # lazy: the CLI starts without PyYAML (~20 ms); only deploy reads YAML

        current = settings()
        env = prefect_env(current.prefect_api_url, current.home)
        _require_server(env["PREFECT_API_URL"], current.http_timeout_s)
        # Prefect's own retries with backoff (not the CLI's one): its SQLite answers 503
        # while another write holds it, and a deploy beside running flows failed so; a server
        # that does not answer at all was refused just above, at once
        env = service_env(env)
        names = [d["name"] for d in
                 yaml.safe_load((repo_dir() / "prefect.yaml").read_text())["deployments"]]
        if pool == PROCESS_POOL:
            _prefect("work-pool", "create", pool, "--type", "process", "--overwrite",
                     env=env, timeout_s=120)
            _prefect("--no-prompt", "deploy", "--all", env=env, timeout_s=600)
        else:  # another pool (e.g. modelship-kubernetes): it must exist already
            for name in names:
                _prefect("--no-prompt", "deploy", "--name", name, "--pool", pool, env=env,
                         timeout_s=300)
        return {"prefect_api_url": current.prefect_api_url, "pool": pool,
                "deployments": _deployments(current.prefect_api_url, current.http_timeout_s)}

    def render(doc: dict[str, Any]) -> str:
        rows = [(d["name"], d["flow"], d["pool"], ", ".join(d["schedules"]) or "-")
                for d in doc["deployments"]]
        return (table(["deployment", "flow", "pool", "schedules"], rows)
                + f"\nregistered on {doc['prefect_api_url']}; run them with `modelship worker`")

    finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d))


def _require_server(api_url: str, timeout_s: float) -> None:
    """Refuse at once when the Prefect server does not answer its health check.

    Raises:
        InfrastructureError: it does not answer (exit 1).
    """
    # lazy: urllib.request pulls ssl, email and http.client (~30 ms) the CLI starts without
    import urllib.error
    import urllib.request

    url = f"{api_url.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise InfrastructureError(
            f"the Prefect server at {api_url} does not answer ({exc}); nothing was deployed",
            hint="run `modelship stack up` (or start your Prefect server), then `modelship "
            "doctor`, and deploy again", component="prefect") from exc


def _deployments(api_url: str | None, timeout_s: float) -> list[dict[str, Any]]:
    """Every deployment on the server: name, flow, pool, schedules (cron + timezone)."""
    # lazy: urllib.request pulls ssl, email and http.client (~30 ms) the CLI starts without
    import urllib.request

    def post(path: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(f"{api_url}{path}", data=b"{}", method="POST",
                                          headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            return list(json.loads(response.read()))

    flows = {f["id"]: f["name"] for f in post("/flows/filter")}
    result = []
    for d in post("/deployments/filter"):
        schedules = [f"{s['schedule'].get('cron')} {s['schedule'].get('timezone') or 'UTC'}"
                     for s in d.get("schedules") or [] if s.get("schedule", {}).get("cron")]
        limit = (d.get("global_concurrency_limit") or {}).get("limit") \
            or d.get("concurrency_limit")
        result.append({"name": d["name"], "flow": flows.get(d["flow_id"], d["flow_id"]),
                       "pool": d.get("work_pool_name"), "schedules": schedules,
                       "concurrency_limit": limit,
                       "collision_strategy": (d.get("concurrency_options") or {}).get(
                           "collision_strategy"), "id": d["id"]})
    return sorted(result, key=lambda d: str(d["name"]))


@app.command("worker")
def worker(
    pool: Annotated[str, typer.Option(help="Work pool to poll.")] = PROCESS_POOL,
    limit: Annotated[int | None, typer.Option(
        help="At most this many flow runs at once.")] = None,
) -> None:
    """Run a Prefect process worker on the stack's server (replaces this process)."""
    try:
        current = settings()
        # a service rides out a busy or restarting server: Prefect's own retries
        env = service_env(prefect_env(current.prefect_api_url, current.home))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(exc.exit_code) from exc
    prefect = str(Path(sys.executable).parent / "prefect")
    argv = [prefect, "worker", "start", "--pool", pool, "--type", "process",
            *(["--limit", str(limit)] if limit else [])]
    print(f"worker polling {pool} on {current.prefect_api_url} from {repo_dir()}",
          file=sys.stderr, flush=True)
    os.chdir(repo_dir())
    os.execve(prefect, argv, env)


webhooks_app = typer.Typer(help="The MLflow registry webhook receiver (alias candidate -> "
                           "promote).", no_args_is_help=True)
app.add_typer(webhooks_app, name="webhooks")


@webhooks_app.command("serve")
def webhooks_serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8090,
    state_file: Annotated[Path | None, typer.Option(
        help="Where seen delivery ids are kept (replay protection across restarts).")] = None,
    register: Annotated[bool, typer.Option(
        "--register", help="Create or update the MLflow webhook that calls this receiver.")]
    = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Started promotions only plan.")] = False,
) -> None:
    """Serve POST /mlflow/webhook: verify HMAC and timestamp, refuse replays, start promote."""
    # lazy: the webhook server pulls pydantic's settings (~0.3 s) the CLI starts without
    from modelship.webhooks.server import serve

    try:
        serve(host=host, port=port, state_file=state_file, register=register, dry_run=dry_run)
    except ModelshipError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(exc.exit_code) from exc


@webhooks_app.command("register")
def webhooks_register(
    url: Annotated[str | None, typer.Option(
        help="The receiver's URL (default: the stack's webhooks_url).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create (or update) the MLflow webhook for alias events, signed with the shared secret."""

    def action() -> Any:
        # lazy: the webhook server pulls pydantic's settings (~0.3 s) the CLI starts without
        from modelship.webhooks.server import ensure_mlflow_webhook

        current = settings()
        target = url or current.webhooks_url
        if not current.mlflow_tracking_uri or not target or not current.mlflow_webhook_secret:
            raise UsageError("registering the webhook needs MLflow, the receiver URL and "
                             "MODELSHIP_MLFLOW_WEBHOOK_SECRET",
                             hint="run `modelship stack up`, or set them and pass --url")
        hook = ensure_mlflow_webhook(current.mlflow_tracking_uri, target,
                                     current.mlflow_webhook_secret.get_secret_value())
        return {"webhook_id": hook, "url": target, "events": ["model_version_alias.created"]}

    finish(run_reporting(action, as_json=as_json, to_json=lambda d: d,
                         render=lambda d: f"MLflow webhook {d['webhook_id']} -> {d['url']}"))
