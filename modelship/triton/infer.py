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
    # lazy: tritonclient.http pulls in gevent; only a request needs it
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        item = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def warm_http() -> None:
    """Import tritonclient.http (gevent with it: ~0.5 s idle, seconds on a loaded machine)
    with no I/O, so that a deadline started afterwards times the servers alone (the swap's
    phases and reconcile probe over HTTP; their first probe used to pay this import)."""
    # lazy: tritonclient.http pulls in gevent; only a caller about to probe needs it
    import tritonclient.http  # noqa: F401
    import tritonclient.utils  # noqa: F401


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
            import tritonclient.http as httpclient  # lazy: gevent only once a request is made

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
        # lazy: tritonclient.http pulls in gevent; only a request needs it
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


# --------------------------------------------------------------------------------------
# the golden probe: a few rows and the outputs recorded for them at staging time


def _encode_array(array: np.ndarray) -> dict[str, Any]:
    if array.dtype.kind in "OSU":
        data: Any = [x.decode() if isinstance(x, bytes) else str(x) for x in array.ravel()]
        return {"dtype": "bytes", "shape": list(array.shape), "data": data}
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.ravel().tolist()}


def _decode_array(entry: Any) -> np.ndarray:
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) \
            or not isinstance(entry.get("data"), list):
        raise ValueError("an array entry must be {dtype, shape: [...], data: [...]}")
    shape = tuple(int(d) for d in entry["shape"])
    if entry.get("dtype") == "bytes":
        return np.array([str(x).encode() for x in entry["data"]], dtype=object).reshape(shape)
    return np.array(entry["data"], dtype=np.dtype(str(entry.get("dtype")))).reshape(shape)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


@dataclass(frozen=True)
class GoldenProbe:
    """Golden input rows and the candidate's outputs on them, recorded at staging time.

    The swap and reconcile send ``inputs`` to a replica and require ``outputs`` back within
    tolerance (``|a - b| <= atol + rtol * |b|`` for floats, equality otherwise), so a
    replica that serves other bytes under the right version number is caught.

    Attributes:
        inputs: Input name to array (batch first).
        outputs: Output name to the array recorded for those inputs.
        atol: Absolute tolerance for float outputs.
        rtol: Relative tolerance for float outputs.
    """

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    atol: float
    rtol: float

    @classmethod
    def record(cls, feed: dict[str, np.ndarray], outputs: dict[str, np.ndarray], *,
               rows: int = 4, atol: float = 1e-4, rtol: float = 1e-3) -> GoldenProbe:
        """The first ``rows`` rows of a golden feed and of the outputs computed on it."""
        n = max(1, rows)
        return cls({k: np.asarray(v)[:n] for k, v in feed.items()},
                   {k: np.asarray(v)[:n] for k, v in outputs.items()}, float(atol), float(rtol))

    def to_dict(self) -> dict[str, Any]:
        """JSON for the manifest (signed with it)."""
        return {"inputs": {k: _encode_array(v) for k, v in sorted(self.inputs.items())},
                "outputs": {k: _encode_array(v) for k, v in sorted(self.outputs.items())},
                "atol": self.atol, "rtol": self.rtol}

    @classmethod
    def from_dict(cls, data: Any) -> GoldenProbe:
        """Parse the manifest's ``probe``; ValueError when it is malformed."""
        if not isinstance(data, dict) or not data.get("inputs") or not data.get("outputs"):
            raise ValueError("a probe must have non-empty 'inputs' and 'outputs'")
        return cls({str(k): _decode_array(v) for k, v in dict(data["inputs"]).items()},
                   {str(k): _decode_array(v) for k, v in dict(data["outputs"]).items()},
                   float(data.get("atol", 1e-4)), float(data.get("rtol", 1e-3)))

    @property
    def output_names(self) -> list[str]:
        return sorted(self.outputs)

    def mismatches(self, answered: dict[str, np.ndarray]) -> list[str]:
        """How ``answered`` differs from the recorded outputs; empty when it matches."""
        problems = []
        for name, expected in sorted(self.outputs.items()):
            got = answered.get(name)
            if got is None:
                problems.append(f"{name} is missing")
                continue
            got = np.asarray(got)
            if got.shape != expected.shape and _squeezed(got.shape) == _squeezed(expected.shape):
                got = got.reshape(expected.shape)  # Triton's [N, 1] for the graph's [N]
            if got.shape != expected.shape:
                problems.append(f"{name} has shape {list(got.shape)}, recorded "
                                f"{list(expected.shape)}")
                continue
            if expected.dtype.kind == "f" or got.dtype.kind == "f":
                close = np.isclose(got.astype(np.float64), expected.astype(np.float64),
                                   atol=self.atol, rtol=self.rtol)
            else:
                close = np.asarray(got.astype(object) == expected.astype(object), dtype=bool)
            if not close.all():
                where = tuple(int(i) for i in np.argwhere(~close)[0])
                problems.append(f"{name}{list(where)} is {np.asarray(got[where]).tolist()!r}, "
                                f"recorded {np.asarray(expected[where]).tolist()!r} "
                                f"({int((~close).sum())} of "
                                f"{close.size} values differ)")
        return problems
