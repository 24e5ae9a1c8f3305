"""Typed settings for every command and flow.

Sources, highest priority first:

1. explicit keyword arguments (tests, flows);
2. environment variables: ``MODELSHIP_*`` plus the standard ``MLFLOW_TRACKING_URI``,
   ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_DEFAULT_REGION``,
   ``MLFLOW_S3_ENDPOINT_URL`` and ``PREFECT_API_URL``;
3. ``$MODELSHIP_HOME/stack.json``, the file ``modelship stack up`` writes, so that a user of
   the embedded stack sets nothing at all;
4. the documented defaults.

Nothing is read at import time: call :func:`load_settings` at the edge.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, Field, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from modelship.errors import UsageError

STACK_FILE_NAME = "stack.json"


class TritonEndpoint(BaseModel):
    """One Triton server, addressed by its three loopback or cluster endpoints."""

    http: str = Field(description="HTTP base URL, e.g. http://127.0.0.1:8000.")
    grpc: str = Field(
        description="gRPC address host:port, e.g. 127.0.0.1:8001. Control calls use it."
    )
    metrics: str = Field(description="Prometheus metrics URL, e.g. http://127.0.0.1:8002/metrics.")
    name: str | None = Field(default=None, description="A label for messages (replica-0, canary).")


def _env(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class Settings(BaseSettings):
    """Where modelship finds its servers, and how long it waits for them."""

    model_config = SettingsConfigDict(
        env_prefix="MODELSHIP_",
        extra="ignore",
        populate_by_name=True,
    )

    home: Path = Field(
        default=Path(".modelship"),
        description="State folder of the embedded stack (stack.json, logs, data). "
        "Default: ./.modelship.",
    )
    policies_dir: Path = Field(
        default=Path("policies"),
        description="Folder holding one release policy YAML per model (MODEL.yaml).",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        validation_alias=_env("MODELSHIP_MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI",
                              "mlflow_tracking_uri"),
        description="MLflow tracking server URL (MLFLOW_TRACKING_URI).",
    )
    s3_endpoint: str | None = Field(
        default=None,
        validation_alias=_env("MODELSHIP_S3_ENDPOINT", "MLFLOW_S3_ENDPOINT_URL", "s3_endpoint"),
        description="S3/MinIO endpoint URL, e.g. http://127.0.0.1:8333.",
    )
    bucket: str = Field(
        default="modelship",
        description="Bucket holding the Triton model repository and MLflow artifacts.",
    )
    repository_prefix: str = Field(
        default="triton",
        description="Key prefix of the Triton model repository inside the bucket.",
    )
    aws_access_key_id: str | None = Field(
        default=None,
        validation_alias=_env("MODELSHIP_AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID",
                              "aws_access_key_id"),
        description="S3 access key (AWS_ACCESS_KEY_ID).",
    )
    aws_secret_access_key: SecretStr | None = Field(
        default=None,
        validation_alias=_env("MODELSHIP_AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY",
                              "aws_secret_access_key"),
        description="S3 secret key (AWS_SECRET_ACCESS_KEY).",
    )
    aws_region: str = Field(
        default="us-east-1",
        validation_alias=_env("MODELSHIP_AWS_REGION", "AWS_DEFAULT_REGION", "aws_region"),
        description="S3 region (AWS_DEFAULT_REGION). SeaweedFS and MinIO accept any.",
    )
    prefect_api_url: str | None = Field(
        default=None,
        validation_alias=_env("MODELSHIP_PREFECT_API_URL", "PREFECT_API_URL", "prefect_api_url"),
        description="Prefect API URL, e.g. http://127.0.0.1:4200/api (PREFECT_API_URL).",
    )
    slack_api_url: str | None = Field(
        default=None,
        description="Slack Web API base URL ending in /api/. None disables Slack (null notifier).",
    )
    slack_token: SecretStr | None = Field(
        default=None, description="Slack bot token (xoxb-...)."
    )
    slack_signing_secret: SecretStr | None = Field(
        default=None, description="Slack signing secret, for verifying button clicks."
    )
    manifest_signing_key: SecretStr | None = Field(
        default=None,
        description="HMAC-SHA256 key (at least 32 characters) that signs and verifies every "
        "staged release.json. It must not live in the bucket; the embedded stack generates "
        "one (MODELSHIP_MANIFEST_SIGNING_KEY).",
    )
    slack_channel: str = Field(
        default="#releases", description="Channel for release threads when the policy sets none."
    )
    requester: str | None = Field(
        default=None,
        description="Who asks for releases from this shell: a Slack user id (for four-eyes) "
        "or a login; `promote --requested-by` overrides it. Default: the login name.",
    )
    approvals_url: str | None = Field(
        default=None, description="URL of the Slack interactivity endpoint (approvals serve)."
    )
    webhooks_url: str | None = Field(
        default=None,
        description="URL of the MLflow registry webhook receiver (`modelship webhooks serve`).",
    )
    mlflow_webhook_secret: SecretStr | None = Field(
        default=None,
        description="HMAC-SHA256 secret shared with MLflow's registry webhook; the receiver "
        "refuses deliveries not signed with it (MODELSHIP_MLFLOW_WEBHOOK_SECRET).",
    )
    triton_replicas: list[TritonEndpoint] = Field(
        default_factory=list,
        description="The production Triton fleet (static discovery), as a JSON list.",
    )
    triton_canary: TritonEndpoint | None = Field(
        default=None, description="The canary Triton server, as a JSON object."
    )
    gateway_url: str | None = Field(
        default=None,
        description="Where production traffic goes over HTTP: the gateway in front of the "
        "replicas and the canary (`modelship stack up` runs one; docs/gateway.md).",
    )
    gateway_grpc: str | None = Field(
        default=None, description="The gateway's gRPC address (host:port)."
    )
    check_cache: bool = Field(
        default=True,
        description="Reuse a passed check whose inputs are byte-identical (artifact, golden "
        "rows, policy, modelship, Triton runtime) from <home>/cache/check; 0 forces every "
        "check to run fresh (as `modelship check --no-cache`).",
    )
    http_timeout_s: float = Field(
        default=10.0, gt=0, description="Timeout of one HTTP request to any server, in seconds."
    )
    control_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Deadline of one Triton model-control call (load/unload), in seconds.",
    )
    ping_timeout_s: float = Field(
        default=3.0, gt=0, description="Timeout of one health check, in seconds."
    )
    k8s_namespace: str | None = Field(
        default=None,
        description="Discover the Triton fleet from the EndpointSlices of a Service in this "
        "namespace (unset: the static fleet from MODELSHIP_TRITON_REPLICAS or stack.json).",
    )
    k8s_service: str | None = Field(
        default=None, description="The Triton Service whose ready endpoints form the fleet."
    )
    k8s_label_selector: str | None = Field(
        default=None, description="An EndpointSlice label selector, instead of k8s_service."
    )
    k8s_api_url: str | None = Field(
        default=None,
        description="API server URL without credentials (kubectl proxy); default: in-cluster "
        "service account, else the kubeconfig.",
    )
    k8s_kubeconfig: str | None = Field(default=None, description="Path of a kubeconfig file.")
    k8s_context: str | None = Field(default=None, description="The kubeconfig context to use.")
    k8s_http_port_name: str = Field(default="http", description="Service port name for HTTP.")
    k8s_grpc_port_name: str = Field(default="grpc", description="Service port name for gRPC.")
    k8s_metrics_port_name: str = Field(
        default="metrics", description="Service port name for Prometheus metrics."
    )
    k8s_route: str | None = Field(
        default=None,
        description="The Kubernetes Gateway API HTTPRoute in front of the fleet, as "
        "namespace/name (infra: modelship/triton-inference). Set: live traffic is split and "
        "mirrored by patching it (the Gateway API router); unset: the embedded stack's local "
        "gateway.",
    )
    k8s_route_production: str = Field(
        default="triton:8000",
        description="The route's production backendRef (the fleet's Service), as service:port.",
    )
    k8s_route_canary: str = Field(
        default="triton-canary:8000",
        description="The route's canary backendRef (the canary Triton's Service), as "
        "service:port; it gets the canary weight and the RequestMirror filter.",
    )
    triton_runtime: Path = Field(
        default=Path(".venv-triton"),
        description="The server runtime venv holding nvidia-pytriton (tritonserver) and "
        "onnxruntime with numpy<2; `make install` builds it.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        home = getattr(init_settings, "init_kwargs", {}).get("home") or os.environ.get(
            "MODELSHIP_HOME", ".modelship"
        )
        return (init_settings, env_settings, StackFileSource(settings_cls, Path(home)))

    def kubernetes_discovery(self) -> dict[str, Any] | None:
        """The keys of ``build_discovery(kubernetes=...)``, or None when not configured."""
        if not self.k8s_namespace:
            return None
        values = {
            "namespace": self.k8s_namespace, "service": self.k8s_service,
            "label_selector": self.k8s_label_selector, "api_url": self.k8s_api_url,
            "kubeconfig": self.k8s_kubeconfig, "context": self.k8s_context,
            "http_port_name": self.k8s_http_port_name,
            "grpc_port_name": self.k8s_grpc_port_name,
            "metrics_port_name": self.k8s_metrics_port_name, "timeout_s": self.http_timeout_s,
        }
        return {key: value for key, value in values.items() if value is not None}

    def gateway_api_router(self) -> dict[str, Any] | None:
        """The keys of ``build_gateway_api_router``, or None: no route is configured, so
        the router is the embedded stack's local gateway."""
        if not self.k8s_route:
            return None
        values = {
            "route": self.k8s_route, "production": self.k8s_route_production,
            "canary": self.k8s_route_canary, "api_url": self.k8s_api_url,
            "kubeconfig": self.k8s_kubeconfig, "context": self.k8s_context,
            "timeout_s": self.http_timeout_s,
        }
        return {key: value for key, value in values.items() if value is not None}

    @property
    def stack_file(self) -> Path:
        """Path of the embedded stack's state file."""
        return self.home / STACK_FILE_NAME

    @property
    def repository_url(self) -> str:
        """The Triton ``--model-repository`` URL of the S3 repository."""
        if not self.s3_endpoint:
            raise UsageError(
                "no S3 endpoint is configured",
                hint="set MODELSHIP_S3_ENDPOINT or run `modelship stack up`",
            )
        host = self.s3_endpoint.split("://", 1)[-1].rstrip("/")
        return f"s3://{host}/{self.bucket}/{self.repository_prefix}"


class StackFileSource(PydanticBaseSettingsSource):
    """Fills settings from ``$MODELSHIP_HOME/stack.json`` when the stack is running."""

    def __init__(self, settings_cls: type[BaseSettings], home: Path) -> None:
        super().__init__(settings_cls)
        self.home = home

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = self.home / STACK_FILE_NAME
        if not path.is_file():
            return {}
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(
                f"{path} is not readable JSON ({exc})",
                hint="run `modelship stack down` to clear it, then `modelship stack up`",
            ) from exc
        return settings_from_stack_state(state)


def settings_from_stack_state(state: dict[str, Any]) -> dict[str, Any]:
    """Map the stack state file onto settings fields (pure)."""
    triton = state.get("triton") or {}
    gateway = state.get("gateway") or {}
    values: dict[str, Any] = {
        "mlflow_tracking_uri": state.get("mlflow_uri"),
        "s3_endpoint": state.get("s3_endpoint"),
        "bucket": state.get("bucket"),
        "repository_prefix": state.get("repository_prefix"),
        "aws_access_key_id": state.get("access_key"),
        "aws_secret_access_key": state.get("secret_key"),
        "aws_region": state.get("region"),
        "prefect_api_url": state.get("prefect_api_url"),
        "slack_api_url": state.get("slack_api_url"),
        "slack_token": state.get("slack_token"),
        "slack_signing_secret": state.get("slack_signing_secret"),
        "manifest_signing_key": state.get("manifest_signing_key"),
        "approvals_url": state.get("approvals_url"),
        "webhooks_url": state.get("webhooks_url"),
        "mlflow_webhook_secret": state.get("mlflow_webhook_secret"),
        "triton_replicas": triton.get("replicas"),
        "triton_canary": triton.get("canary"),
        "gateway_url": gateway.get("http"),
        "gateway_grpc": gateway.get("grpc"),
    }
    return {key: value for key, value in values.items() if value is not None}


def load_settings(**overrides: Any) -> Settings:
    """Build settings at the edge; translate validation errors into a usage error."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise UsageError(
            f"invalid settings: {problems}",
            hint="fix the MODELSHIP_* environment variables (see `modelship --help`)",
        ) from exc
