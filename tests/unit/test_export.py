"""Export stage: conversion, pass-through, checks, opset policy and parity (no servers).

Models are saved with MLflow into ``tmp_path`` and the ResolvedVersion is built by hand,
so every test runs the real converters, onnx checker and onnxruntime.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import mlflow.onnx
import mlflow.sklearn
import numpy as np
import onnx
import onnxruntime as ort
import pandas as pd
import pytest
import yaml
from mlflow.models import Model, infer_signature
from onnx import TensorProto, helper, numpy_helper
from skl2onnx import convert_sklearn
from skl2onnx.common.data_types import FloatTensorType
from sklearn.base import is_classifier
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from modelship.candidate import ResolvedVersion
from modelship.errors import ExportError, ValidationFailed
from modelship.policy import ExportPolicy
from modelship.triton.model_config import ModelSpec, TensorSpec
from tasks.export import DATA_FILE, MODEL_FILE, export_model, golden_feed, graph_spec

# Saves skip MLflow's pip inference, which spends ~30 s per model in a subprocess.
NO_PIP = ["modelship-test"]
COLUMNS = ["sepal_length", "sepal_width", "petal_length", "petal_width"]


def iris_like(rows: int = 150, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """Three separable-ish classes in four numeric columns, like iris."""
    rng = np.random.default_rng(seed)
    centers = np.array([[5.0, 3.4, 1.5, 0.2], [5.9, 2.8, 4.3, 1.3], [6.6, 3.0, 5.6, 2.0]])
    y = rng.integers(0, 3, size=rows)
    x = centers[y] + rng.normal(scale=0.35, size=(rows, 4))
    return pd.DataFrame(x, columns=COLUMNS), y


def resolved(local_dir: Path, flavor: str, *, name: str = "iris") -> ResolvedVersion:
    """A ResolvedVersion as resolve would build it, from the MLmodel file on disk."""
    mlmodel = Model.load(str(local_dir / "MLmodel"))
    signature = mlmodel.signature.to_dict() if mlmodel.signature else None
    return ResolvedVersion(
        name=name,
        version=3,
        flavor=flavor,
        flavors=tuple(mlmodel.flavors),
        source="models:/m-test",
        run_id=None,
        signature=signature,
        metrics={},
        aliases=(),
        tags={},
        local_dir=local_dir,
    )


def save_sklearn(model: Any, x: pd.DataFrame, path: Path) -> Path:
    mlflow.sklearn.save_model(
        model, str(path), signature=infer_signature(x, model.predict(x)), pip_requirements=NO_PIP
    )
    return path


def to_onnx(model: Any, n_features: int, opset: int = 17) -> onnx.ModelProto:
    return convert_sklearn(
        model,
        initial_types=[("input", FloatTensorType([None, n_features]))],
        options={id(model): {"zipmap": False}} if is_classifier(model) else None,
        target_opset=opset,
    )


def add_onnx_flavor(local_dir: Path, graph: onnx.ModelProto) -> None:
    """Put a graph next to another flavor and declare it in MLmodel, as a registry might."""
    onnx.save_model(graph, str(local_dir / MODEL_FILE))
    mlmodel_path = local_dir / "MLmodel"
    doc = yaml.safe_load(mlmodel_path.read_text())
    doc["flavors"]["onnx"] = {"data": MODEL_FILE, "onnx_version": onnx.__version__}
    mlmodel_path.write_text(yaml.safe_dump(doc))


@pytest.fixture(scope="module")
def iris() -> tuple[pd.DataFrame, np.ndarray]:
    return iris_like()


# ---------------------------------------------------------------------------- sklearn


def test_sklearn_classifier_exports_label_and_probabilities(
    iris: tuple[pd.DataFrame, np.ndarray], tmp_path: Path
) -> None:
    x, y = iris
    model_dir = save_sklearn(LogisticRegression(max_iter=500).fit(x, y), x, tmp_path / "m")

    exported = export_model(resolved(model_dir, "sklearn"), x, ExportPolicy(), tmp_path / "out")

    assert set(exported.files) == {MODEL_FILE}
    assert exported.onnx_path == tmp_path / "out" / MODEL_FILE
    assert exported.opset <= 17
    assert exported.spec == ModelSpec(
        name="iris",
        inputs=(TensorSpec("input", "float32", (4,)),),
        outputs=(TensorSpec("label", "int64", ()), TensorSpec("probabilities", "float32", (3,))),
    )
    parity = exported.parity
    assert parity["passed"] is True and parity["rows"] == 150
    assert parity["outputs"]["label"]["kind"] == "exact"
    assert parity["outputs"]["label"]["mismatches"] == 0
    proba = parity["outputs"]["probabilities"]
    assert proba["kind"] == "close" and proba["passed"] is True
    assert proba["max_abs_err"] < 1e-4
    assert set(proba["worst"]) == {"row", "col"}
    json.dumps(exported.to_dict())  # the CLI prints it


def test_sklearn_regressor_output_is_named_prediction(
    iris: tuple[pd.DataFrame, np.ndarray], tmp_path: Path
) -> None:
    x, _ = iris
    target = 2.0 * x["petal_length"] - x["sepal_width"] + 0.5
    model_dir = save_sklearn(LinearRegression().fit(x, target), x, tmp_path / "m")

    exported = export_model(resolved(model_dir, "sklearn"), x, ExportPolicy(), tmp_path / "out")

    assert exported.spec.outputs == (TensorSpec("prediction", "float32", (1,)),)
    assert exported.parity["outputs"]["prediction"]["passed"] is True


def test_sklearn_pipeline_turns_zipmap_off_on_the_final_estimator(
    iris: tuple[pd.DataFrame, np.ndarray], tmp_path: Path
) -> None:
    x, y = iris
    pipe = Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression(max_iter=500))])
    model_dir = save_sklearn(pipe.fit(x, y), x, tmp_path / "m")
    policy = ExportPolicy(golden_max_rows=40)

    exported = export_model(resolved(model_dir, "sklearn"), x, policy, tmp_path / "out")

    assert [o.name for o in exported.spec.outputs] == ["label", "probabilities"]
    assert exported.parity["rows"] == 40
    assert exported.parity["passed"] is True


def test_sklearn_non_numeric_columns_are_rejected_by_name(
    iris: tuple[pd.DataFrame, np.ndarray], tmp_path: Path
) -> None:
    x, y = iris
    model_dir = save_sklearn(LogisticRegression(max_iter=500).fit(x, y), x, tmp_path / "m")
    with_text = x.assign(species=np.where(y == 0, "setosa", "other"))
    version = resolved(model_dir, "sklearn")
    signature = {"inputs": infer_signature(with_text).inputs.to_json(), "outputs": None}
    version = ResolvedVersion(**{**version.__dict__, "signature": signature})

    with pytest.raises(ValidationFailed, match=r"\['species'\] are not numeric") as info:
        export_model(version, with_text, ExportPolicy(), tmp_path / "out")
    assert info.value.exit_code == 3


# ---------------------------------------------------------------------------- onnx flavor


def test_onnx_flavor_with_external_data_passes_through_self_contained(tmp_path: Path) -> None:
    x, y = iris_like()
    # An MLP keeps its weights in initializers (4x100 floats: above onnx's 1 KiB threshold).
    clf = MLPClassifier(hidden_layer_sizes=(100,), max_iter=2000, random_state=0).fit(x, y)
    model_dir = tmp_path / "m"
    graph = to_onnx(clf, 4)
    for init in graph.graph.initializer:  # skl2onnx writes float_data; exporters raw_data
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init), init.name))
    mlflow.onnx.save_model(
        graph, str(model_dir), signature=infer_signature(x), pip_requirements=NO_PIP
    )
    source_data = [p.name for p in model_dir.glob("*.data")]
    assert source_data and DATA_FILE not in source_data  # mlflow names it <uuid>.data

    exported = export_model(resolved(model_dir, "onnx"), x, ExportPolicy(), tmp_path / "out")

    assert set(exported.files) == {MODEL_FILE, DATA_FILE}
    assert all(p.parent == tmp_path / "out" for p in exported.files.values())
    assert exported.parity["passed"] is True
    assert {"label", "probabilities"} <= set(exported.parity["outputs"])
    # Self-contained: the two files alone, copied elsewhere, load and answer.
    folder = tmp_path / "triton" / "iris" / "3"
    folder.mkdir(parents=True)
    for name, path in exported.files.items():
        shutil.copy(path, folder / name)
    shutil.rmtree(model_dir)
    shutil.rmtree(tmp_path / "out")
    session = ort.InferenceSession(str(folder / MODEL_FILE), providers=["CPUExecutionProvider"])
    label, _ = session.run(None, {"input": x.to_numpy(np.float32)[:5]})
    assert label.tolist() == clf.predict(x.iloc[:5]).tolist()


def test_corrupt_onnx_bytes_are_an_export_error(
    iris: tuple[pd.DataFrame, np.ndarray], tmp_path: Path
) -> None:
    x, y = iris
    model_dir = tmp_path / "m"
    clf = LogisticRegression(max_iter=500).fit(x, y)
    mlflow.onnx.save_model(
        to_onnx(clf, 4), str(model_dir), save_as_external_data=False, pip_requirements=NO_PIP
    )
    (model_dir / MODEL_FILE).write_bytes(b"\x08\x07garbage that is not a protobuf \xff\xfe")

    with pytest.raises(ExportError, match="not a valid ONNX model") as info:
        export_model(resolved(model_dir, "onnx"), x, ExportPolicy(), tmp_path / "out")
    assert str(model_dir / MODEL_FILE) in info.value.message
    assert info.value.exit_code == 3
    assert "re-log" in (info.value.hint or "")


def test_opset_above_the_policy_is_rejected_naming_the_opset(
    iris: tuple[pd.DataFrame, np.ndarray], tmp_path: Path
) -> None:
    x, y = iris
    model_dir = tmp_path / "m"
    clf = LogisticRegression(max_iter=500).fit(x, y)
    mlflow.onnx.save_model(to_onnx(clf, 4, opset=17), str(model_dir), pip_requirements=NO_PIP)
    policy = ExportPolicy(max_opset=15, target_opset=15)

    with pytest.raises(ValidationFailed, match="opset 17 .* above the policy's max_opset 15") as e:
        export_model(resolved(model_dir, "onnx"), x, policy, tmp_path / "out")
    assert "target_opset 15" in (e.value.hint or "")
    assert e.value.details == {"opset": 17, "max_opset": 15}


# ---------------------------------------------------------------------------- parity


def test_parity_fails_when_the_onnx_graph_is_another_classifier(tmp_path: Path) -> None:
    x, y = iris_like()
    model_a = LogisticRegression(max_iter=500).fit(x, y)
    model_b = LogisticRegression(max_iter=500).fit(x, (y + 1) % 3)  # other labels
    model_dir = save_sklearn(model_a, x, tmp_path / "m")
    add_onnx_flavor(model_dir, to_onnx(model_b, 4))

    with pytest.raises(ValidationFailed, match="parity failed for output 'label'") as info:
        export_model(resolved(model_dir, "onnx"), x, ExportPolicy(), tmp_path / "out")
    err = info.value
    assert err.details["output"] == "label"
    assert "does not compute the same function" in (err.hint or "")
    report = err.details["parity"]
    assert report["passed"] is False
    assert report["outputs"]["label"]["mismatch_rate"] > 0.5
    assert report["outputs"]["probabilities"]["passed"] is False


def test_parity_fails_when_the_onnx_graph_is_another_regressor(tmp_path: Path) -> None:
    x, _ = iris_like()
    model_a = LinearRegression().fit(x, x["petal_length"] * 2.0)
    model_b = LinearRegression().fit(x, x["petal_length"] * 2.0 + 0.01)  # off by 0.01
    model_dir = save_sklearn(model_a, x, tmp_path / "m")
    add_onnx_flavor(model_dir, to_onnx(model_b, 4))  # skl2onnx's own output name 'variable'

    with pytest.raises(ValidationFailed, match="parity failed for output 'variable'") as info:
        export_model(resolved(model_dir, "onnx"), x, ExportPolicy(), tmp_path / "out")
    message = info.value.message
    assert "worst element (row" in message and "atol 0.0001" in message and "rtol 0.001" in message
    result = info.value.details["parity"]["outputs"]["variable"]
    assert result["max_abs_err"] == pytest.approx(0.01, abs=1e-4)
    assert abs(result["native"] - result["onnx"]) == pytest.approx(0.01, abs=1e-4)


def test_parity_tolerance_comes_from_the_policy(tmp_path: Path) -> None:
    x, _ = iris_like()
    model_a = LinearRegression().fit(x, x["petal_length"] * 2.0)
    model_b = LinearRegression().fit(x, x["petal_length"] * 2.0 + 0.01)
    model_dir = save_sklearn(model_a, x, tmp_path / "m")
    add_onnx_flavor(model_dir, to_onnx(model_b, 4))
    loose = ExportPolicy.model_validate({"parity": {"atol": 0.02, "rtol": 0.0}})

    exported = export_model(resolved(model_dir, "onnx"), x, loose, tmp_path / "out")

    assert exported.parity["passed"] is True
    assert exported.parity["atol"] == 0.02


# ---------------------------------------------------------------------------- refusals


def test_unsupported_flavor_lists_the_supported_ones(tmp_path: Path) -> None:
    version = ResolvedVersion(
        name="boost", version=1, flavor="xgboost", flavors=("xgboost", "python_function"),
        source="models:/m-x", run_id=None, signature=None, metrics={}, aliases=(), tags={},
        local_dir=tmp_path,
    )
    with pytest.raises(ValidationFailed, match="onnx, sklearn, pytorch") as info:
        export_model(version, pd.DataFrame({"a": [1.0]}), ExportPolicy(), tmp_path / "out")
    assert "'xgboost'" in info.value.message
    assert info.value.exit_code == 3
    assert info.value.details["supported"] == ["onnx", "sklearn", "pytorch"]


def test_no_golden_rows_is_never_a_pass(
    iris: tuple[pd.DataFrame, np.ndarray], tmp_path: Path
) -> None:
    x, y = iris
    model_dir = save_sklearn(LogisticRegression(max_iter=500).fit(x, y), x, tmp_path / "m")
    with pytest.raises(ValidationFailed, match="no golden rows"):
        export_model(resolved(model_dir, "sklearn"), x.iloc[:0], ExportPolicy(), tmp_path / "o")


# ---------------------------------------------------------------------------- graph_spec


def _graph(
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto] | None = None,
    initializers: list[onnx.TensorProto] | None = None,
) -> onnx.ModelProto:
    outs = outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])]
    node = helper.make_node("Identity", [inputs[0].name], [outs[0].name])
    graph = helper.make_graph([node], "g", inputs, outs, initializer=initializers or [])
    return helper.make_model(graph)


F32, I64 = TensorProto.FLOAT, TensorProto.INT64


@pytest.mark.parametrize(
    ("shape", "elem", "expected"),
    [
        (["N", 4], F32, TensorSpec("x", "float32", (4,))),
        (["batch"], I64, TensorSpec("x", "int64", ())),
        ([None, 3, "h", "w"], F32, TensorSpec("x", "float32", (3, -1, -1))),
        ([-1, 8], TensorProto.DOUBLE, TensorSpec("x", "float64", (8,))),
        (["N", 1], TensorProto.STRING, TensorSpec("x", "object", (1,))),
        (["N", 2], TensorProto.BOOL, TensorSpec("x", "bool", (2,))),
    ],
)
def test_graph_spec_drops_the_batch_dimension(
    shape: list[Any], elem: int, expected: TensorSpec
) -> None:
    model = _graph([helper.make_tensor_value_info("x", elem, shape)])
    spec = graph_spec(model, name="m")
    assert spec.name == "m"
    assert spec.inputs == (expected,)
    assert spec.outputs == (TensorSpec("y", "float32", (2,)),)


def test_graph_spec_skips_initializers_listed_as_inputs() -> None:
    weight = helper.make_tensor("w", F32, [2], [1.0, 2.0])
    model = _graph(
        [
            helper.make_tensor_value_info("x", F32, ["N", 2]),
            helper.make_tensor_value_info("w", F32, [2]),
        ],
        initializers=[weight],
    )
    assert [t.name for t in graph_spec(model).inputs] == ["x"]
    assert graph_spec(model).name == "g"


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ([1, 4], "shape [1, 4]"),
        ([], "shape []"),
        (None, "no shape"),
    ],
)
def test_graph_spec_requires_a_batch_dimension(shape: list[Any] | None, words: str) -> None:
    model = _graph([helper.make_tensor_value_info("features", F32, shape)])
    with pytest.raises(ValidationFailed, match=re.escape(f"'features' has {words}")) as info:
        graph_spec(model)
    assert "dynamic batch axis" in (info.value.hint or "")
    assert info.value.details["tensor"] == "features"


def test_graph_spec_names_an_output_without_batch_dimension() -> None:
    out = helper.make_tensor_value_info("score", F32, [3])
    model = _graph([helper.make_tensor_value_info("x", F32, ["N", 3])], outputs=[out])
    with pytest.raises(ValidationFailed, match="output 'score'"):
        graph_spec(model)


# ---------------------------------------------------------------------------- golden_feed


COLUMN_SIGNATURE = {
    "inputs": json.dumps(
        [{"type": "double", "name": c, "required": True} for c in ["b", "a"]]
        + [{"type": "long", "name": "c", "required": True}]
    ),
    "outputs": None,
}
MATRIX = ModelSpec("m", inputs=(TensorSpec("input", "float32", (3,)),))


def test_golden_feed_column_signature_gives_one_float32_matrix_in_signature_order() -> None:
    golden = pd.DataFrame({"a": [1.0, 2.0], "extra": ["x", "y"], "c": [5, 6], "b": [3.0, 4.0]})
    feed = golden_feed(golden, MATRIX, COLUMN_SIGNATURE)
    assert list(feed) == ["input"]
    assert feed["input"].dtype == np.float32
    assert feed["input"].tolist() == [[3.0, 1.0, 5.0], [4.0, 2.0, 6.0]]


def test_golden_feed_without_signature_uses_every_column_in_order() -> None:
    golden = pd.DataFrame({"p": [1, 2], "q": [True, False], "r": [0.5, 0.25]})
    feed = golden_feed(golden, MATRIX, None)
    assert feed["input"].tolist() == [[1.0, 1.0, 0.5], [2.0, 0.0, 0.25]]


def test_golden_feed_lists_non_numeric_columns() -> None:
    signature = {
        "inputs": json.dumps(
            [
                {"type": "double", "name": "a"},
                {"type": "string", "name": "city"},
                {"type": "datetime", "name": "when"},
            ]
        )
    }
    golden = pd.DataFrame({"a": [1.0], "city": ["Oslo"], "when": [pd.Timestamp("2026-01-01")]})
    with pytest.raises(ValidationFailed, match=r"\['city', 'when'\] are not numeric") as info:
        golden_feed(golden, MATRIX, signature)
    assert info.value.details["columns"] == ["city", "when"]


def test_golden_feed_tensor_columns_are_stacked_per_named_input() -> None:
    spec = ModelSpec(
        "m",
        inputs=(TensorSpec("image", "float32", (2, 2)), TensorSpec("mask", "int64", (-1,))),
    )
    signature = {
        "inputs": json.dumps(
            [
                {"type": "tensor", "name": "image",
                 "tensor-spec": {"dtype": "float32", "shape": [-1, 2, 2]}},
                {"type": "tensor", "name": "mask",
                 "tensor-spec": {"dtype": "int64", "shape": [-1, -1]}},
            ]
        )
    }
    golden = pd.DataFrame(
        {
            "image": [np.arange(4.0), np.arange(4.0, 8.0)],  # flat, as parquet stores them
            "mask": [[1, 0, 1], [0, 1, 1]],
        }
    )
    feed = golden_feed(golden, spec, signature)
    assert feed["image"].shape == (2, 2, 2) and feed["image"].dtype == np.float32
    assert feed["image"][1].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert feed["mask"].dtype == np.int64 and feed["mask"].shape == (2, 3)


def test_golden_feed_names_missing_inputs_of_a_multi_input_graph() -> None:
    spec = ModelSpec(
        "m", inputs=(TensorSpec("a", "float32", ()), TensorSpec("b", "float32", ()))
    )
    with pytest.raises(ValidationFailed, match=r"\['b'\]"):
        golden_feed(pd.DataFrame({"a": [1.0]}), spec, None)


def test_golden_feed_rejects_values_that_do_not_fit_the_shape() -> None:
    spec = ModelSpec("m", inputs=(TensorSpec("input", "float32", (5,)),))
    with pytest.raises(ValidationFailed, match=r"shape \[2, 3\], the graph wants \[2, 5\]"):
        golden_feed(pd.DataFrame({"a": [1.0, 2], "b": [3.0, 4], "c": [5.0, 6]}), spec, None)


# ---------------------------------------------------------------------------- pytorch


@pytest.mark.parametrize("serialization", ["pickle", "pt2"])
def test_pytorch_exports_with_a_dynamic_batch_axis(tmp_path: Path, serialization: str) -> None:
    torch = pytest.importorskip("torch")
    import mlflow.pytorch

    x, _ = iris_like()
    features = x.to_numpy(np.float32).copy()
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3), torch.nn.Softmax(dim=1)
    ).eval()
    with torch.no_grad():
        out = module(torch.from_numpy(features)).numpy()
    model_dir = tmp_path / "m"
    # pickle: a column-based signature from the DataFrame; pt2 (MLflow's default) needs an
    # array example, so its signature is tensor-based with one unnamed input.
    example: Any = x if serialization == "pickle" else features
    mlflow.pytorch.save_model(
        module,
        str(model_dir),
        signature=infer_signature(example, out),
        input_example=None if serialization == "pickle" else features[:8],
        serialization_format=serialization,
        pip_requirements=NO_PIP,
    )

    exported = export_model(resolved(model_dir, "pytorch"), x, ExportPolicy(), tmp_path / "out")

    assert exported.spec.inputs == (TensorSpec("input", "float32", (4,)),)
    assert exported.spec.outputs == (TensorSpec("prediction", "float32", (3,)),)
    assert exported.opset == 17
    assert exported.parity["outputs"]["prediction"]["passed"] is True
    assert exported.parity["outputs"]["prediction"]["max_abs_err"] < 1e-5
    assert not list((tmp_path / "out").glob(".torch-export*"))


def test_pytorch_without_torch_says_how_to_install_it(
    iris: tuple[pd.DataFrame, np.ndarray], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = iris
    model_dir = save_sklearn(LogisticRegression(max_iter=500).fit(x, y), x, tmp_path / "m")
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(ExportError, match="torch is not installed") as info:
        export_model(resolved(model_dir, "pytorch"), x, ExportPolicy(), tmp_path / "out")
    assert info.value.hint and "pip install torch" in info.value.hint


SKOPS_TRUST = """
import json, sys
from tasks.export import import_skops_without_torch
import_skops_without_torch()
torch_after = "torch" in sys.modules
from skops.io._trusted_types import SKLEARN_ESTIMATOR_TYPE_NAMES
from skops.io._utils import whichmodule
restored = whichmodule.__module__ == "skops.io._utils"
print(json.dumps({"torch_after": torch_after, "trusted": sorted(SKLEARN_ESTIMATOR_TYPE_NAMES),
                  "restored": restored}))
"""


def test_skops_imports_without_torch_and_trusts_the_same_types() -> None:
    """A fresh process (this one may hold torch or skops already) imports skops as the
    export does: without torch, with skops's own ``whichmodule`` back afterwards. The types
    it trusts are the ones sklearn lists with torch importable, listed here: the child
    needs no torch import and no second walk of sklearn's packages."""
    import subprocess

    from sklearn.utils import all_estimators

    from tasks.export import import_skops_without_torch

    import_skops_without_torch()  # here too, when torch is not loaded yet (no-op otherwise)
    from skops.io._utils import get_type_name

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", SKOPS_TRUST], capture_output=True, text=True,
                          cwd=root, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    pytest.importorskip("torch")  # the full list with torch importable, as skops would see it
    full = sorted(get_type_name(c) for _, c in all_estimators()
                  if get_type_name(c).startswith("sklearn."))
    assert (result["torch_after"], result["restored"]) == (False, True)
    assert result["trusted"] == full
    assert len(full) > 100


def _other_modules() -> Any:
    """Loaded modules of the kinds quick_whichmodule must ask with getattr, each holding
    an object of its own (a ufunc without ``__module__``, as skops's scan looks for)."""
    import types

    class Subclassed(types.ModuleType):
        pass

    held = {name: np.frompyfunc(lambda x: x, 1, 1) for name in ("plain", "lazy", "sub")}
    plain = types.ModuleType("ms_quick_plain")
    plain.plain_ufunc = held["plain"]  # type: ignore[attr-defined]
    lazy = types.ModuleType("ms_quick_lazy")

    def module_getattr(name: str) -> Any:
        if name == "lazy_ufunc":
            return held["lazy"]
        raise AttributeError(name)

    lazy.__dict__["__getattr__"] = module_getattr
    sub = Subclassed("ms_quick_sub")
    sub.sub_ufunc = held["sub"]  # type: ignore[attr-defined]
    return {"ms_quick_plain": plain, "ms_quick_lazy": lazy, "ms_quick_sub": sub,
            "ms_quick_none": None}, held


def test_quick_whichmodule_answers_as_skops_whichmodule(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    import scipy.special
    from skops.io._utils import whichmodule

    from tasks.export import import_skops_without_torch, quick_whichmodule

    import_skops_without_torch()  # as the export does (not torch: sklearn's walk would)
    modules, held = _other_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    cases = [(getattr(np, n), n) for n in dir(np) if isinstance(getattr(np, n), np.ufunc)]
    cases += [(getattr(scipy.special, n), n) for n in dir(scipy.special)
              if isinstance(getattr(scipy.special, n), np.ufunc)]
    cases += [(held["plain"], "plain_ufunc"), (held["lazy"], "lazy_ufunc"),
              (held["sub"], "sub_ufunc"), (np.frompyfunc(abs, 1, 1), "nowhere"),
              (LogisticRegression, "LogisticRegression"), (np.add, "linalg.norm")]
    answers = [(name, whichmodule(obj, name)) for obj, name in cases]
    assert [(name, quick_whichmodule(obj, name, fallback=whichmodule)) for obj, name in cases] \
        == answers
    assert {name: where for name, where in answers[-6:-2]} == {
        "plain_ufunc": "ms_quick_plain", "lazy_ufunc": "ms_quick_lazy",
        "sub_ufunc": "ms_quick_sub", "nowhere": "__main__"}
    assert len(cases) > 300
