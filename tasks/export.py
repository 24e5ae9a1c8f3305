"""Stage 2, export: turn a resolved MLflow model version into a checked ONNX graph.

Why this stage exists: Triton serves ONNX, the registry holds whatever the data scientist
logged. The graph that leaves this stage has passed ``onnx.checker``, strict shape
inference and the policy's opset window, and it computes the same function as the
registered model on the golden rows (the **parity** check). Anything else stops the
release here, before a server sees it.

Where the graph comes from, by ``resolved.flavor``:

- ``onnx``: the file named by the MLmodel file's ``onnx.data`` key passes through.
- ``sklearn``: converted with skl2onnx at ``export.target_opset``, ``zipmap`` off.
- ``pytorch``: ``torch.onnx.export`` (the TorchScript exporter: the dynamo one needs
  onnxscript) with a dynamic batch axis, traced on the golden rows. ``pickle`` and ``pt2``
  (MLflow 3's default) saves both work. torch is an optional extra (``pip install torch``).

The version folder is self-contained: ``model.onnx``, plus ``model.onnx.data`` holding every
large initializer when the source kept its weights as external data (``mlflow.onnx``
does so by default, under a random ``<uuid>.data`` name).

I/O naming convention (what Triton, the trial load and the canary see)::

    MLflow signature           ONNX inputs
    -------------------------  ------------------------------------------------------
    column-based, or none      ONE input ``input``: float32 [batch, n_columns], columns
                               in signature order (or golden order without a signature);
                               every column must be numeric (bool counts as 0/1)
    tensor-based               the signature's tensors: name (``input`` when unnamed),
                               dtype and shape kept

    converted model            ONNX outputs (skl2onnx name -> ours)
    -------------------------  ------------------------------------------------------
    sklearn classifier         ``label`` int64 (or string) [batch],
                               ``probabilities`` float32 [batch, n_classes]
    sklearn regressor          ``variable`` -> ``prediction`` float32 [batch, n_targets]
    pytorch (single tensor)    ``prediction`` [batch, ...]
    onnx flavor                the graph's own names, untouched

Parity compares each graph output with its native counterpart on the golden rows: the
pyfunc's prediction goes to ``label`` (classifiers) or ``prediction`` (else the first
output); a sklearn classifier's ``predict_proba`` goes to ``probabilities``; an ONNX
pyfunc returns named outputs. Integer and string outputs must match exactly; float
outputs must satisfy ``|onnx - native| <= atol + rtol * |native|``.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import shutil
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import yaml
from onnx.external_data_helper import load_external_data_for_model, uses_external_data

from modelship.candidate import ExportedModel, ResolvedVersion
from modelship.errors import ExportError, ValidationFailed
from modelship.policy import ExportPolicy
from modelship.triton.model_config import ModelSpec, TensorSpec, numpy_dtype_from_onnx

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "DATA_FILE",
    "MODEL_FILE",
    "SUPPORTED_FLAVORS",
    "export_model",
    "golden_feed",
    "graph_spec",
    "reuse_export",
]

SUPPORTED_FLAVORS = ("onnx", "sklearn", "pytorch")
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
INPUT_NAME = "input"
"""The single graph input of a column-based model."""

# skl2onnx output names -> ours (classifier names are already ours with zipmap off).
_OUTPUT_RENAMES = {
    "variable": "prediction",
    "output_label": "label",
    "output_probability": "probabilities",
}
_NUMERIC_COLUMN_TYPES = {"double", "float", "long", "integer", "boolean"}
# Tensors below this many bytes stay inside model.onnx even when the rest is external.
_EXTERNAL_THRESHOLD_BYTES = 1024
# A converted graph larger than this is written with external data; protobuf stops at 2 GiB.
_SINGLE_FILE_LIMIT_BYTES = 1 << 30
_RELOG_HINT = (
    "re-log the model (mlflow.onnx.log_model) from a graph that onnx.load and "
    "onnx.checker.check_model accept"
)


# --------------------------------------------------------------------------------------
# graph I/O


def graph_spec(model: onnx.ModelProto, *, name: str | None = None) -> ModelSpec:
    """The graph's I/O as Triton sees it: numpy dtypes, dims without the batch dimension.

    Initializers listed as graph inputs (old exporters do that) are weights, not inputs,
    and are skipped. The first dim of every tensor must be the batch dim: symbolic or
    unknown. Other unknown dims become -1.

    Args:
        model: The ONNX model (external data need not be loaded).
        name: The Triton model name; defaults to the graph's name.

    Raises:
        ValidationFailed: a tensor has no batch dimension, no shape or no tensor type, or a
            dtype Triton cannot carry.
    """
    graph = model.graph
    weights = {init.name for init in graph.initializer}
    inputs = tuple(_tensor_spec(v, "input") for v in graph.input if v.name not in weights)
    outputs = tuple(_tensor_spec(v, "output") for v in graph.output)
    return ModelSpec(name=name if name is not None else graph.name, inputs=inputs, outputs=outputs)


def _tensor_spec(value: onnx.ValueInfoProto, role: str) -> TensorSpec:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        raise ValidationFailed(
            f"graph {role} '{value.name}' is a {kind or 'untyped value'}, not a tensor; "
            "Triton carries tensors only",
            hint="export the model so every input and output is a plain tensor "
            "(for skl2onnx classifiers, turn zipmap off)",
            tensor=value.name,
        )
    tensor = value.type.tensor_type
    dtype = numpy_dtype_from_onnx(tensor.elem_type)
    dims: list[int] = []
    if tensor.HasField("shape"):
        for dim in tensor.shape.dim:
            fixed = dim.HasField("dim_value") and dim.dim_value > 0
            dims.append(int(dim.dim_value) if fixed else -1)
    batchless = not tensor.HasField("shape") or not dims or dims[0] != -1
    if batchless:
        shape = "no shape" if not tensor.HasField("shape") else f"shape {dims}"
        raise ValidationFailed(
            f"graph {role} '{value.name}' has {shape}: its first dimension is not a "
            "variable batch dimension",
            hint="export the model with a dynamic batch axis (dim 0 symbolic, e.g. "
            "dynamic_axes={name: {0: 'batch'}} in torch.onnx.export, or None in skl2onnx "
            "initial_types)",
            tensor=value.name,
            dims=dims,
        )
    return TensorSpec(value.name, dtype, tuple(dims[1:]))


# --------------------------------------------------------------------------------------
# golden rows -> tensors


def golden_feed(
    golden: pd.DataFrame, spec: ModelSpec, signature: Mapping[str, Any] | None
) -> dict[str, np.ndarray]:
    """Turn golden rows into the input arrays of onnxruntime and Triton (pure).

    For each graph input: a golden column of the same name is used (a column of lists or
    arrays, the parquet-friendly way to store a tensor per row, is stacked); otherwise a
    model with a single input gets the feature matrix, columns in signature order. Arrays
    are cast to the graph dtype and shaped ``[rows, *dims]``.

    Args:
        golden: One row per request.
        spec: The graph's inputs (dims without the batch dimension).
        signature: The MLflow signature (``{"inputs": ..., "outputs": ...}``), or None.

    Raises:
        ValidationFailed: an input has no column, a feature column is not numeric, or the
            values do not fit the input's shape or dtype.
    """
    rows = len(golden)
    feed: dict[str, np.ndarray] = {}
    for tensor in spec.inputs:
        if tensor.name in golden.columns:
            values = _stack_column(golden[tensor.name])
        elif len(spec.inputs) == 1:
            columns = _feature_columns(golden, signature)
            values = golden[columns].to_numpy()
        else:
            missing = [t.name for t in spec.inputs if t.name not in golden.columns]
            raise ValidationFailed(
                f"golden rows have no column for graph inputs {missing}; a model with "
                f"{len(spec.inputs)} inputs needs one column per input",
                hint="store each input tensor as a golden column named after it (lists or "
                "arrays per row for tensors with dims)",
                missing=missing,
            )
        feed[tensor.name] = _fit(values, tensor, rows)
    return feed


def _signature_part(signature: Mapping[str, Any] | None, part: str) -> list[dict[str, Any]]:
    """The parsed ``inputs``/``outputs`` of a signature (MLflow stores them as JSON text)."""
    if not signature:
        return []
    raw = signature.get(part)
    if raw is None:
        return []
    parsed = json.loads(raw) if isinstance(raw, str) else raw
    return [dict(item) for item in parsed]


def _is_tensor_signature(signature: Mapping[str, Any] | None) -> bool:
    inputs = _signature_part(signature, "inputs")
    return bool(inputs) and all(item.get("type") == "tensor" for item in inputs)


def _feature_columns(golden: pd.DataFrame, signature: Mapping[str, Any] | None) -> list[str]:
    """The columns of the ``input`` matrix, in signature order; all must be numeric."""
    import pandas as pd  # lazy: pandas costs ~0.4 s; tasks.check loads this module without it

    inputs = [] if _is_tensor_signature(signature) else _signature_part(signature, "inputs")
    if inputs:
        columns = [str(item["name"]) for item in inputs]
        bad = [str(i["name"]) for i in inputs if i.get("type") not in _NUMERIC_COLUMN_TYPES]
        missing = [c for c in columns if c not in golden.columns]
        if missing:
            raise ValidationFailed(
                f"golden rows lack signature columns {missing}",
                hint="log golden inputs with every column of the model signature",
                missing=missing,
            )
    else:
        columns = [str(c) for c in golden.columns]
        bad = []
    bad += [
        c
        for c in columns
        if c not in bad
        and not (
            pd.api.types.is_numeric_dtype(golden[c]) or pd.api.types.is_bool_dtype(golden[c])
        )
    ]
    if bad:
        raise ValidationFailed(
            f"input columns {bad} are not numeric; the ONNX graph takes one float32 matrix "
            f"named '{INPUT_NAME}'",
            hint="encode those columns before the model (numeric features only), or log an "
            "ONNX flavor whose graph takes them as separate tensors",
            columns=bad,
        )
    return columns


def _stack_column(column: pd.Series) -> np.ndarray:
    values = column.to_numpy()
    if len(values) and isinstance(values[0], (list, tuple, np.ndarray)):
        try:
            return np.stack([np.asarray(v) for v in values])
        except ValueError as exc:
            raise ValidationFailed(
                f"golden column '{column.name}' holds tensors of different shapes: {exc}",
                hint="give every row of a tensor column the same shape",
                column=str(column.name),
            ) from exc
    return values


def _fit(values: np.ndarray, tensor: TensorSpec, rows: int) -> np.ndarray:
    """Cast to the tensor's dtype and shape ``[rows, *dims]`` (-1 dims take what is there)."""
    try:
        cast = values.astype(np.dtype(tensor.dtype))
    except (TypeError, ValueError) as exc:
        raise ValidationFailed(
            f"golden values for input '{tensor.name}' do not convert to {tensor.dtype}: {exc}",
            hint="make the golden rows match the model signature's types",
            tensor=tensor.name,
        ) from exc
    want = (rows, *tensor.dims)
    if cast.shape == want or _matches(cast.shape, want):
        return cast
    known = math.prod(d for d in tensor.dims if d != -1)
    unknown = sum(1 for d in tensor.dims if d == -1)
    if unknown <= 1 and known and cast.size % (rows * known) == 0:
        return cast.reshape(rows, *tensor.dims)
    raise ValidationFailed(
        f"golden values for input '{tensor.name}' have shape {list(cast.shape)}, the graph "
        f"wants [{rows}, {', '.join(str(d) for d in tensor.dims)}]",
        hint="store the golden rows in the shape of the model signature",
        tensor=tensor.name,
    )


def _matches(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    return len(shape) == len(want) and all(w in (-1, s) for s, w in zip(shape, want, strict=True))


def _signature_input_specs(
    signature: Mapping[str, Any] | None, golden: pd.DataFrame
) -> tuple[TensorSpec, ...]:
    """The graph inputs a converter must build, following the naming convention."""
    if _is_tensor_signature(signature):
        inputs = _signature_part(signature, "inputs")
        specs = []
        for item in inputs:
            tensor = item.get("tensor-spec", {})
            shape = [int(d) for d in tensor.get("shape", [-1])]
            name = str(item.get("name") or INPUT_NAME)
            specs.append(TensorSpec(name, str(tensor.get("dtype", "float32")), tuple(shape[1:])))
        return tuple(specs)
    columns = _feature_columns(golden, signature)
    return (TensorSpec(INPUT_NAME, "float32", (len(columns),)),)


# --------------------------------------------------------------------------------------
# export


def export_model(
    resolved: ResolvedVersion,
    golden: pd.DataFrame,
    policy: ExportPolicy,
    workdir: Path,
    *,
    before_parity: Callable[[ExportedModel], None] | None = None,
) -> ExportedModel:
    """Export, check and parity-test one model version into ``workdir``.

    ``before_parity`` runs on the checked graph before parity is computed, so that a
    contract problem (say, the signature's dims against the graph's) is reported as such
    rather than as golden rows that do not fit the graph.

    Args:
        resolved: The version, with its artifacts downloaded to ``resolved.local_dir``.
        golden: The golden rows; the first ``policy.golden_max_rows`` are used.
        policy: The ``export`` section of the release policy.
        workdir: Where ``model.onnx`` (and ``model.onnx.data``) are written.

    Raises:
        ValidationFailed: unsupported flavor, opset outside the policy window, no batch
            dimension, no golden rows, or a parity failure (``details["parity"]``).
        ExportError: the model cannot be loaded or converted, or the graph is not valid
            ONNX.
    """
    subject = f"{resolved.name}/{resolved.version}"
    if resolved.flavor not in SUPPORTED_FLAVORS:
        raise ValidationFailed(
            f"model {subject} has flavor '{resolved.flavor}' (flavors in MLmodel: "
            f"{', '.join(resolved.flavors) or 'none'}); modelship exports "
            f"{', '.join(SUPPORTED_FLAVORS)}",
            hint="log the model with mlflow.onnx, mlflow.sklearn or mlflow.pytorch, or "
            "convert it to ONNX yourself and log it with mlflow.onnx.log_model",
            flavor=resolved.flavor,
            supported=list(SUPPORTED_FLAVORS),
        )
    rows = golden.head(policy.golden_max_rows).reset_index(drop=True)
    if rows.empty:
        raise ValidationFailed(
            f"no golden rows for {subject}: parity cannot be shown on zero rows",
            hint="log golden inputs (golden/inputs.parquet or an input example) with the run",
        )
    workdir.mkdir(parents=True, exist_ok=True)
    if resolved.flavor == "onnx":
        model, origin, external = _load_onnx_flavor(resolved)
    elif resolved.flavor == "sklearn":
        model, origin, external = _convert_sklearn(resolved, rows, policy), "skl2onnx", False
    else:
        model, origin, external = _convert_pytorch(resolved, rows, policy, workdir), "torch", False
    if resolved.flavor != "onnx":  # a passed-through graph keeps its bytes
        _make_deterministic(model, resolved)
    files = _save(model, workdir, external=external)
    opset, spec = _check(
        files[MODEL_FILE], policy, name=resolved.name, subject=subject, origin=origin
    )
    exported = ExportedModel(files=files, opset=opset, spec=spec)
    if before_parity is not None:
        before_parity(exported)
    parity = _parity(resolved, rows, spec, files[MODEL_FILE], policy)
    return ExportedModel(files=files, opset=opset, spec=spec, parity=parity)


def reuse_export(
    cached: Mapping[str, Path], resolved: ResolvedVersion, policy: ExportPolicy, workdir: Path,
    *, parity: dict[str, Any],
) -> ExportedModel:
    """An earlier export of the same bytes (``cached``: the check cache's verified files)
    as this version's: copied into ``workdir``, a converted graph renamed for this version
    (:func:`_make_deterministic`, the only per-version part of an export), and checked
    again (:func:`_check`: onnx.checker, shape inference, the opset window). ``parity`` is
    the earlier export's report (same artifact, golden rows and tolerances)."""
    workdir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, path in cached.items():
        files[name] = workdir / name
        shutil.copyfile(path, files[name])
    subject = f"{resolved.name}/{resolved.version}"
    if resolved.flavor != "onnx":
        model = onnx.load(str(files[MODEL_FILE]), load_external_data=False)
        if model.graph.name != f"{resolved.name}_v{resolved.version}":
            model = onnx.load(str(files[MODEL_FILE]))
            _make_deterministic(model, resolved)
            files = _save(model, workdir, external=DATA_FILE in files)
    opset, spec = _check(files[MODEL_FILE], policy, name=resolved.name, subject=subject,
                         origin="the check cache's export")
    return ExportedModel(files=files, opset=opset, spec=spec, parity=parity)


def _make_deterministic(model: onnx.ModelProto, resolved: ResolvedVersion) -> None:
    """Give a converted graph a stable name: converters put a random uuid there, and the
    same MLflow version must always export to the same bytes (staging is content-addressed
    and a version folder is immutable)."""
    model.graph.name = f"{resolved.name}_v{resolved.version}"
    model.graph.doc_string = ""
    model.doc_string = ""


def _mlmodel(resolved: ResolvedVersion) -> dict[str, Any]:
    path = resolved.local_dir / "MLmodel"
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ExportError(
            f"cannot read {path}: {exc}",
            hint="download the model version again; its MLmodel file is missing or broken",
            path=str(path),
        ) from exc
    return loaded if isinstance(loaded, dict) else {}


def _load_onnx_flavor(resolved: ResolvedVersion) -> tuple[onnx.ModelProto, str, bool]:
    """The registered graph with its weights, and whether they were stored externally."""
    flavor = _mlmodel(resolved).get("flavors", {}).get("onnx") or {}
    data = flavor.get("data")
    if not data:
        raise ExportError(
            f"the MLmodel file of {resolved.name}/{resolved.version} has no onnx flavor "
            "with a 'data' key",
            hint="log the model with mlflow.onnx.log_model",
        )
    path = resolved.local_dir / str(data)
    try:
        model = onnx.load(str(path), load_external_data=False)
        external = any(uses_external_data(t) for t in model.graph.initializer)
        if external:
            load_external_data_for_model(model, str(path.parent))
    except Exception as exc:  # onnx raises DecodeError, OSError, ValueError, ...
        raise ExportError(
            f"{path}: the file is not a valid ONNX model: {exc}",
            hint=_RELOG_HINT,
            path=str(path),
        ) from exc
    return model, str(path), external


def _final_estimator(model: Any) -> Any:
    """The estimator at the end of (nested) pipelines: where skl2onnx options apply."""
    while hasattr(model, "steps"):
        model = model.steps[-1][1]
    return model


class _RefuseTorch:
    """A meta path finder that refuses ``torch`` (see :func:`import_skops_without_torch`)."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"modelship: {name} is not imported for skops",
                                      name=name)


def import_skops_without_torch() -> None:
    """Import ``skops.io`` (MLflow's sklearn flavor loads ``.skops`` files with it) without
    importing torch (5-20 s here).

    At import, skops lists the types it trusts from ``sklearn.utils.all_estimators()``, which
    walks every sklearn package with ``pkgutil.walk_packages``; the walk imports sklearn's
    array-API shim for torch and so torch itself. No estimator lives there, and
    ``walk_packages`` skips a package that fails to import, so with torch refused during
    that import skops trusts the same types (tests/unit/test_export.py). Nothing is done
    when torch or skops is already imported, or skops is not installed.
    """
    if "torch" in sys.modules or "skops.io" in sys.modules:
        return
    sys.meta_path[:0] = [_RefuseTorch, _QuickWhichmodule]
    try:
        import skops.io  # noqa: F401
    except ImportError:
        pass  # no skops: MLflow says so when a .skops file needs it
    finally:
        sys.meta_path.remove(_RefuseTorch)
        sys.meta_path.remove(_QuickWhichmodule)
        _QuickWhichmodule.restore()


class _QuickWhichmodule:
    """While skops imports: its ``whichmodule`` answered by :func:`quick_whichmodule`.

    At import, skops names the trusted numpy and scipy ufuncs with ``whichmodule``, which
    reads each of ~850 names with ``getattr`` on every loaded module in import order (the
    first module that holds the object names it). A missed ``getattr`` costs microseconds,
    so in a process that has loaded prefect, mlflow and GX (~4,000 modules) that is ~2 s of
    CPU. A meta path finder that finds nothing: asked for ``skops.io._trusted_types``
    (which computes the names), it swaps ``skops.io._utils.whichmodule`` first;
    :meth:`restore` puts skops's own back once the import is over.
    """

    original: Callable[[Any, str], str] | None = None

    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> None:
        if name != "skops.io._trusted_types" or cls.original is not None:
            return
        utils = vars(importlib.import_module("skops.io._utils"))
        cls.original = utils["whichmodule"]
        utils["whichmodule"] = functools.partial(quick_whichmodule, fallback=cls.original)

    @classmethod
    def restore(cls) -> None:
        if cls.original is not None:
            vars(sys.modules["skops.io._utils"])["whichmodule"] = cls.original
            cls.original = None


def quick_whichmodule(obj: Any, name: str, *, fallback: Callable[[Any, str], str]) -> str:
    """What ``fallback`` (skops's ``whichmodule``, a copy of pickle's) answers, found
    sooner: the first loaded module, in import order, that holds ``obj`` as ``name``.

    A plain module without a module ``__getattr__`` holds exactly its ``__dict__`` (no
    ufunc is named like an attribute of the module type), so it is read there; any other
    object in ``sys.modules`` is asked with ``getattr``, as skops does. A dotted name, or
    an object with a ``__module__``, goes to ``fallback`` itself.
    """
    if "." in name or getattr(obj, "__module__", None) is not None:
        return fallback(obj, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # as skops: numpy.core's
        for module_name, module in sys.modules.copy().items():
            if module_name in ("__main__", "__mp_main__") or module is None:
                continue
            if type(module) is types.ModuleType and "__getattr__" not in module.__dict__:
                found = module.__dict__.get(name)
            else:
                try:
                    found = getattr(module, name, None)
                except (AttributeError, ImportError):
                    continue
            if found is obj:
                return module_name
    return "__main__"


def _convert_sklearn(
    resolved: ResolvedVersion, rows: pd.DataFrame, policy: ExportPolicy
) -> onnx.ModelProto:
    import_skops_without_torch()
    # lazy: mlflow, scikit-learn and skl2onnx cost seconds; only an sklearn export needs them
    import mlflow.sklearn
    from skl2onnx import convert_sklearn
    from skl2onnx.common import data_types
    from sklearn.base import is_classifier

    subject = f"{resolved.name}/{resolved.version}"
    inputs = _signature_input_specs(resolved.signature, rows)
    if len(inputs) != 1:
        raise ValidationFailed(
            f"sklearn model {subject} has a signature with {len(inputs)} input tensors; a "
            "sklearn estimator takes one feature matrix",
            hint="log the model with a column-based signature or a single tensor input",
        )
    types = {
        "float32": data_types.FloatTensorType,
        "float64": data_types.DoubleTensorType,
        "int64": data_types.Int64TensorType,
        "int32": data_types.Int32TensorType,
        "bool": data_types.BooleanTensorType,
        "object": data_types.StringTensorType,
    }
    spec = inputs[0]
    if spec.dtype not in types:
        raise ValidationFailed(
            f"sklearn model {subject}: input dtype {spec.dtype} has no skl2onnx type",
            hint="log the model with float32/float64/int32/int64/bool/string inputs",
        )
    shape = [None, *(None if d == -1 else d for d in spec.dims)]
    try:
        estimator = mlflow.sklearn.load_model(str(resolved.local_dir))
    except Exception as exc:
        raise ExportError(
            f"cannot load the sklearn model {subject} from {resolved.local_dir}: {exc}",
            hint="load it with mlflow.sklearn.load_model in the same versions of Python and "
            "scikit-learn to see why; re-log it if it was pickled by other versions",
        ) from exc
    final = _final_estimator(estimator)
    options = {id(final): {"zipmap": False}} if is_classifier(final) else None
    try:
        model = convert_sklearn(
            estimator,
            initial_types=[(spec.name, types[spec.dtype](shape))],
            options=options,
            target_opset=policy.target_opset,
        )
    except Exception as exc:  # skl2onnx raises RuntimeError, MissingShapeCalculator, ...
        raise ExportError(
            f"skl2onnx cannot convert {type(estimator).__name__} of {subject}: {exc}",
            hint="use estimators skl2onnx supports, or convert the model yourself and log it "
            "with mlflow.onnx.log_model",
        ) from exc
    _rename_outputs(model, _OUTPUT_RENAMES)
    return model


def _rename_outputs(model: onnx.ModelProto, renames: Mapping[str, str]) -> None:
    """Rename graph outputs (and every reference to them) in place."""
    graph = model.graph
    taken = {v.name for v in graph.output} | {v.name for v in graph.input}
    wanted = {
        out.name: renames[out.name]
        for out in graph.output
        if out.name in renames and renames[out.name] not in taken
    }
    if not wanted:
        return
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name in wanted:
                node.output[i] = wanted[name]
        for i, name in enumerate(node.input):
            if name in wanted:
                node.input[i] = wanted[name]
    for out in graph.output:
        out.name = wanted.get(out.name, out.name)


def _convert_pytorch(
    resolved: ResolvedVersion, rows: pd.DataFrame, policy: ExportPolicy, workdir: Path
) -> onnx.ModelProto:
    subject = f"{resolved.name}/{resolved.version}"
    try:
        import torch  # lazy: torch is optional (the pytorch extra) and costs 5-20 s
    except ImportError as exc:
        raise ExportError(
            f"model {subject} has the pytorch flavor, and torch is not installed",
            hint="pip install torch (modelship's optional pytorch extra)",
        ) from exc
    import mlflow.pytorch  # lazy: mlflow costs seconds; only a pytorch export needs it

    inputs = _signature_input_specs(resolved.signature, rows)
    if len(inputs) != 1:
        raise ValidationFailed(
            f"pytorch model {subject} has {len(inputs)} input tensors; MLflow's pytorch "
            "pyfunc passes one tensor to forward()",
            hint="log a model whose forward() takes one tensor",
        )
    spec = ModelSpec(name=resolved.name, inputs=inputs)
    example = golden_feed(rows, spec, resolved.signature)[inputs[0].name]
    try:
        module = mlflow.pytorch.load_model(str(resolved.local_dir), map_location="cpu")
    except Exception as exc:
        raise ExportError(
            f"cannot load the pytorch model {subject} from {resolved.local_dir}: {exc}",
            hint="load it with mlflow.pytorch.load_model to see why; re-log it with this "
            "torch version if it was saved by another",
        ) from exc
    module = _inference_module(torch, module)
    scratch = workdir / ".torch-export.onnx"
    name = inputs[0].name
    try:
        with warnings.catch_warnings():
            # Tracing warns about Python bools taken from tensors (pt2 guards do that); the
            # parity check, not the tracer's warnings, decides whether the graph is right.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter
            torch.onnx.export(
            module,
                (torch.from_numpy(example),),
                str(scratch),
                input_names=[name],
                output_names=["prediction"],
                dynamic_axes={name: {0: "batch"}, "prediction": {0: "batch"}},
                opset_version=policy.target_opset,
                dynamo=False,  # the dynamo exporter needs onnxscript, not a dependency
            )
        model = onnx.load(str(scratch))
    except Exception as exc:
        raise ExportError(
            f"torch.onnx.export failed for {subject}: {exc}",
            hint="make forward() traceable with one tensor in and one tensor out, or export "
            "the model yourself and log it with mlflow.onnx.log_model",
        ) from exc
    finally:
        for leftover in workdir.glob(".torch-export.onnx*"):
            leftover.unlink()
    return model


def _inference_module(torch: Any, module: Any) -> Any:
    """A module in inference mode that the TorchScript exporter can trace.

    MLflow 3 saves PyTorch models as ``pt2`` by default, which loads as the module of an
    ExportedProgram: it refuses ``train()``/``eval()`` and its parameters would be traced as
    constants that require grad. Such a module is frozen and wrapped without registering it
    as a child, so the exporter's mode switch does not reach it.
    """
    try:
        return module.eval()
    except NotImplementedError:
        pass
    for parameter in module.parameters():
        parameter.requires_grad_(False)

    class _Frozen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            object.__setattr__(self, "inner", module)

        def forward(self, *args: Any) -> Any:
            return self.inner(*args)

    return _Frozen()


def _save(model: onnx.ModelProto, workdir: Path, *, external: bool) -> dict[str, Path]:
    """Write the version folder's files: ``model.onnx`` and maybe ``model.onnx.data``."""
    model_path = workdir / MODEL_FILE
    data_path = workdir / DATA_FILE
    for stale in (model_path, data_path):  # onnx appends to an existing data file
        stale.unlink(missing_ok=True)
    external = external or model.ByteSize() > _SINGLE_FILE_LIMIT_BYTES
    onnx.save_model(
        model,
        str(model_path),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=DATA_FILE,
        size_threshold=_EXTERNAL_THRESHOLD_BYTES,
    )
    files = {MODEL_FILE: model_path}
    if data_path.exists():
        files[DATA_FILE] = data_path
    return files


def _check(
    path: Path, policy: ExportPolicy, *, name: str, subject: str, origin: str
) -> tuple[int, ModelSpec]:
    """onnx.checker, strict shape inference, the opset window and the graph's I/O."""
    try:
        onnx.checker.check_model(str(path))
        size = sum(p.stat().st_size for p in path.parent.glob(f"{MODEL_FILE}*"))
        if size < _SINGLE_FILE_LIMIT_BYTES:
            inferred = onnx.shape_inference.infer_shapes(
                onnx.load(str(path)), check_type=True, strict_mode=True
            )
        else:
            inferred_path = path.with_name(".inferred.onnx")
            onnx.shape_inference.infer_shapes_path(
                str(path), str(inferred_path), check_type=True, strict_mode=True
            )
            inferred = onnx.load(str(inferred_path), load_external_data=False)
            inferred_path.unlink()
    except Exception as exc:  # ValidationError, InferenceError, OSError, DecodeError
        raise ExportError(
            f"{origin} ({subject}): the file is not a valid ONNX model: {exc}",
            hint=_RELOG_HINT,
            path=origin,
        ) from exc
    opsets = [o.version for o in inferred.opset_import if o.domain in ("", "ai.onnx")]
    if not opsets:
        raise ExportError(
            f"{origin} ({subject}) imports no default-domain opset",
            hint=_RELOG_HINT,
        )
    opset = int(opsets[0])
    if opset > policy.max_opset:
        raise ValidationFailed(
            f"ONNX opset {opset} of {subject} is above the policy's max_opset "
            f"{policy.max_opset}",
            hint=f"re-export with target_opset {policy.target_opset}, or raise "
            f"export.max_opset in the policy if the serving runtime supports opset {opset}",
            opset=opset,
            max_opset=policy.max_opset,
        )
    if policy.min_opset is not None and opset < policy.min_opset:
        raise ValidationFailed(
            f"ONNX opset {opset} of {subject} is below the policy's min_opset "
            f"{policy.min_opset}",
            hint=f"re-export with target_opset {policy.target_opset}, or lower "
            "export.min_opset in the policy",
            opset=opset,
            min_opset=policy.min_opset,
        )
    return opset, graph_spec(inferred, name=name)


# --------------------------------------------------------------------------------------
# parity


def _parity(
    resolved: ResolvedVersion,
    rows: pd.DataFrame,
    spec: ModelSpec,
    path: Path,
    policy: ExportPolicy,
) -> dict[str, Any]:
    """Compare onnxruntime with the native model on the golden rows; raise on a mismatch."""
    subject = f"{resolved.name}/{resolved.version}"
    feed = golden_feed(rows, spec, resolved.signature)
    got = _run_onnx(path, feed, subject)
    native, ties = _native_outputs(resolved, rows, feed, list(got))
    atol, rtol = policy.parity.atol, policy.parity.rtol
    outputs: dict[str, dict[str, Any]] = {}
    for name, expected in native.items():
        if name not in got:
            raise ValidationFailed(
                f"parity of {subject}: the native model returns '{name}', which the ONNX "
                f"graph does not output (graph outputs: {sorted(got)})",
                hint="the ONNX graph does not compute the same function as the registered "
                "model: check the export, or register the right ONNX file",
                output=name,
            )
        outputs[name] = _compare(name, expected, got[name], atol, rtol, ties, subject)
    for name in got:
        outputs.setdefault(name, {"compared": False, "reason": "no native counterpart"})
    compared = [o for o in outputs.values() if o.get("compared")]
    if not compared:  # a parity check that compared nothing has not passed
        raise ValidationFailed(
            f"parity of {subject}: no output of the ONNX graph ({sorted(got)}) could be "
            f"compared with the native model's ({sorted(native)})",
            hint="the native model returned nothing comparable on the golden rows: check "
            "that its pyfunc predicts them, and that its outputs are named like the graph's",
            outputs=sorted(got))
    report = {
        "rows": len(rows),
        "atol": atol,
        "rtol": rtol,
        "passed": all(o["passed"] is True for o in compared),
        "outputs": outputs,
    }
    for name, result in outputs.items():
        if result.get("compared") and not result["passed"]:
            raise ValidationFailed(
                _parity_message(subject, name, result, atol, rtol),
                hint="the ONNX graph does not compute the same function as the registered "
                "model: check the export, or register the right ONNX file",
                output=name,
                parity=report,
            )
    return report


def _run_onnx(path: Path, feed: Mapping[str, np.ndarray], subject: str) -> dict[str, np.ndarray]:
    import onnxruntime as ort  # lazy: onnxruntime (~0.1 s) only for the parity run

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        values = session.run(names, dict(feed))
    except Exception as exc:  # onnxruntime's Fail, InvalidGraph, InvalidArgument, ...
        raise ExportError(
            f"onnxruntime cannot run the exported graph of {subject} on the golden rows: {exc}",
            hint="check that the graph's inputs match the model signature and that its "
            "operators are supported by onnxruntime",
        ) from exc
    return {name: np.asarray(value) for name, value in zip(names, values, strict=True)}


def _native_outputs(
    resolved: ResolvedVersion,
    rows: pd.DataFrame,
    feed: Mapping[str, np.ndarray],
    graph_outputs: Sequence[str],
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The registered model's answers, keyed by the graph output they correspond to.

    Returns the outputs and, for classifiers, a mask of rows whose top two native
    probabilities are tied within tolerance (a label flip there is float rounding).
    """
    # lazy: mlflow and pandas cost seconds; only the parity run loads the native model
    import mlflow.pyfunc
    import pandas as pd

    subject = f"{resolved.name}/{resolved.version}"
    try:
        pyfunc = mlflow.pyfunc.load_model(str(resolved.local_dir))
        if pyfunc.loader_module == "mlflow.onnx":
            # MLflow's ONNX pyfunc flattens every output to 1-D when given a DataFrame, and
            # its schema check rejects a feed dict under a column-based signature; the
            # wrapper behind it takes the feed dict as documented.
            prediction: Any = pyfunc._model_impl.predict(dict(feed))
        else:
            with warnings.catch_warnings():
                # MLflow's pytorch pyfunc wraps a read-only array (pandas copy-on-write);
                # torch warns although the model only reads it.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                prediction = pyfunc.predict(_pyfunc_input(rows, feed, resolved.signature))
    except Exception as exc:
        raise ExportError(
            f"the native MLflow pyfunc of {subject} failed on the golden rows: {exc}",
            hint="run mlflow.pyfunc.load_model(...).predict on the golden rows to see why; "
            "the golden rows must match the model signature",
        ) from exc
    native: dict[str, np.ndarray] = {}
    if isinstance(prediction, dict):
        native = {str(k): np.asarray(v) for k, v in prediction.items()}
    elif isinstance(prediction, pd.DataFrame) and set(map(str, prediction.columns)) <= set(
        graph_outputs
    ):
        native = {str(c): prediction[c].to_numpy() for c in prediction.columns}
    else:
        values = prediction.to_numpy() if hasattr(prediction, "to_numpy") else prediction
        native[_single_output_name(graph_outputs)] = np.asarray(values)
    ties = None
    flavors = _mlmodel(resolved).get("flavors", {})
    if "sklearn" in flavors and "probabilities" in graph_outputs and "probabilities" not in native:
        proba = _sklearn_proba(resolved, rows, feed, subject)
        if proba is not None:
            native["probabilities"] = proba
            ties = proba
    return native, ties


def _single_output_name(graph_outputs: Sequence[str]) -> str:
    for preferred in ("label", "prediction"):
        if preferred in graph_outputs:
            return preferred
    return graph_outputs[0]


def _pyfunc_input(
    rows: pd.DataFrame, feed: Mapping[str, np.ndarray], signature: Mapping[str, Any] | None
) -> Any:
    """What a client would send the pyfunc: the rows, or the tensors of a tensor signature."""
    if not _is_tensor_signature(signature):
        return rows
    if len(feed) == 1:
        return next(iter(feed.values()))
    return dict(feed)


def _sklearn_proba(
    resolved: ResolvedVersion,
    rows: pd.DataFrame,
    feed: Mapping[str, np.ndarray],
    subject: str,
) -> np.ndarray | None:
    import mlflow.sklearn  # lazy: mlflow and scikit-learn cost seconds; only the parity run

    try:
        estimator = mlflow.sklearn.load_model(str(resolved.local_dir))
        if not hasattr(estimator, "predict_proba"):
            return None
        features = _pyfunc_input(rows, feed, resolved.signature)
        if not hasattr(estimator, "feature_names_in_") and hasattr(features, "to_numpy"):
            features = features.to_numpy()  # fitted on arrays: avoid sklearn's name warning
        elif hasattr(features, "columns"):
            features = features[list(estimator.feature_names_in_)]
        return np.asarray(estimator.predict_proba(features))
    except Exception as exc:
        raise ExportError(
            f"predict_proba of the native sklearn model {subject} failed: {exc}",
            hint="run mlflow.sklearn.load_model(...).predict_proba on the golden rows",
        ) from exc


def _compare(
    name: str,
    expected: np.ndarray,
    got: np.ndarray,
    atol: float,
    rtol: float,
    ties: np.ndarray | None,
    subject: str,
) -> dict[str, Any]:
    rows = expected.shape[0] if expected.ndim else 1
    if expected.size != got.size:
        raise ValidationFailed(
            f"parity of {subject}: output '{name}' has shape {list(got.shape)} in ONNX and "
            f"{list(expected.shape)} natively",
            hint="the ONNX graph does not compute the same function as the registered model: "
            "check the export, or register the right ONNX file",
            output=name,
        )
    ref = expected.reshape(rows, -1)
    out = got.reshape(rows, -1)
    floating = np.issubdtype(ref.dtype, np.floating) or np.issubdtype(out.dtype, np.floating)
    if floating:
        return _compare_close(ref.astype(np.float64), out.astype(np.float64), atol, rtol)
    return _compare_exact(ref, out, atol, rtol, ties)


def _compare_close(
    ref: np.ndarray, out: np.ndarray, atol: float, rtol: float
) -> dict[str, Any]:
    """|out - ref| <= atol + rtol * |ref| element-wise; NaN matches only NaN."""
    with np.errstate(invalid="ignore"):
        diff = np.abs(out - ref)
    both_nan = np.isnan(ref) & np.isnan(out)
    diff = np.where(both_nan, 0.0, np.where(np.isnan(diff), np.inf, diff))
    allowed = atol + rtol * np.abs(np.nan_to_num(ref))
    excess = diff - allowed
    row, col = np.unravel_index(int(np.argmax(excess)), excess.shape)
    rel = diff / np.maximum(np.abs(np.nan_to_num(ref)), np.finfo(np.float64).tiny)
    return {
        "compared": True,
        "kind": "close",
        "passed": bool(np.all(excess <= 0)),
        "max_abs_err": float(np.max(diff)),
        "max_rel_err": float(np.max(rel)),
        "worst": {"row": int(row), "col": int(col)},
        "native": float(ref[row, col]),
        "onnx": float(out[row, col]),
        "atol": atol,
        "rtol": rtol,
    }


def _compare_exact(
    ref: np.ndarray, out: np.ndarray, atol: float, rtol: float, proba: np.ndarray | None
) -> dict[str, Any]:
    """Labels must match; a flip on a row whose top two probabilities tie is excused."""
    same_kind = ref.dtype.kind == out.dtype.kind
    differs = (ref != out) if same_kind else (ref.astype(str) != out.astype(str))
    bad_rows = differs.any(axis=1)
    excused = np.zeros_like(bad_rows)
    if proba is not None and proba.ndim == 2 and proba.shape[1] >= 2:
        top = np.sort(proba, axis=1)[:, -2:]
        excused = bad_rows & (top[:, 1] - top[:, 0] <= atol + rtol * np.abs(top[:, 1]))
    failing = bad_rows & ~excused
    worst = int(np.argmax(failing)) if failing.any() else int(np.argmax(bad_rows))
    col = int(np.argmax(differs[worst]))
    rows = ref.shape[0]
    return {
        "compared": True,
        "kind": "exact",
        "passed": not bool(failing.any()),
        "mismatches": int(bad_rows.sum()),
        "excused_ties": int(excused.sum()),
        "mismatch_rate": float(bad_rows.sum() / rows) if rows else 0.0,
        "max_abs_err": _max_abs(ref, out),
        "max_rel_err": None,
        "worst": {"row": worst, "col": col},
        "native": _scalar(ref[worst, col]),
        "onnx": _scalar(out[worst, col]),
        "atol": atol,
        "rtol": rtol,
    }


def _max_abs(ref: np.ndarray, out: np.ndarray) -> float | None:
    if np.issubdtype(ref.dtype, np.number) and np.issubdtype(out.dtype, np.number):
        return float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64))))
    return None


def _scalar(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value.item() if isinstance(value, np.generic) else value


def _parity_message(
    subject: str, name: str, result: Mapping[str, Any], atol: float, rtol: float
) -> str:
    where = f"row {result['worst']['row']}, col {result['worst']['col']}"
    if result["kind"] == "exact":
        return (
            f"parity failed for output '{name}' of {subject}: {result['mismatches']} of the "
            f"golden rows differ ({result['mismatch_rate']:.2%}); worst element ({where}): "
            f"native {result['native']!r} vs onnx {result['onnx']!r} (labels must match "
            "exactly)"
        )
    return (
        f"parity failed for output '{name}' of {subject}: worst element ({where}): native "
        f"{result['native']:.6g} vs onnx {result['onnx']:.6g}, |diff| "
        f"{abs(result['native'] - result['onnx']):.3g} exceeds atol {atol:g} + rtol {rtol:g} "
        "* |native|"
    )
