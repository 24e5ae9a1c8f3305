"""A standalone ``tritonserver`` on a local model repository, for benchmarks and tests.

Not part of the embedded stack (``modelship stack up``): this starts one CPU Triton from
the runtime venv on free loopback ports, serving a folder on disk, and stops it again when
the ``with`` block ends. It is built from the stack's own pieces
(:mod:`modelship.stack.triton_runtime` for the command line and environment,
:mod:`modelship.stack.process` for starting, waiting and stopping), so the server runs
exactly as a stack replica does: explicit model control, every endpoint on 127.0.0.1.

:func:`mlp_classifier_onnx` builds the small ONNX classifier the benchmarks and the
integration tests serve with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from modelship.errors import ModelshipError, StackError
from modelship.http import get
from modelship.stack.process import (
    LOOPBACK,
    ProcessRecord,
    free_ports,
    port_open,
    process_start_ticks,
    reap,
    start_process,
    stop_process,
    wait_ready,
)
from modelship.stack.triton_runtime import (
    find_triton_runtime,
    prepare_backend_dir,
    server_command,
    server_env,
)

if TYPE_CHECKING:
    import onnx

#: Seconds the server gets to exit after SIGTERM before its process group is killed.
STOP_GRACE_S = 20.0


@dataclass
class LocalTriton:
    """A running local ``tritonserver`` and its endpoints.

    Attributes:
        process: The server process (leader of its own process group).
        http_url: KServe v2 HTTP base URL, ``http://127.0.0.1:PORT``.
        grpc_url: gRPC address, ``127.0.0.1:PORT`` (no scheme, as tritonclient wants it).
        metrics_url: Prometheus metrics URL, ``http://127.0.0.1:PORT/metrics``.
        log: The server's log file (stdout and stderr).
    """

    process: subprocess.Popen[bytes]
    record: ProcessRecord
    http_url: str
    grpc_url: str
    metrics_url: str
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log ("" if there is none yet)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@contextmanager
def local_tritonserver(
    runtime_venv: Path,
    repository: Path | str,
    workdir: Path,
    *,
    ready_models: Sequence[str] = (),
    load_models: Sequence[str] = (),
    deadline_s: float = 60.0,
    extra_args: Sequence[str] = (),
    s3_credentials: tuple[str, str] | None = None,
) -> Iterator[LocalTriton]:
    """Start a ``tritonserver`` on ``repository``, yield it once ready, always stop it.

    The server uses explicit model control, so nothing in the repository loads unless
    asked: pass ``--load-model=NAME`` in ``extra_args`` to load at startup, or name the
    model in ``load_models`` to load it over gRPC once the server is up.

    Args:
        runtime_venv: The Triton runtime venv, e.g. ``.venv-triton``.
        repository: The model repository (a local folder, or any ``--model-repository``).
        workdir: A writable folder for the backend directory (``backends/``) and the log
            (``tritonserver.log``).
        ready_models: Models that must report ready before the server is yielded.
        load_models: Models to load over gRPC once the server is ready; they must then be
            ready too.
        deadline_s: Seconds for the whole startup: server ready, loads, models ready.
        extra_args: More ``tritonserver`` flags, appended last.
        s3_credentials: ``(access key, secret key)`` for an ``s3://`` repository, passed
            in the server's environment (never on its command line).

    Yields:
        The ready server. On leaving the block (normally or by an exception) its whole
        process group is stopped: SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`.

    Raises:
        StackError: The runtime is missing or incomplete (from
            :func:`~modelship.stack.triton_runtime.find_triton_runtime`), the server could
            not be started, exited, was not ready in time, or a model failed to load. The
            message ends with the tail of the server log.
    """
    runtime = find_triton_runtime(runtime_venv)
    workdir.mkdir(parents=True, exist_ok=True)
    backend_dir = prepare_backend_dir(runtime, workdir / "backends")
    http_port, grpc_port, metrics_port = free_ports(3)
    command = server_command(
        runtime,
        backend_dir=backend_dir,
        model_repository=str(repository),
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        extra_args=extra_args,
    )
    proc, record = start_process(
        "tritonserver",
        command,
        env=server_env(runtime, os.environ,
                       s3_access_key=s3_credentials[0] if s3_credentials else None,
                       s3_secret_key=s3_credentials[1] if s3_credentials else None),
        log_path=workdir / "tritonserver.log",
        ports=(http_port, grpc_port, metrics_port),
    )
    server = LocalTriton(
        process=proc,
        record=record,
        http_url=f"http://{LOOPBACK}:{http_port}",
        grpc_url=f"{LOOPBACK}:{grpc_port}",
        metrics_url=f"http://{LOOPBACK}:{metrics_port}/metrics",
        log=Path(record.log),
    )
    try:
        _start_up(server, record, ready_models, load_models, deadline_s, grpc_port)
        yield server
    finally:
        _stop(proc, record)


def _start_up(
    server: LocalTriton,
    record: ProcessRecord,
    ready_models: Sequence[str],
    load_models: Sequence[str],
    deadline_s: float,
    grpc_port: int,
) -> None:
    """Wait for the server, load ``load_models``, wait for every named model."""
    started = time.monotonic()

    def left() -> float:
        return max(deadline_s - (time.monotonic() - started), 0.1)

    def http_200(path: str) -> bool:
        return get(f"{server.http_url}{path}", timeout_s=1.0, what="tritonserver")[0] == 200

    def fail(problem: str) -> StackError:
        return StackError(
            f"local tritonserver on {server.http_url}: {problem}; log tail ({server.log}):\n"
            f"{server.log_tail()}",
            hint=f"read {server.log}",
            log=str(server.log),
        )

    try:
        wait_ready(
            record,
            server.process,
            lambda: http_200("/v2/health/ready") and port_open(grpc_port),
            deadline_s=left(),
            interval_s=0.1,
        )
    except StackError as exc:
        raise fail(_what_happened(exc)) from exc

    if load_models:
        # lazy: the Triton control client (tritonclient, grpcio) only when models are loaded
        from modelship.settings import TritonEndpoint
        from modelship.triton.client import TritonServer

        control = TritonServer(
            TritonEndpoint(http=server.http_url, grpc=server.grpc_url, metrics=server.metrics_url),
            timeout_s=2.0,
            control_timeout_s=left(),
        )
        try:
            for name in load_models:
                try:
                    control.load_model(name)
                except ModelshipError as exc:
                    raise fail(f"loading {name} failed: {exc.message}") from exc
        finally:
            control.close()

    models = list(dict.fromkeys([*ready_models, *load_models]))
    if models:
        try:
            wait_ready(
                record,
                server.process,
                lambda: all(http_200(f"/v2/models/{name}/ready") for name in models),
                deadline_s=left(),
                interval_s=0.1,
            )
        except StackError as exc:
            problem = _what_happened(exc)
            raise fail(f"{problem} (waiting for models {', '.join(models)})") from exc


def _what_happened(exc: StackError) -> str:
    """The gist of a :func:`wait_ready` error, without its log reference and tail."""
    return exc.message.split("; see ", 1)[0]


def _stop(proc: subprocess.Popen[bytes], record: ProcessRecord) -> None:
    """Stop the server's process group, even when the server itself already exited."""
    if not stop_process(record, grace_s=STOP_GRACE_S, clean_shm=True):
        # The leader is gone (or a zombie) but its children (Python backend stubs) may
        # live on in its group. Kill the group unless the PID now names another process.
        ticks = process_start_ticks(proc.pid)
        if ticks is None or ticks == record.start_ticks:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    reap(proc)


def mlp_classifier_onnx(
    n_features: int,
    *,
    n_samples: int = 300,
    hidden_units: int = 16,
    max_iter: int = 300,
    seed: int = 0,
) -> tuple[onnx.ModelProto, np.ndarray]:
    """A tiny sklearn ``MLPClassifier`` exported to ONNX: a fixture model, not for release.

    Used by the benchmarks and the integration tests to have something real for Triton's
    onnxruntime backend to serve. The input is ``input`` (FP32, ``[None, n_features]``);
    the outputs are ``label`` (INT64) and ``probabilities`` (FP32, three classes), with no
    ZipMap; opset 17. The classes are ``(x0 + x1 > 0) + (x2 > 1)``, so ``n_features`` must
    be at least 3. The same arguments give the same weights (skl2onnx names the graph
    at random).

    Args:
        n_features: Width of the input.
        n_samples: Rows of training data drawn (standard normal).
        hidden_units: Size of the single hidden layer.
        max_iter: Training iterations (convergence does not matter here).
        seed: Seed of the data and of the classifier.

    Returns:
        The ONNX model and its FP32 training inputs, ``(n_samples, n_features)``.
    """
    # lazy: scikit-learn and skl2onnx take seconds to import; only this builder needs them
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.neural_network import MLPClassifier

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_samples, n_features)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning is irrelevant here
        clf = MLPClassifier(
            hidden_layer_sizes=(hidden_units,), max_iter=max_iter, random_state=seed
        ).fit(x, y)
        proto = convert_sklearn(
            clf,
            initial_types=[("input", FloatTensorType([None, n_features]))],
            options={id(clf): {"zipmap": False}},
            target_opset=17,
        )
    return proto, x
