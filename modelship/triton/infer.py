"""Inference requests to one Triton server over HTTP, for checks and probes.

Requests are built by a pure function (:func:`build_inputs`); the transport call stays thin
and turns tritonclient errors into modelship errors in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from modelship.errors import InfrastructureError, Unreachable


@dataclass(frozen=True)
class InferAnswer:
    """Outputs of one request and the version that answered it."""

    outputs: dict[str, np.ndarray]
    model_version: str


def host_port(url: str) -> str:
    """``http://127.0.0.1:8000`` -> ``127.0.0.1:8000`` (tritonclient wants no scheme)."""
    return url.split("://", 1)[-1].rstrip("/")


def build_inputs(arrays: dict[str, np.ndarray]) -> list[Any]:
    """tritonclient InferInput objects for named arrays (batch dimension first)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        item = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


class TritonInference:
    """HTTP inference against one server. The constructor does no I/O.

    Args:
        http_url: The server's HTTP base URL.
        timeout_s: Connection and network timeout of one request, in seconds.
    """

    def __init__(self, http_url: str, *, timeout_s: float) -> None:
        self.http_url = http_url
        self.timeout_s = timeout_s
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            import tritonclient.http as httpclient

            self._client = httpclient.InferenceServerClient(
                host_port(self.http_url), connection_timeout=self.timeout_s,
                network_timeout=self.timeout_s)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def infer(self, model: str, arrays: dict[str, np.ndarray], *, outputs: list[str],
              version: str = "") -> InferAnswer:
        """One request; raises InfrastructureError naming the model on any failure."""
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException

        requested = [httpclient.InferRequestedOutput(name) for name in outputs]
        try:
            result = self.client.infer(model, build_inputs(arrays), model_version=version,
                                       outputs=requested)
        except InferenceServerException as exc:
            raise InfrastructureError(
                f"Triton at {self.http_url} failed to run {model}"
                f"{'/' + version if version else ''}: {exc.message()}",
                hint="check the model's inputs against its config (`modelship check`)",
                model=model,
            ) from exc
        except (ConnectionError, OSError) as exc:
            raise Unreachable(f"Triton at {self.http_url} did not answer: {exc}",
                              hint="check that the server runs (`modelship doctor`)") from exc
        response = result.get_response()
        return InferAnswer(
            outputs={name: result.as_numpy(name) for name in outputs},
            model_version=str(response.get("model_version", "")),
        )

    def infer_rows(self, model: str, arrays: dict[str, np.ndarray], *, outputs: list[str],
                   max_batch: int, version: str = "") -> dict[str, np.ndarray]:
        """Run every row, in requests of at most ``max_batch`` rows, and concatenate."""
        rows = len(next(iter(arrays.values())))
        step = max(1, max_batch)
        parts: list[dict[str, np.ndarray]] = []
        for start in range(0, rows, step):
            chunk = {name: array[start:start + step] for name, array in arrays.items()}
            parts.append(self.infer(model, chunk, outputs=outputs, version=version).outputs)
        return {name: np.concatenate([p[name] for p in parts]) for name in outputs}
