"""Golden inputs: the rows every check, trial load and canary replays.

The convention, in order of preference:

1. ``golden/inputs.parquet``, an artifact logged on the version's run
   (``mlflow.log_artifact(path, artifact_path="golden")``) — recorded production traffic
   or a curated set;
2. the model's ``input_example`` (``log_model(..., input_example=...)``);
3. synthetic rows generated from the signature. Reports flag it, and the policy can forbid
   it (``export.allow_synthetic_golden: false``).

Rows are stored as a DataFrame in parquet. A tensor input becomes one column whose cells
hold the per-row array (as nested lists).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import yaml

from modelship.candidate import GoldenInputs, ResolvedVersion
from modelship.errors import ValidationFailed
from modelship.triton.model_config import numpy_dtype_from_onnx

if TYPE_CHECKING:
    import pandas as pd

    from model_registry.client import RegistryClient

GOLDEN_ARTIFACT = "golden/inputs.parquet"
SYNTHETIC_ROWS = 64

_COLUMN_DTYPES = {
    "double": "float64", "float": "float32", "long": "int64", "integer": "int32",
    "boolean": "bool", "string": "str",
}


def load_golden(
    registry: RegistryClient,
    resolved: ResolvedVersion,
    *,
    workdir: Path,
    max_rows: int,
    allow_synthetic: bool,
    seed: int = 0,
) -> tuple[GoldenInputs, pd.DataFrame]:
    """Find the golden rows of a version, following the convention above."""
    import pandas as pd  # lazy: pandas costs ~0.8 s at import; no importer loads it

    workdir.mkdir(parents=True, exist_ok=True)
    frame: pd.DataFrame | None = None
    source = ""
    if resolved.run_id:
        path = registry.download_run_artifact(resolved.run_id, GOLDEN_ARTIFACT, workdir)
        if path is not None:
            frame, source = pd.read_parquet(path), "artifact"
    if frame is None:
        example = input_example(resolved.local_dir)
        if example is not None:
            frame, source = example, "input_example"
    signature = resolved.signature or inferred_signature(resolved)
    if frame is None:
        if not allow_synthetic:
            raise ValidationFailed(
                f"{resolved.uri} has no golden inputs: no {GOLDEN_ARTIFACT} artifact on run "
                f"{resolved.run_id} and no input_example",
                hint="log real rows with mlflow.log_artifact(path, artifact_path='golden') as "
                "inputs.parquet, or set export.allow_synthetic_golden: true in the policy",
                stage="golden",
            )
        frame, source = synthetic_rows(signature, rows=SYNTHETIC_ROWS, seed=seed), "synthetic"
    frame = frame.head(max_rows).reset_index(drop=True)
    out = workdir / "golden.parquet"
    frame.to_parquet(out)
    return GoldenInputs(source=source, path=out, rows=len(frame)), frame


def input_example(model_dir: Path) -> pd.DataFrame | None:
    """The model's saved input example as a DataFrame, or None."""
    # lazy: mlflow (~4 s) and pandas (~0.8 s) at import; only reading an input example
    import pandas as pd
    from mlflow.models import Model

    model = Model.load(str(model_dir))
    if not model.saved_input_example_info:
        return None
    example = model.load_input_example(str(model_dir))
    if example is None:
        return None
    if isinstance(example, pd.DataFrame):
        return example
    if isinstance(example, dict):
        return pd.DataFrame({name: [np.asarray(row).tolist() for row in np.asarray(value)]
                             for name, value in example.items()})
    array = np.asarray(example)
    name = _single_tensor_name(model.signature.to_dict() if model.signature else None)
    return pd.DataFrame({name: [np.asarray(row).tolist() for row in array]})


def inferred_signature(resolved: ResolvedVersion) -> dict[str, Any] | None:
    """A signature for a model logged without one, so that synthetic golden rows can still
    be made: the graph's inputs (``onnx``) or the fitted estimator's features (``sklearn``).
    None when it cannot be read; the export stage reports a broken model properly."""
    if resolved.flavor == "onnx":
        return _graph_signature(resolved)
    if resolved.flavor == "sklearn":
        return _estimator_signature(resolved)
    return None


def _estimator_signature(resolved: ResolvedVersion) -> dict[str, Any] | None:
    try:
        import mlflow.sklearn  # lazy: mlflow costs ~4 s at import; only an sklearn flavor

        model = mlflow.sklearn.load_model(str(resolved.local_dir))
        names = getattr(model, "feature_names_in_", None)
        width = int(getattr(model, "n_features_in_", 0))
    except Exception:  # noqa: BLE001 - see inferred_signature
        return None
    columns = [str(n) for n in names] if names is not None else [f"f{i}" for i in range(width)]
    if not columns:
        return None
    return {"inputs": json.dumps([{"type": "double", "name": c, "required": True}
                                  for c in columns])}


def _graph_signature(resolved: ResolvedVersion) -> dict[str, Any] | None:
    try:
        mlmodel = yaml.safe_load((resolved.local_dir / "MLmodel").read_text())
        path = resolved.local_dir / mlmodel["flavors"]["onnx"]["data"]
        graph = onnx.load(str(path), load_external_data=False).graph
        initializers = {i.name for i in graph.initializer}
        inputs = []
        for tensor in graph.input:
            if tensor.name in initializers:
                continue
            kind = tensor.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else -1 for d in kind.shape.dim]
            inputs.append({"type": "tensor", "name": tensor.name, "tensor-spec": {
                "dtype": numpy_dtype_from_onnx(kind.elem_type), "shape": shape or [-1]}})
    except Exception:  # noqa: BLE001 - see inferred_signature
        return None
    return {"inputs": json.dumps(inputs)} if inputs else None


def _single_tensor_name(signature: dict[str, Any] | None) -> str:
    inputs = _signature_inputs(signature)
    if len(inputs) == 1 and inputs[0].get("name"):
        return str(inputs[0]["name"])
    return "input"


def _signature_inputs(signature: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not signature or not signature.get("inputs"):
        return []
    raw = signature["inputs"]
    parsed = json.loads(raw) if isinstance(raw, str) else raw
    return list(parsed)


def synthetic_rows(signature: dict[str, Any] | None, *, rows: int, seed: int) -> pd.DataFrame:
    """Rows drawn from the signature: standard-normal floats, small ints, random booleans."""
    import pandas as pd  # lazy: pandas costs ~0.8 s at import; no importer loads it

    inputs = _signature_inputs(signature)
    if not inputs:
        raise ValidationFailed(
            "the model has no signature, so no golden inputs can be generated",
            hint="log the model with a signature (infer_signature) or an input_example",
            stage="golden",
        )
    rng = np.random.default_rng(seed)
    columns: dict[str, Any] = {}
    for i, spec in enumerate(inputs):
        name = spec.get("name") or f"input_{i}"
        if spec.get("type") == "tensor":
            info = spec["tensor-spec"]
            shape = [d if d and d > 0 else 1 for d in info["shape"][1:]]
            dtype = np.dtype(info["dtype"])
            values = _random(rng, dtype, (rows, *shape))
            columns[name] = [v.tolist() for v in values]
        else:
            dtype = np.dtype(_COLUMN_DTYPES.get(str(spec.get("type")), "float64")
                             .replace("str", "object"))
            if dtype == np.dtype(object):
                columns[name] = [f"value-{k}" for k in rng.integers(0, 5, rows)]
            else:
                columns[name] = _random(rng, dtype, (rows,))
    return pd.DataFrame(columns)


def _random(rng: np.random.Generator, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 10, shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    raise ValidationFailed(f"cannot generate synthetic values of dtype {dtype}",
                           hint="log golden inputs with the model", stage="golden")
