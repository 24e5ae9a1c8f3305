"""Command lines and environments of the embedded stack's servers (pure functions).

Every server binds to 127.0.0.1 only, on ports chosen by the caller, with telemetry off.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from modelship.stack.process import LOOPBACK

# Ports SeaweedFS `weed mini` needs: HTTP and gRPC for each of its servers, plus admin.
SEAWEED_PORT_NAMES = (
    "s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc",
    "filer", "filer_grpc", "admin", "admin_grpc",
)

QUIET_TELEMETRY = {
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "GX_ANALYTICS_ENABLED": "false",
}


def seaweed_command(
    weed: Path, *, data_dir: Path, bucket: str, ports: Mapping[str, int]
) -> list[str]:
    """``weed mini``: a real S3 server that enforces credentials (given in the env)."""
    return [
        str(weed), "mini",
        f"-dir={data_dir}",
        f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
        "-master.telemetry=false",
        f"-bucket={bucket}",
        f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
        f"-master.port={ports['master']}", f"-master.port.grpc={ports['master_grpc']}",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
        f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
        f"-admin.port={ports['admin']}", f"-admin.port.grpc={ports['admin_grpc']}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-webdav=false", "-admin.ui=false",
    ]


def seaweed_security_toml(*, write_key: str, read_key: str, filer_write_key: str,
                          filer_read_key: str) -> str:
    """SeaweedFS ``security.toml`` that closes the filer's and volumes' unauthenticated paths.

    Without it, the filer HTTP port reads, writes and deletes bucket objects with no keys
    (RECIPES, "Closing the filer's back door"). With JWT signing keys the filer answers 401
    without a token, and a volume write needs a token the master only hands out for new
    file ids. The S3 gateway, which enforces the access keys, keeps working.
    """
    sections = {
        "jwt.signing": write_key,
        "jwt.signing.read": read_key,
        "jwt.filer_signing": filer_write_key,
        "jwt.filer_signing.read": filer_read_key,
    }
    return "".join(f'[{name}]\nkey = "{key}"\nexpires_after_seconds = 10\n\n'
                   for name, key in sections.items())


def seaweed_env(base: Mapping[str, str], *, access_key: str, secret_key: str) -> dict[str, str]:
    """SeaweedFS enforces exactly these credentials on its S3 API."""
    return {**base, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}


def mlflow_command(venv_bin: Path, *, db_path: Path, port: int, bucket: str) -> list[str]:
    """MLflow with a SQLite backend and artifacts proxied to the S3 bucket: ``mlflow server``
    with its web server in the same process (:mod:`modelship.stack.mlflow_server`)."""
    return [
        str(venv_bin / "python"), "-m", "modelship.stack.mlflow_server", "server",
        "--backend-store-uri", f"sqlite:///{db_path}",
        "--artifacts-destination", f"s3://{bucket}/mlflow",
        "--serve-artifacts",
        "--host", LOOPBACK, "--port", str(port),
        "--workers", "1",
    ]


def mlflow_env(
    base: Mapping[str, str], *, s3_endpoint: str, access_key: str, secret_key: str, region: str,
    webhook_key: str | None = None,
) -> dict[str, str]:
    """The server (not the clients) holds the S3 credentials.

    ``webhook_key`` (a Fernet key kept in the state) encrypts registry webhook secrets at
    rest, so they survive a restart; deliveries may go to the loopback receiver over http.
    """
    webhooks = {
        "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": webhook_key,
        "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
        "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
        "MLFLOW_WEBHOOK_CACHE_TTL": "2",
    } if webhook_key else {}
    return {
        **base,
        **QUIET_TELEMETRY,
        "MLFLOW_S3_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": region,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        **webhooks,
    }


def prefect_command(venv_bin: Path, *, port: int) -> list[str]:
    return [
        str(venv_bin / "prefect"), "server", "start",
        "--host", LOOPBACK, "--port", str(port), "--analytics-off",
    ]


#: Prefect's file-backed lease storage (shipped with Prefect): concurrency leases outlive a
#: server restart. The default keeps them in memory, so a restart loses every lease while
#: the slot counts stay in the database, and those slots are never freed (issue 18).
PREFECT_LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"


def prefect_ui_url(api_url: str) -> str:
    """The Prefect UI's root for an API URL (the UI is served next to ``/api``)."""
    return api_url.rstrip("/").removesuffix("/api")


def prefect_env(base: Mapping[str, str], *, prefect_home: Path, db_path: Path,
                port: int | None = None) -> dict[str, str]:
    """The server's environment, with its UI on (flow runs, task runs, artifacts).

    The UI's pages ask ``PREFECT_UI_API_URL`` for their data; Prefect's default is port 4200,
    so it is set to the server's own port. The UI costs no extra process: measured, the
    server's RSS is the same (233 MB) with and without it.
    """
    env = {
        key: value for key, value in base.items() if not key.startswith(("PREFECT_API_",
                                                                          "PREFECT_UI_"))
    }
    ui = {"PREFECT_UI_ENABLED": "true",
          "PREFECT_UI_API_URL": f"http://{LOOPBACK}:{port}/api"} if port else {
              "PREFECT_UI_ENABLED": "false"}
    return {
        **env,
        **QUIET_TELEMETRY,
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{db_path}",
        "PREFECT_SERVER_API_HOST": LOOPBACK,
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": PREFECT_LEASE_STORAGE,
        **ui,
    }


def slack_emulator_command(*, port: int, state_file: Path,
                           approvals_url: str | None = None) -> list[str]:
    """The emulator's command line; its token goes in the environment (:func:`slack_env`).
    Its web view sends button clicks to ``approvals_url``."""
    return [
        sys.executable, "-m", "modelship.slack.emulator",
        "--host", LOOPBACK, "--port", str(port),
        "--state-file", str(state_file),
        *(["--approvals-url", approvals_url] if approvals_url else []),
    ]


def slack_env(base: Mapping[str, str], *, token: str,
              signing_secret: str | None = None) -> dict[str, str]:
    """The token is passed in the environment: never in argv (``ps``) or the log. The
    signing secret lets the emulator's web view sign clicks as Slack does."""
    env = {**base, "MODELSHIP_SLACK_EMULATOR_TOKEN": token}
    if signing_secret:
        env["MODELSHIP_SLACK_EMULATOR_SIGNING_SECRET"] = signing_secret
    return env


def approvals_command(venv_bin: Path, *, port: int, audit_log: Path) -> list[str]:
    """``modelship approvals serve``: the Slack interactivity endpoint of the stack."""
    return [
        str(venv_bin / "modelship"), "approvals", "serve",
        "--host", LOOPBACK, "--port", str(port), "--audit-log", str(audit_log),
    ]


def approvals_env(base: Mapping[str, str], *, home: Path) -> dict[str, str]:
    """It reads everything (S3, Prefect, Slack, the signing secret) from the stack file."""
    env = {k: v for k, v in base.items()
           if not k.startswith(("MODELSHIP_", "PREFECT_API_", "AWS_", "MLFLOW_"))}
    return {**env, **QUIET_TELEMETRY, "MODELSHIP_HOME": str(home)}


def webhooks_command(*, port: int, state_file: Path) -> list[str]:
    """The MLflow webhook receiver; it registers its own MLflow webhook once MLflow is up."""
    return [
        sys.executable, "-m", "modelship.webhooks.server",
        "--host", LOOPBACK, "--port", str(port), "--state-file", str(state_file), "--register",
    ]


#: The receiver registers its webhook in a loop of its own (one try a second while MLflow
#: boots); MLflow's client would otherwise retry one refused call with backoff for minutes,
#: past the stack's readiness deadline, on a busy machine.
WEBHOOKS_MLFLOW_CLIENT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                          "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def webhooks_env(base: Mapping[str, str], *, home: Path) -> dict[str, str]:
    """It reads Prefect, MLflow and the webhook secret from the stack file."""
    env = {k: v for k, v in base.items()
           if not k.startswith(("MODELSHIP_", "PREFECT_API_", "AWS_", "MLFLOW_"))}
    return {**env, **QUIET_TELEMETRY, **WEBHOOKS_MLFLOW_CLIENT, "MODELSHIP_HOME": str(home)}


def endpoint_urls(http_port: int, grpc_port: int, metrics_port: int) -> dict[str, str]:
    """The three endpoints of one Triton server, as the state file records them."""
    return {
        "http": f"http://{LOOPBACK}:{http_port}",
        "grpc": f"{LOOPBACK}:{grpc_port}",
        "metrics": f"http://{LOOPBACK}:{metrics_port}/metrics",
    }
