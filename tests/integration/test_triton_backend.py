"""A real tritonserver 2.51 (CPU) serving ONNX through modelship's onnxruntime backend.

One server for the module, started by :mod:`modelship.stack.local_triton` on free
loopback ports with a local model repository. Control calls go over gRPC, inference over
HTTP, as in the stack.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.errors import StackError
from modelship.stack.local_triton import LocalTriton, local_tritonserver, mlp_classifier_onnx
from modelship.stack.triton_runtime import find_triton_runtime, prepare_backend_dir

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNTIME_VENV = REPO_ROOT / ".venv-triton"
N_FEATURES = 4
N_CLASSES = 3
READY_DEADLINE_S = 60.0


def _config(
    name: str, *, input_name: str = "input", input_type: str = "TYPE_FP32"
) -> dict[str, Any]:
    """A full model config, as JSON for a load override (tritonclient wants a string)."""
    return {
        "name": name,
        "backend": "onnxruntime",
        "max_batch_size": 32,
        "input": [{"name": input_name, "data_type": input_type, "dims": [N_FEATURES]}],
        "output": [
            {"name": "label", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}},
            {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [N_CLASSES]},
        ],
        "dynamic_batching": {"max_queue_delay_microseconds": 5000},
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
    }


def _config_pbtxt(name: str, *, input_name: str = "input") -> str:
    return f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: 32
input [ {{ name: "{input_name}" data_type: TYPE_FP32 dims: [ {N_FEATURES} ] }} ]
output [
  {{ name: "label" data_type: TYPE_INT64 dims: [ 1 ] reshape {{ shape: [ ] }} }},
  {{ name: "probabilities" data_type: TYPE_FP32 dims: [ {N_CLASSES} ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: 5000 }}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


@dataclass
class Model:
    """A tiny classifier as ONNX, in one file and with its weights as external data."""

    single_file: bytes
    external_graph: bytes
    external_data: bytes
    x: np.ndarray

    def reference(self, x: np.ndarray) -> dict[str, np.ndarray]:
        import onnxruntime as ort

        session = ort.InferenceSession(self.single_file, providers=["CPUExecutionProvider"])
        label, probabilities = session.run(["label", "probabilities"], {"input": x})
        return {"label": label, "probabilities": probabilities}


def _build_model(tmp: Path) -> Model:
    import onnx
    from onnx import numpy_helper

    proto, x = mlp_classifier_onnx(N_FEATURES)
    # skl2onnx writes float_data; external data needs raw_data.
    for init in proto.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init), init.name))
    single_file = proto.SerializeToString()

    # Weights as external data, like mlflow.onnx saves them. size_threshold is not 0:
    # onnxruntime refuses a Reshape whose shape constant lives in external data
    # ("Cannot parse data from external tensors"); the small shape tensor stays inline.
    ext_dir = tmp / "external"
    ext_dir.mkdir()
    onnx.save_model(
        proto,
        str(ext_dir / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.data",
        size_threshold=100,
    )
    external_graph = (ext_dir / "model.onnx").read_bytes()
    external_data = (ext_dir / "weights.data").read_bytes()
    assert len(external_data) > 0 and len(external_graph) < len(single_file)
    return Model(single_file, external_graph, external_data, x)


def _write_repo_model(repo: Path, name: str, model: Model, *, input_name: str = "input") -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(model.external_graph)
    (version / "weights.data").write_bytes(model.external_data)
    (repo / name / "config.pbtxt").write_text(_config_pbtxt(name, input_name=input_name))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return _build_model(tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: Model) -> Iterator[LocalTriton]:
    try:
        runtime = find_triton_runtime(RUNTIME_VENV)
    except StackError as exc:
        # The runtime is part of the project (`make install` builds .venv-triton from
        # requirements-triton.txt): missing, it is a broken checkout, not a reason to skip.
        pytest.fail(f"no Triton runtime: {exc}; run `make install` to build .venv-triton",
                    pytrace=False)

    base = tmp_path_factory.mktemp("triton")
    repo = base / "repo"
    repo.mkdir()
    _write_repo_model(repo, "clf", model)
    _write_repo_model(repo, "clf_badio", model, input_name="features")
    backend_dir = prepare_backend_dir(runtime, base / "backends")
    assert prepare_backend_dir(runtime, base / "backends") == backend_dir  # idempotent

    with local_tritonserver(RUNTIME_VENV, repo, base, deadline_s=READY_DEADLINE_S) as srv:
        yield srv


@pytest.fixture(scope="module")
def grpc_client(server: LocalTriton) -> Iterator[Any]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _http_infer(url: str, model_name: str, x: np.ndarray, outputs: list[str] | None = None) -> Any:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        tensor = httpclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        requested = [httpclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        return client.infer(model_name, [tensor], outputs=requested)
    finally:
        client.close()


def _stats(grpc_client: Any, name: str) -> tuple[int, int]:
    stats = grpc_client.get_inference_statistics(name, as_json=True)["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


@pytest.fixture(scope="module")
def loaded_clf(grpc_client: Any) -> str:
    grpc_client.load_model("clf")
    return "clf"


def test_loads_over_grpc_and_matches_onnxruntime(
    server: LocalTriton, grpc_client: Any, loaded_clf: str, model: Model
) -> None:
    assert grpc_client.is_model_ready(loaded_clf, "1")
    live = grpc_client.get_model_config(loaded_clf, as_json=True)["config"]
    assert live["backend"] == "onnxruntime" and live.get("runtime") == "model.py"

    x = model.x[:7]
    expected = model.reference(x)
    result = _http_infer(server.http_url, loaded_clf, x)
    np.testing.assert_allclose(
        result.as_numpy("probabilities"), expected["probabilities"], rtol=1e-5, atol=1e-6
    )
    label = result.as_numpy("label")
    assert label.dtype == np.int64 and label.shape == (7, 1)  # reshape { shape: [] }, dims [1]
    np.testing.assert_array_equal(label.ravel(), expected["label"])

    only = _http_infer(server.http_url, loaded_clf, x[:2], outputs=["probabilities"])
    assert [o["name"] for o in only.get_response()["outputs"]] == ["probabilities"]
    assert only.as_numpy("label") is None


def test_dynamic_batch_is_one_onnxruntime_run(
    server: LocalTriton, grpc_client: Any, loaded_clf: str, model: Model
) -> None:
    n_requests = 200
    rows = model.x[:n_requests]
    expected = model.reference(rows)
    before = _stats(grpc_client, loaded_clf)

    def one(i: int) -> np.ndarray:
        return _http_infer(server.http_url, loaded_clf, rows[i : i + 1]).as_numpy("probabilities")

    with ThreadPoolExecutor(max_workers=24) as pool:
        results = list(pool.map(one, range(n_requests)))

    # Every request got its own row back, whatever batch it was run in.
    np.testing.assert_allclose(
        np.concatenate(results), expected["probabilities"], rtol=1e-5, atol=1e-6
    )
    after = _stats(grpc_client, loaded_clf)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == n_requests
    assert 0 < executions < inferences, f"{executions} executions for {inferences} inferences"


def test_config_with_unknown_input_is_refused(grpc_client: Any) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as excinfo:
        grpc_client.load_model("clf_badio")
    text = str(excinfo.value)
    assert "'features'" in text and "'input'" in text, text
    assert not grpc_client.is_model_ready("clf_badio")


def test_config_with_wrong_dtype_is_refused(grpc_client: Any, model: Model) -> None:
    from tritonclient.utils import InferenceServerException

    name = "clf_fp64"
    with pytest.raises(InferenceServerException) as excinfo:
        grpc_client.load_model(
            name,
            config=json.dumps(_config(name, input_type="TYPE_FP64")),
            files={"file:1/model.onnx": model.single_file},
        )
    text = str(excinfo.value)
    assert "TYPE_FP64" in text and "TYPE_FP32" in text, text


def test_trial_load_without_repository_entry(
    server: LocalTriton, grpc_client: Any, model: Model
) -> None:
    name = "trial_clf"
    index = grpc_client.get_model_repository_index(as_json=True).get("models", [])
    assert name not in {entry["name"] for entry in index}
    grpc_client.load_model(
        name,
        config=json.dumps(_config(name)),
        files={
            "file:1/model.onnx": model.external_graph,
            "file:1/weights.data": model.external_data,
        },
    )
    try:
        assert grpc_client.is_model_ready(name, "1")
        x = model.x[:3]
        result = _http_infer(server.http_url, name, x)
        np.testing.assert_allclose(
            result.as_numpy("probabilities"),
            model.reference(x)["probabilities"],
            rtol=1e-5,
            atol=1e-6,
        )
    finally:
        grpc_client.unload_model(name)
    deadline = time.monotonic() + 10
    while grpc_client.is_model_ready(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not grpc_client.is_model_ready(name)
