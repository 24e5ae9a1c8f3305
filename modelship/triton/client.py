"""One Triton server: health over HTTP and gRPC, model control over gRPC only.

RECIPES: in Triton 2.51 an HTTP load call blocks an HTTP worker thread and stalls serving
connections pinned to it, so every control call (load, unload, index, config) uses gRPC.
tritonclient errors are translated here into modelship errors.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from modelship.errors import InfrastructureError, Unreachable
from modelship.http import expect_ok, get
from modelship.policy import Target
from modelship.settings import TritonEndpoint

if TYPE_CHECKING:
    import tritonclient.grpc as grpcclient


class TritonServer:
    """A Triton server. The constructor does no I/O; the gRPC channel opens on first use.

    Args:
        endpoint: Its HTTP, gRPC and metrics endpoints.
        timeout_s: Timeout of one health or inference request, in seconds.
        control_timeout_s: Deadline of one load or unload, in seconds.

    Attributes:
        target: ``cpu`` or ``gpu`` once :func:`modelship.triton.target.detect_targets`
            read it from the server's metrics; None until then.
        gpu_count: How many GPUs those metrics show (0 on a CPU server); None until read.
    """

    def __init__(
        self, endpoint: TritonEndpoint, *, timeout_s: float, control_timeout_s: float
    ) -> None:
        self.endpoint = endpoint
        self.name = endpoint.name or endpoint.http
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._grpc: grpcclient.InferenceServerClient | None = None
        self.target: Target | None = None
        self.gpu_count: int | None = None

    @property
    def grpc(self) -> grpcclient.InferenceServerClient:
        if self._grpc is None:
            import tritonclient.grpc as grpcclient  # lazy: grpcio only once gRPC is used

            self._grpc = grpcclient.InferenceServerClient(self.endpoint.grpc)
        return self._grpc

    def warm(self) -> None:
        """Import grpcio and build the channel, with no I/O: a caller that times this
        server's answer starts its clock after the local work (``modelship status``)."""
        self.grpc  # noqa: B018 - the property builds the client

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None

    def _unreachable(self, exc: Exception, action: str) -> Exception:
        text = str(exc)
        status = getattr(exc, "status", None)
        code = str(status() if callable(status) else "") or text
        # the status code decides: a load refused with "version 2 is at UNAVAILABLE state"
        # in its message (INVALID_ARGUMENT) is a model failure, not an unreachable server
        if "UNAVAILABLE" in code or "DEADLINE_EXCEEDED" in code or "Deadline" in code:
            return Unreachable(
                f"Triton {self.name} ({self.endpoint.grpc}) did not answer while trying to "
                f"{action}: {text.strip()}",
                hint="check that the server is running (`modelship doctor`)",
                endpoint=self.endpoint.grpc,
            )
        return InfrastructureError(
            f"Triton {self.name} failed to {action}: {text.strip()}",
            hint="see the Triton server log",
            endpoint=self.endpoint.grpc,
        )

    def ping(self) -> None:
        """Ready over HTTP and over gRPC, or raise naming the endpoint."""
        expect_ok(f"{self.endpoint.http}/v2/health/ready", timeout_s=self.timeout_s,
                  what=f"Triton {self.name} (HTTP)")
        try:
            ready = self.grpc.is_server_ready(client_timeout=self.timeout_s)
        except Exception as exc:
            raise self._unreachable(exc, "report readiness over gRPC") from exc
        if not ready:
            raise InfrastructureError(
                f"Triton {self.name} ({self.endpoint.grpc}) is live but not ready",
                hint="see its log: a model in the repository may have failed to load",
            )

    def server_metadata(self) -> dict[str, Any]:
        """The server's name, version and extensions (``GET /v2``); {} when it answers
        anything but 200 with a JSON object."""
        status, body = get(f"{self.endpoint.http}/v2", timeout_s=self.timeout_s,
                           what=f"Triton {self.name} (HTTP)")
        try:
            meta = json.loads(body) if status == 200 else {}
        except ValueError:
            return {}
        return meta if isinstance(meta, dict) else {}

    def load_model(
        self, name: str, *, config_json: str | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load (or reload) ``name``; with ``config_json`` the override replaces the config."""
        try:
            self.grpc.load_model(name, config=config_json, files=files,
                                 client_timeout=self.control_timeout_s)
        except Exception as exc:
            raise self._unreachable(exc, f"load model {name}") from exc

    def unload_model(self, name: str) -> None:
        try:
            self.grpc.unload_model(name, client_timeout=self.control_timeout_s)
        except Exception as exc:
            raise self._unreachable(exc, f"unload model {name}") from exc

    def is_model_ready(self, name: str, version: str = "") -> bool:
        try:
            return bool(self.grpc.is_model_ready(name, version, client_timeout=self.timeout_s))
        except Exception as exc:
            raise self._unreachable(exc, f"check readiness of {name}") from exc

    def repository_index(self) -> list[dict[str, Any]]:
        """Every model the server knows: name, version, state, reason."""
        try:
            index = self.grpc.get_model_repository_index(as_json=True,
                                                         client_timeout=self.timeout_s)
        except Exception as exc:
            raise self._unreachable(exc, "read the repository index") from exc
        return list(index.get("models", []))

    def model_metadata(self, name: str) -> dict[str, Any] | None:
        """The model's metadata (``versions`` lists those loaded), from the server's memory.

        Needs no repository access, so it answers while S3 is down. None when the server
        does not serve the model (unknown, or not loaded).
        """
        try:
            return dict(self.grpc.get_model_metadata(name, as_json=True,
                                                     client_timeout=self.timeout_s))
        except Exception as exc:
            text = str(exc)
            if "NOT_FOUND" in text or "unknown model" in text.lower():
                return None
            raise self._unreachable(exc, f"read the metadata of {name}") from exc

    def model_config(self, name: str) -> dict[str, Any]:
        """The live config of ``name`` as JSON, with server-added ``runtime`` stripped."""
        try:
            response = self.grpc.get_model_config(name, as_json=True,
                                                  client_timeout=self.timeout_s)
        except Exception as exc:
            raise self._unreachable(exc, f"read the config of {name}") from exc
        config = dict(response.get("config", {}))
        config.pop("runtime", None)
        return json.loads(json.dumps(config))
