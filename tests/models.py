"""Candidate models for the tests, good and bad, registered in a real MLflow server."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from model_registry.client import point_mlflow_at

N_FEATURES = 6

#: The requirements every logged model states, as modelship's demo and tasks/train do.
#: Without them MLflow infers them: it starts a Python subprocess that loads the model and
#: records its imports, 2-4 s per ONNX model and 7-10 s of CPU per sklearn model.
ONNX_REQUIREMENTS = ["onnx", "onnxruntime"]
SKLEARN_REQUIREMENTS = ["scikit-learn"]


def training_data(n_features: int = N_FEATURES, seed: int = 0) -> tuple[pd.DataFrame, Any]:
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=400, n_features=n_features, n_informative=4,
                               n_classes=3, random_state=seed)
    return pd.DataFrame(x, columns=[f"f{i}" for i in range(n_features)]), y


def sklearn_classifier(n_features: int = N_FEATURES, seed: int = 0) -> tuple[Any, pd.DataFrame]:
    from sklearn.linear_model import LogisticRegression

    frame, y = training_data(n_features, seed)
    return LogisticRegression(max_iter=500).fit(frame, y), frame


#: Logged models of :func:`register_sklearn` ``(reuse=True)``, by (tracking URI, features,
#: seed): the MLflow URI of the artifact a later registration registers again.
_LOGGED_SKLEARN: dict[tuple[str, int, int], str] = {}


def register_sklearn(tracking_uri: str, name: str, *, n_features: int = N_FEATURES,
                     seed: int = 0, golden: pd.DataFrame | None = None,
                     reuse: bool = False) -> int:
    """Log and register a LogisticRegression with an input example (and golden rows).

    ``reuse=True`` (no golden rows): register the artifact an earlier ``reuse`` call of this
    process logged for the same server, features and seed, as a new version of ``name``.
    Its bytes are then the same, so a check of it finds the first one's passed check in
    the stack's check cache (tasks/check_cache.py) instead of exporting it again: a fresh
    log never does, because skops names the model's arrays by ``id()``. For tests whose
    subject is what happens after the check (swaps, releases, journals); the check itself
    runs fresh the first time, and is tested on fresh bytes elsewhere.
    """
    import mlflow

    point_mlflow_at(tracking_uri)
    key = (tracking_uri, n_features, seed)
    if reuse and golden is None and key in _LOGGED_SKLEARN:
        again = mlflow.register_model(_LOGGED_SKLEARN[key], name)
        return int(again.version)
    model, frame = sklearn_classifier(n_features, seed)
    with mlflow.start_run():
        info = mlflow.sklearn.log_model(model, name="model", registered_model_name=name,
                                        input_example=frame.head(16),
                                        pip_requirements=SKLEARN_REQUIREMENTS)
        if golden is not None:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "inputs.parquet"
                golden.to_parquet(path)
                mlflow.log_artifact(str(path), artifact_path="golden")
    if reuse and golden is None:
        _LOGGED_SKLEARN[key] = info.model_uri
    return int(info.registered_model_version)


def sklearn_onnx(n_features: int = N_FEATURES, seed: int = 0, opset: int = 17) -> Any:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    model, _ = sklearn_classifier(n_features, seed)
    return convert_sklearn(model, initial_types=[("input", FloatTensorType([None, n_features]))],
                           options={id(model): {"zipmap": False}}, target_opset=opset)


def tensor_signature(name: str = "input", dtype: Any = np.float32,
                     width: int = N_FEATURES) -> Any:
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(dtype), (-1, width), name)]))


def register_onnx(tracking_uri: str, name: str, onnx_model: Any, *, signature: Any = None,
                  example: dict[str, np.ndarray] | None = None) -> int:
    """Log and register an ONNX graph (mlflow.onnx) with a tensor signature."""
    import mlflow

    point_mlflow_at(tracking_uri)
    if signature is None:
        signature = tensor_signature()
    with mlflow.start_run():
        info = mlflow.onnx.log_model(onnx_model, name="model", registered_model_name=name,
                                     signature=signature, input_example=example,
                                     pip_requirements=ONNX_REQUIREMENTS)
    return int(info.registered_model_version)


def register_directory(tracking_uri: str, name: str, model_dir: Path) -> int:
    """Register a hand-made MLflow model directory (to build corrupt or odd candidates)."""
    import mlflow

    point_mlflow_at(tracking_uri)
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(model_dir), artifact_path="model")
    version = mlflow.register_model(f"runs:/{run.info.run_id}/model", name)
    return int(version.version)


def corrupt_onnx_dir(tmp: Path) -> Path:
    """A valid mlflow.onnx model directory whose model.onnx bytes are garbage."""
    import mlflow

    target = tmp / "corrupt"
    mlflow.onnx.save_model(sklearn_onnx(), str(target), signature=tensor_signature(),
                           save_as_external_data=False, pip_requirements=ONNX_REQUIREMENTS)
    (target / "model.onnx").write_bytes(b"\x08\x07this is not a protobuf" * 10)
    return target


def parity_mismatch_dir(tmp: Path) -> Path:
    """sklearn model A as the native flavor, with model B's ONNX graph as the onnx flavor."""
    import mlflow
    import onnx
    import yaml

    target = tmp / "mismatch"
    model_a, frame = sklearn_classifier(seed=0)
    mlflow.sklearn.save_model(model_a, str(target), input_example=frame.head(16),
                              pip_requirements=SKLEARN_REQUIREMENTS)
    onnx.save_model(sklearn_onnx(seed=7), str(target / "model.onnx"))
    mlmodel_path = target / "MLmodel"
    mlmodel = yaml.safe_load(mlmodel_path.read_text())
    mlmodel["flavors"]["onnx"] = {"onnx_version": onnx.__version__, "data": "model.onnx",
                                  "providers": ["CPUExecutionProvider"],
                                  "code": None}
    mlmodel_path.write_text(yaml.safe_dump(mlmodel))
    return target


def onnx_graph(body: str, n_features: int = N_FEATURES) -> Any:
    """A tiny hand-written classifier graph: ``probabilities`` = f(input), ``label`` = argmax.

    ``body`` chooses f: ``"nan"`` (input * NaN), ``"scaled"`` (softmax * 10, out of [0,1]),
    ``"softmax"`` (a proper distribution).
    """
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(3)
    weights = numpy_helper.from_array(rng.standard_normal((n_features, 3)).astype(np.float32),
                                      "W")
    nodes = [helper.make_node("MatMul", ["input", "W"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["soft"], axis=1)]
    inits = [weights]
    if body == "nan":
        inits.append(numpy_helper.from_array(np.array([np.nan], np.float32), "k"))
        nodes.append(helper.make_node("Mul", ["soft", "k"], ["probabilities"]))
    elif body == "scaled":
        inits.append(numpy_helper.from_array(np.array([10.0], np.float32), "k"))
        nodes.append(helper.make_node("Mul", ["soft", "k"], ["probabilities"]))
    else:
        nodes.append(helper.make_node("Identity", ["soft"], ["probabilities"]))
    nodes.append(helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0))
    return classifier_graph(nodes, inits, name="candidate", n_features=n_features)


def classifier_graph(nodes: list[Any], initializers: list[Any], *, name: str,
                     n_features: int = N_FEATURES) -> Any:
    """A checked opset-17 graph with the classifier I/O every test model shares:
    ``input`` float32 [batch, n_features] -> ``label`` int64 [batch], ``probabilities``
    float32 [batch, 3]."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, n_features])],
        [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
         helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 3])],
        initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def pyfunc_only_dir(tmp: Path) -> Path:
    """A custom python_function model: a flavor modelship cannot export."""
    import mlflow

    class Doubler(mlflow.pyfunc.PythonModel):  # type: ignore[misc]
        def predict(self, context: Any, model_input: Any, params: Any = None) -> Any:
            return model_input * 2

    target = tmp / "pyfunc"
    mlflow.pyfunc.save_model(str(target), python_model=Doubler(),
                             input_example=pd.DataFrame({"x": [1.0, 2.0]}),
                             pip_requirements=["pandas"])
    return target


def write_policy(path: Path, policy: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(policy))
    return path


def stack_json(home: Path) -> dict[str, Any]:
    return dict(json.loads((home / "stack.json").read_text()))
