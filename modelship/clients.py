"""Build the narrow client of every external system once, at the edge, from settings."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from model_registry.client import RegistryClient
from modelship.errors import ModelshipError
from modelship.policy import Policy
from modelship.prefect_api import PrefectApi
from modelship.settings import Settings
from modelship.slack.client import SlackClient
from modelship.slack.notifier import Notifier, NullNotifier, SlackNotifier
from modelship.storage import S3Storage
from modelship.triton.client import TritonServer
from modelship.triton.discovery import build_discovery


@dataclass
class Clients:
    """One client per external system; None where the settings name no endpoint."""

    registry: RegistryClient | None
    storage: S3Storage | None
    prefect: PrefectApi | None
    slack: Any | None
    replicas: list[TritonServer] = field(default_factory=list)
    canary: TritonServer | None = None

    def warm(self) -> None:
        """Do every client's local work (imports, building it) now, with no I/O, so that a
        deadline started afterwards times the servers alone: on a loaded machine importing
        MLflow alone took longer than ``modelship status``'s whole deadline."""
        if self.registry is not None:
            self.registry.warm()
        if self.storage is not None:
            self.storage.warm()
        for server in [*self.replicas, *([self.canary] if self.canary else [])]:
            server.warm()

    def close(self) -> None:
        for server in [*self.replicas, *([self.canary] if self.canary else [])]:
            server.close()


def build_clients(settings: Settings) -> Clients:
    """Construct the clients the settings describe. The only I/O is Kubernetes fleet
    discovery, when configured: the replica list is read once, here at the edge."""
    secret = settings.aws_secret_access_key
    storage = (
        S3Storage(
            endpoint=settings.s3_endpoint,
            bucket=settings.bucket,
            access_key=settings.aws_access_key_id,
            secret_key=secret.get_secret_value() if secret else None,
            region=settings.aws_region,
            timeout_s=settings.http_timeout_s,
        )
        if settings.s3_endpoint
        else None
    )
    slack = None
    if settings.slack_api_url and settings.slack_token:
        slack = SlackClient(settings.slack_api_url, settings.slack_token.get_secret_value(),
                            timeout_s=settings.http_timeout_s)

    def triton(endpoint: Any) -> TritonServer:
        return TritonServer(endpoint, timeout_s=settings.http_timeout_s,
                            control_timeout_s=settings.control_timeout_s)

    return Clients(
        registry=RegistryClient(settings.mlflow_tracking_uri, timeout_s=settings.http_timeout_s)
        if settings.mlflow_tracking_uri else None,
        storage=storage,
        prefect=PrefectApi(settings.prefect_api_url, timeout_s=settings.http_timeout_s)
        if settings.prefect_api_url else None,
        slack=slack,
        replicas=[triton(e) for e in _fleet(settings)],
        canary=triton(settings.triton_canary) if settings.triton_canary else None,
    )


def _fleet(settings: Settings) -> list[Any]:
    """The production replicas: static, or (when MODELSHIP_K8S_NAMESPACE is set) the ready
    endpoints of the Triton Service, listed once here at the edge."""
    kubernetes = settings.kubernetes_discovery()
    static = [] if kubernetes else list(settings.triton_replicas)
    if not kubernetes and not static:
        return []
    return build_discovery(static=static, kubernetes=kubernetes).replicas()


@dataclass(frozen=True)
class EndpointCheck:
    """One row of `modelship doctor`."""

    component: str
    endpoint: str
    ok: bool
    reason: str
    exit_code: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"component": self.component, "endpoint": self.endpoint, "ok": self.ok,
                "reason": self.reason}


NOT_CONFIGURED = {
    "mlflow": "set MLFLOW_TRACKING_URI or run `modelship stack up`",
    "s3": "set MODELSHIP_S3_ENDPOINT and AWS_* or run `modelship stack up`",
    "prefect": "set PREFECT_API_URL or run `modelship stack up`",
    "slack": "Slack is off (null notifier); set MODELSHIP_SLACK_API_URL and "
             "MODELSHIP_SLACK_TOKEN to turn it on",
    "triton": "set MODELSHIP_TRITON_REPLICAS or run `modelship stack up`",
}


def check_endpoints(clients: Clients, settings: Settings) -> list[EndpointCheck]:
    """Ping every configured system in parallel; each row says OK or why not."""
    probes: list[tuple[str, str, Callable[[], None] | None]] = [
        ("mlflow", settings.mlflow_tracking_uri or "-",
         clients.registry.ping if clients.registry else None),
        ("s3", f"{settings.s3_endpoint or '-'} bucket={settings.bucket}",
         clients.storage.ping if clients.storage else None),
        ("prefect", settings.prefect_api_url or "-",
         clients.prefect.ping if clients.prefect else None),
        ("slack", settings.slack_api_url or "-", clients.slack.ping if clients.slack else None),
    ]
    for server in clients.replicas:
        probes.append((f"triton {server.name}", server.endpoint.http, server.ping))
    if clients.canary:
        probes.append((f"triton {clients.canary.name}", clients.canary.endpoint.http,
                       clients.canary.ping))
    if not clients.replicas:
        probes.append(("triton", "-", None))

    def run(probe: tuple[str, str, Callable[[], None] | None]) -> EndpointCheck:
        name, endpoint, ping = probe
        if ping is None:
            key = name.split()[0]
            return EndpointCheck(name, endpoint, ok=key == "slack",
                                 reason=f"not configured: {NOT_CONFIGURED[key]}",
                                 exit_code=0 if key == "slack" else 2)
        try:
            ping()
        except ModelshipError as exc:
            return EndpointCheck(name, endpoint, ok=False, reason=str(exc),
                                 exit_code=exc.exit_code)
        except Exception as exc:  # noqa: BLE001 - doctor reports every failure as a row
            return EndpointCheck(name, endpoint, ok=False, reason=f"{type(exc).__name__}: {exc}",
                                 exit_code=1)
        return EndpointCheck(name, endpoint, ok=True, reason="OK")

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(run, probes))


def notifier_for(clients: Clients | None, settings: Settings, policy: Policy) -> Notifier:
    """The release thread's notifier, chosen once: Slack when it is configured and the
    policy enables notifications, else the null notifier."""
    if clients is None or clients.slack is None or not policy.notifications.enabled:
        return NullNotifier()
    channel = policy.notifications.slack_channel or settings.slack_channel
    return SlackNotifier(clients.slack, channel)
