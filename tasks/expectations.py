"""Great Expectations suites on the golden inputs and on the model's outputs (validate stage).

Two suites guard a release before anything is staged:

- ``golden_inputs`` (:func:`check_inputs`): the rows every later check replays must match the
  MLflow column signature (types), and the policy's ``validation.inputs`` (nulls, per-column
  ranges). A zero-row table fails: no data is never a pass.
- ``model_outputs`` (:func:`check_outputs`): what the candidate answers on those rows must be
  finite, probabilities must be probabilities, and one class must not swallow the golden set
  (``validation.max_class_share``).

Every check is a real GX expectation, so the Data Docs show all of them; each carries
``meta["modelship"]`` with the sentence it guards and the policy key that tunes it, which is
how a failure is turned into a message that says what to change.

Decisions, and why:

- **Probability outputs** under ``probabilities: auto`` are float outputs whose name contains
  ``prob`` (any case) with 1 or 2 dimensions, as the policy documents. Detecting them by
  "rows sum to ~1" would be circular: an output that breaks the rule would not be checked.
  Every probability value must lie in [0, 1] within ``sum_tolerance`` (float32 rounding:
  a random forest exported to ONNX answers -3.6e-07); rows must sum to 1 (within
  ``sum_tolerance``) only when the output has two or more columns, since a single column is
  the positive-class probability of a binary model.
- **Wide outputs** (more than 16 values per row) are checked through per-row summary columns
  (``NAME.row_min``, ``NAME.row_max``): GX costs ~7 ms per expectation, and 1000 classes times
  three expectations would take 20 s. Narrower outputs get one column per value
  (``NAME[j]``), so a failure names the exact class.
- **The class mix** comes from an integer, boolean or string label output (a name with
  ``label`` or ``class`` first), else from the argmax of the first probability output. Each
  row carries the share of rows predicted as its class (``SOURCE.class_share``), and the
  column's maximum must not exceed ``max_class_share``. A policy that sets the bound for a
  model without such an output fails rather than being silently ignored.
- **Types**: numeric signature types (double, float, long, integer) accept any numeric dtype,
  since pandas turns an int column with a null into float64. GX 1.24 cannot match pandas 3's
  ``str`` dtype by name, so string columns are handed to GX as ``object`` columns, which GX
  checks value by value (a stray ``"x"`` in a numeric column is then named as such).
- **Tensor signatures** (no named columns): row count and not-null on whatever columns the
  DataFrame has. Policy columns apply wherever they exist; a policy column that the inputs
  lack fails, because a misspelt column name must not switch a range check off.
- **One GX context per process** (an ephemeral one, made on first use): every validation
  of the process goes through it, and the Data Docs site points at the output directory of
  the validation at hand, so ``OUT/data_docs/index.html`` lists the suites validated so far
  (both suites of a check). Building Data Docs costs ~0.3-0.5 s per validation;
  ``docs=False`` skips it (the promote flow does: its check folder is removed after the
  stage, so nobody could read them).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from modelship.errors import ValidationFailed
from modelship.jsonable import jsonable
from modelship.policy import ValidationPolicy

__all__ = [
    "DOCS_SITE",
    "DataCheckResult",
    "check_inputs",
    "check_outputs",
    "raise_for_failures",
]

DOCS_SITE = "modelship_site"
"""The Data Docs site modelship adds (``local_site`` already exists in every GX context)."""

INPUTS_SUITE = "golden_inputs"
OUTPUTS_SUITE = "model_outputs"

_WIDE = 16
"""Outputs with more values per row than this are checked through row summaries."""

_MAX_FLOAT = float(np.finfo(np.float64).max)
_EXAMPLES = 5
"""How many unexpected values a failure message quotes."""

_NUMERIC = (
    "int", "float",  # Python values in object columns, checked one by one
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "Int8Dtype", "Int16Dtype", "Int32Dtype", "Int64Dtype",
    "UInt8Dtype", "UInt16Dtype", "UInt32Dtype", "UInt64Dtype",
    "Float32Dtype", "Float64Dtype",
)  # fmt: skip
_SIGNATURE_TYPES: dict[str, tuple[str, ...]] = {
    "double": _NUMERIC,
    "float": _NUMERIC,
    "long": _NUMERIC,
    "integer": _NUMERIC,
    "boolean": ("bool", "BooleanDtype"),
    "string": ("str", "StringDtype"),
    "binary": ("bytes",),
    "datetime": ("datetime64[ns]", "datetime64[us]", "datetime64[ms]", "datetime64[s]"),
}
"""MLflow ColSpec types -> GX type names. Other types (array, object, map) get no type check."""

_SOURCE = "modelship"
_context_of_process: list[Any] = []  # the one GX context, once made
_lock = threading.Lock()  # GX contexts are not thread-safe; validations are short.


@dataclass(frozen=True)
class DataCheckResult:
    """The outcome of one GX suite.

    Attributes:
        suite: The suite name (``golden_inputs`` or ``model_outputs``).
        success: True when every expectation passed.
        failures: One dict per failed expectation: ``expectation`` (GX type), ``column``,
            ``observed`` (JSON-ready), ``message`` (a sentence) and ``policy_key`` (the
            ``validation.*`` key that tunes the check, or None when it is not tunable).
        result_path: The GX validation result, saved as JSON.
        docs_path: The Data Docs ``index.html``, or None when docs were not built.
        evaluated: How many expectations ran.
    """

    suite: str
    success: bool
    failures: list[dict[str, Any]]
    result_path: Path
    docs_path: Path | None
    evaluated: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description for the release record and ``--json`` output."""
        return {
            "suite": self.suite,
            "success": self.success,
            "failures": self.failures,
            "result_path": str(self.result_path),
            "docs_path": str(self.docs_path) if self.docs_path else None,
            "evaluated": self.evaluated,
        }


@dataclass(frozen=True)
class _Expect:
    """One planned expectation, as plain data, so the plan needs no GX import."""

    kind: str
    """The class name in ``great_expectations.expectations``."""
    column: str | None
    about: str
    """What it guards, in words, used in failure messages."""
    policy_key: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------
# public API


def check_inputs(
    golden: pd.DataFrame,
    policy: ValidationPolicy,
    *,
    signature_columns: Sequence[Mapping[str, Any]] | None,
    out_dir: Path,
    docs: bool = True,
) -> DataCheckResult:
    """Run the ``golden_inputs`` suite: the signature's types, the policy's nulls and ranges.

    Args:
        golden: The golden input rows.
        policy: The ``validation`` section of the release policy.
        signature_columns: MLflow's column signature (``[{"name", "type", "required"}]``,
            as in the MLmodel JSON), or None for a tensor signature.
        out_dir: Where the result JSON and ``data_docs/`` go (created if missing).
        docs: Build the Data Docs site (~0.3-0.5 s).
    """
    columns = [str(c) for c in golden.columns]
    plan = _input_plan(columns, policy, _named_columns(signature_columns))
    return _run(INPUTS_SUITE, _gx_frame(golden), plan, out_dir, docs)


def check_outputs(
    outputs: Mapping[str, np.ndarray],
    policy: ValidationPolicy,
    *,
    out_dir: Path,
    docs: bool = True,
) -> DataCheckResult:
    """Run the ``model_outputs`` suite on the model's answers to the golden inputs.

    No NaN or ±inf in any float output; probabilities in [0, 1] with rows summing to 1; and
    the most frequent predicted class within ``policy.max_class_share`` when it is set.

    Raises:
        ValidationFailed: there are no outputs, an output has no batch dimension, or the
            outputs disagree on the number of rows (no table can be built from them).
    """
    frame, plan = _output_plan(outputs, policy)
    return _run(OUTPUTS_SUITE, frame, plan, out_dir, docs)


def raise_for_failures(result: DataCheckResult, what: str) -> None:
    """Raise :class:`ValidationFailed` naming every failed expectation of ``result``.

    Args:
        result: A suite outcome from :func:`check_inputs` or :func:`check_outputs`.
        what: What was checked, for the message, e.g. ``"fraud/7 golden inputs"``.
    """
    if result.success:
        return
    failures = result.failures
    problems = "; ".join(f["message"] for f in failures) or "the suite failed"
    keys = list(dict.fromkeys(f["policy_key"] for f in failures if f["policy_key"]))
    if result.suite == INPUTS_SUITE:
        hint, right = "fix the golden inputs (or the model signature)", "the data is"
    else:
        hint, right = "fix the model (or its export)", "these outputs are"
    if keys:
        hint += (
            f"; if {right} right, adjust "
            + ", ".join(f"`{k}`" for k in keys)
            + " in the release policy"
        )
    hint += f"; details in {result.result_path}"
    if result.docs_path:
        hint += f" and {result.docs_path}"
    count = len(failures)
    raise ValidationFailed(
        f"{what}: {count} data check{'s' if count != 1 else ''} failed: {problems}",
        hint=hint,
        suite=result.suite,
        failures=failures,
        result_path=str(result.result_path),
        docs_path=str(result.docs_path) if result.docs_path else None,
    )


# --------------------------------------------------------------------------------------
# planning (pure)


def _named_columns(
    signature_columns: Sequence[Mapping[str, Any]] | None,
) -> list[Mapping[str, Any]] | None:
    """The column specs of a column signature, or None for a tensor (or missing) one."""
    if not signature_columns:
        return None
    if any(not spec.get("name") or spec.get("type") == "tensor" for spec in signature_columns):
        return None
    return list(signature_columns)


def _input_plan(
    columns: list[str],
    policy: ValidationPolicy,
    signature: list[Mapping[str, Any]] | None,
) -> list[_Expect]:
    """The expectations of the ``golden_inputs`` suite for a table with ``columns``."""
    plan = [
        _Expect(
            "ExpectTableRowCountToBeBetween", None,
            "the golden inputs have at least 1 row", None, {"min_value": 1},
        )
    ]  # fmt: skip
    present = set(columns)
    inputs = policy.inputs
    # column -> (nullable by signature, MLflow type or None)
    checked: dict[str, tuple[bool, str | None]] = {}
    if signature is None:
        checked = {c: (False, None) for c in columns}
    else:
        for spec in signature:
            name, required = str(spec["name"]), bool(spec.get("required", True))
            if name not in present:
                if required:
                    plan.append(_Expect(
                        "ExpectColumnToExist", name,
                        f"signature column '{name}' is present in the golden inputs", None,
                    ))  # fmt: skip
                continue
            checked[name] = (not required, str(spec.get("type", "")).lower() or None)
    for name in inputs.columns:
        if name not in present:
            plan.append(_Expect(
                "ExpectColumnToExist", name,
                f"policy column '{name}' is present in the golden inputs",
                f"validation.inputs.columns.{name}",
            ))  # fmt: skip
        elif name not in checked:
            checked[name] = (False, None)

    for name, (optional, mlflow_type) in checked.items():
        rule = inputs.columns.get(name)
        key = f"validation.inputs.columns.{name}"
        if mlflow_type in _SIGNATURE_TYPES:
            plan.append(_Expect(
                "ExpectColumnValuesToBeInTypeList", name,
                f"column '{name}' holds {mlflow_type} values (MLflow signature)", None,
                {"type_list": list(_SIGNATURE_TYPES[mlflow_type])},
            ))  # fmt: skip
        not_null = rule.not_null if rule and rule.not_null is not None else None
        if not_null is None:
            not_null = inputs.not_null and not optional
            null_key = "validation.inputs.not_null"
        else:
            null_key = f"{key}.not_null"
        if not_null:
            plan.append(_Expect(
                "ExpectColumnValuesToNotBeNull", name,
                f"column '{name}' has no null or NaN values", null_key,
            ))  # fmt: skip
        if rule and (rule.min is not None or rule.max is not None):
            # The key named in a failure is the bound that was broken (see _failure).
            bounds = {"min_value": rule.min, "max_value": rule.max}
            plan.append(_Expect(
                "ExpectColumnValuesToBeBetween", name,
                f"column '{name}' lies in {_interval(rule.min, rule.max)}",
                key, {k: v for k, v in bounds.items() if v is not None},
            ))  # fmt: skip
    return plan


def _output_columns(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """One column per value of a narrow output, or row summaries of a wide one."""
    rows = array.reshape(array.shape[0], -1)
    width = rows.shape[1]
    if width == 1:
        return {name: rows[:, 0]}
    if width <= _WIDE:
        return {f"{name}[{j}]": rows[:, j] for j in range(width)}
    if rows.dtype.kind != "f":
        return {}
    with np.errstate(invalid="ignore"):
        # min/max propagate NaN, so a NaN anywhere in a row shows up in both summaries.
        return {f"{name}.row_min": rows.min(axis=1), f"{name}.row_max": rows.max(axis=1)}


def _probability_outputs(
    outputs: Mapping[str, np.ndarray], setting: str | list[str]
) -> tuple[list[str], list[str]]:
    """The probability outputs to check, and the names the policy lists but the model lacks."""
    if setting == "auto":
        found = [
            name for name, arr in outputs.items()
            if arr.dtype.kind == "f" and arr.ndim in (1, 2) and "prob" in name.lower()
        ]  # fmt: skip
        return found, []
    return [n for n in setting if n in outputs], [n for n in setting if n not in outputs]


def _class_source(
    outputs: Mapping[str, np.ndarray], probabilities: list[str]
) -> tuple[str, np.ndarray] | None:
    """Where the predicted class of each row comes from: a label output, else an argmax."""
    labels = [
        name for name, arr in outputs.items()
        if arr.dtype.kind in "iubOSU" and arr.reshape(arr.shape[0], -1).shape[1] == 1
    ]  # fmt: skip
    labels.sort(key=lambda n: not any(word in n.lower() for word in ("label", "class")))
    if labels:
        return labels[0], outputs[labels[0]].reshape(-1)
    for name in probabilities:
        arr = outputs[name]
        if arr.ndim == 2 and arr.shape[1] >= 2 and arr.dtype.kind == "f":
            return f"argmax({name})", np.nan_to_num(arr, nan=-np.inf).argmax(axis=1)
    return None


def _output_plan(
    outputs: Mapping[str, np.ndarray], policy: ValidationPolicy
) -> tuple[pd.DataFrame, list[_Expect]]:
    """The table GX validates (one row per golden input) and the ``model_outputs`` suite."""
    arrays = _output_arrays(outputs)
    checks = policy.outputs
    probabilities, missing = _probability_outputs(arrays, checks.probabilities)
    data: dict[str, np.ndarray] = {}
    plan = [
        _Expect(
            "ExpectTableRowCountToBeBetween", None,
            "the model answered at least 1 row", None, {"min_value": 1},
        )
    ]  # fmt: skip
    for name in missing:
        plan.append(_Expect(
            "ExpectColumnToExist", name,
            f"probability output '{name}' (listed in the policy) exists",
            "validation.outputs.probabilities",
        ))  # fmt: skip
    for name, arr in arrays.items():
        plan += _output_expectations(name, arr, name in probabilities, checks.sum_tolerance,
                                     data)
    if policy.max_class_share is not None:
        plan.append(_class_share_expectation(arrays, probabilities, policy.max_class_share,
                                             data))
    return pd.DataFrame(data), plan


def _output_arrays(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs as arrays with one row per golden input, or :class:`ValidationFailed`."""
    arrays = {str(name): np.asarray(arr) for name, arr in outputs.items()}
    if not arrays:
        raise ValidationFailed(
            "the model returned no outputs for the golden inputs",
            hint="check the model's output names against its signature and the export",
        )
    scalars = [name for name, arr in arrays.items() if arr.ndim == 0]
    if scalars:
        raise ValidationFailed(
            f"output(s) {', '.join(scalars)} have no batch dimension",
            hint="export the model so that every output has one row per input row",
            outputs=scalars,
        )
    counts = {name: arr.shape[0] for name, arr in arrays.items()}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{name} {n}" for name, n in counts.items())
        raise ValidationFailed(
            f"the outputs disagree on the number of rows: {shown}",
            hint="every output must have one row per golden input row; check the export",
            rows=counts,
        )
    return arrays


def _output_expectations(name: str, arr: np.ndarray, probability: bool, tol: float,
                         data: dict[str, np.ndarray]) -> list[_Expect]:
    """One output's columns (added to ``data``) and their expectations: no nulls, finite
    or (``probability``) within [0, 1] ± ``tol``, and rows summing to 1 ± ``tol``."""
    plan: list[_Expect] = []
    columns = _output_columns(name, arr)
    data.update(columns)
    is_float = arr.dtype.kind == "f"
    for column in columns:
        plan.append(_Expect(
            "ExpectColumnValuesToNotBeNull", column,
            f"output column '{column}' has no NaN or null values", None,
        ))  # fmt: skip
        if not is_float:
            continue
        if probability:
            slack = tol  # float rounding, as for the row sums
            plan.append(_Expect(
                "ExpectColumnValuesToBeBetween", column,
                f"probability column '{column}' lies in [0, 1] ± {slack:g}",
                "validation.outputs.probabilities",
                {"min_value": -slack, "max_value": 1.0 + slack},
            ))  # fmt: skip
        else:
            plan.append(_Expect(
                "ExpectColumnValuesToBeBetween", column,
                f"output column '{column}' is finite (no ±inf)", None,
                {"min_value": -_MAX_FLOAT, "max_value": _MAX_FLOAT},
            ))  # fmt: skip
    rows = arr.reshape(arr.shape[0], -1)
    if probability and rows.shape[1] >= 2:
        column = f"{name}.row_sum"
        data[column] = rows.astype(np.float64).sum(axis=1)
        plan.append(_Expect(
            "ExpectColumnValuesToBeBetween", column,
            f"each row of '{name}' sums to 1 ± {tol:g}", "validation.outputs.sum_tolerance",
            {"min_value": 1.0 - tol, "max_value": 1.0 + tol},
        ))  # fmt: skip
    return plan


def _class_share_expectation(arrays: Mapping[str, np.ndarray], probabilities: list[str],
                             share: float, data: dict[str, np.ndarray]) -> _Expect:
    """``validation.max_class_share``: the most predicted class's share (its column added
    to ``data``), or a failing expectation when the model has no class to count."""
    source = _class_source(arrays, probabilities)
    if source is None:
        return _Expect(
            "ExpectColumnToExist", "predicted_class",
            "validation.max_class_share is set, but the model has no integer, boolean or "
            "string label output and no probability output to take classes from",
            "validation.max_class_share",
        )  # fmt: skip
    origin, classes = source
    series = pd.Series(classes)
    shares = series.value_counts(normalize=True)
    column = f"{origin}.class_share"
    data[column] = series.map(shares).to_numpy(float)
    top = f" (the most frequent is {_jsonable(shares.index[0])!r})" if len(shares) else ""
    return _Expect(
        "ExpectColumnMaxToBeBetween", column,
        f"no predicted class from '{origin}' takes more than {share:g} of the golden "
        f"rows{top}", "validation.max_class_share", {"max_value": share},
    )  # fmt: skip


def _interval(low: float | None, high: float | None) -> str:
    return f"[{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}]"


def _gx_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy GX can check: string column names, and string columns as ``object``.

    GX 1.24 matches pandas dtypes by name and has no name for pandas 3's ``str`` dtype; as
    ``object``, GX checks the values one by one, which is what a type check needs.
    """
    out = frame.copy()
    out.columns = [str(c) for c in frame.columns]
    for column in out.columns:
        if isinstance(out[column].dtype, pd.StringDtype):
            out[column] = out[column].astype(object)
    return out


# --------------------------------------------------------------------------------------
# running GX


def _context() -> Any:
    """The process's GX context (made on first use; call under ``_lock``)."""
    import great_expectations as gx  # heavy (~3 s): imported by the first validation
    from great_expectations.data_context.types.base import ProgressBarsConfig

    if not _context_of_process:
        ctx = gx.get_context(mode="ephemeral")
        ctx.variables.progress_bars = ProgressBarsConfig(globally=False)  # no tqdm on stderr
        ctx.data_sources.add_pandas(_SOURCE)
        _context_of_process.append(ctx)
    return _context_of_process[0]


def _point_docs_at(ctx: Any, docs_dir: Path) -> None:
    """Build the modelship Data Docs site into ``docs_dir`` from now on."""
    base = str(docs_dir.resolve())
    config = {
        "class_name": "SiteBuilder",
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": base},
    }
    sites: dict[str, Any] = ctx.get_config().data_docs_sites or {}
    if DOCS_SITE not in sites:
        ctx.add_data_docs_site(site_name=DOCS_SITE, site_config=config)
    elif sites[DOCS_SITE].get("store_backend", {}).get("base_directory") != base:
        ctx.update_data_docs_site(site_name=DOCS_SITE, site_config=config)


def _replace(factory: Any, name: str) -> None:
    """Delete ``name`` from a GX factory if present, so a rerun replaces its definition."""
    if any(item.name == name for item in factory.all()):
        factory.delete(name)


def _run(
    suite_name: str, frame: pd.DataFrame, plan: list[_Expect], out_dir: Path, docs: bool
) -> DataCheckResult:
    """Validate ``frame`` against ``plan`` with GX, save the result and optionally the docs."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    out_dir.mkdir(parents=True, exist_ok=True)
    docs_dir = out_dir / "data_docs"
    with _lock:
        # lazy: great_expectations costs ~10 s at import; only a validation needs it
        import great_expectations as gx
        import great_expectations.expectations as gxe
        from great_expectations.checkpoint import UpdateDataDocsAction

        ctx = _context()
        if docs:
            _point_docs_at(ctx, docs_dir)
        source = ctx.data_sources.get(_SOURCE)
        asset_names = {a.name for a in source.assets}
        asset = (
            source.get_asset(suite_name)
            if suite_name in asset_names
            else source.add_dataframe_asset(suite_name)
        )
        batch = next(iter(asset.batch_definitions), None) or (
            asset.add_batch_definition_whole_dataframe("all_rows")
        )
        _replace(ctx.checkpoints, suite_name)
        _replace(ctx.validation_definitions, suite_name)
        _replace(ctx.suites, suite_name)
        suite = ctx.suites.add(gx.ExpectationSuite(name=suite_name))
        for item in plan:
            kwargs = dict(item.kwargs)
            if item.column is not None:
                kwargs["column"] = item.column
            meta = {"modelship": {"about": item.about, "policy_key": item.policy_key}}
            suite.add_expectation(getattr(gxe, item.kind)(**kwargs, meta=meta, notes=item.about))
        definition = ctx.validation_definitions.add(
            gx.ValidationDefinition(name=suite_name, data=batch, suite=suite)
        )
        if docs:
            checkpoint = ctx.checkpoints.add(
                gx.Checkpoint(
                    name=suite_name,
                    validation_definitions=[definition],
                    actions=[UpdateDataDocsAction(name="data_docs", site_names=[DOCS_SITE])],
                )
            )
            outcome = checkpoint.run(batch_parameters={"dataframe": frame})
            result = next(iter(outcome.run_results.values()))
        else:
            result = definition.run(batch_parameters={"dataframe": frame})
        raw = result.to_json_dict()

    result_path = out_dir / f"{suite_name}.validation.json"
    result_path.write_text(json.dumps(_jsonable(raw), indent=2), encoding="utf-8")
    index = docs_dir / "index.html"
    failures = [_failure(r) for r in raw.get("results", []) if not r.get("success")]
    return DataCheckResult(
        suite=suite_name,
        success=bool(raw.get("success")) and not failures,
        failures=failures,
        result_path=result_path,
        docs_path=index if docs and index.is_file() else None,
        evaluated=len(raw.get("results", [])),
    )


# --------------------------------------------------------------------------------------
# reading results


def _jsonable(value: Any) -> Any:
    """A data check's values as plain JSON: NaN and ±inf kept as text, since they are often
    the finding itself."""
    return jsonable(value, nonfinite_as_text=True)


def _failure(raw: Mapping[str, Any]) -> dict[str, Any]:
    """One failed expectation as a dict with a sentence that names the column and values."""
    config = raw.get("expectation_config") or {}
    kind = str(config.get("type", "unknown_expectation"))
    kwargs = config.get("kwargs") or {}
    ours = (config.get("meta") or {}).get("modelship") or {}
    column = kwargs.get("column")
    result = raw.get("result") or {}
    about = ours.get("about") or kind
    where = f" on '{column}'" if column is not None else ""

    error = _exception_message(raw.get("exception_info"))
    if error:
        observed: Any = {"error": error}
        detail = f"could not be evaluated ({error})"
    elif "unexpected_count" in result:
        examples = _jsonable(list(result.get("partial_unexpected_list") or [])[:_EXAMPLES])
        count, total = result.get("unexpected_count"), result.get("element_count")
        observed = {"unexpected_count": count, "element_count": total, "examples": examples}
        rows = list(result.get("partial_unexpected_index_list") or [])[:_EXAMPLES]
        at = f" at rows {_jsonable(rows)}" if rows else ""
        detail = f"{count} of {total} values break it{at}, e.g. {json.dumps(examples)}"
    elif "observed_value" in result:
        observed = _jsonable(result["observed_value"])
        detail = f"observed {json.dumps(observed)}"
    else:
        observed = None
        detail = "it does not hold" if kind != "expect_column_to_exist" else "column missing"
    key = ours.get("policy_key")
    if key and key.startswith("validation.inputs.columns.") and "unexpected_count" in result:
        key = _broken_bound(key, kwargs, result.get("partial_unexpected_list") or [])
    return {
        "expectation": kind,
        "column": column,
        "observed": observed,
        "message": f"{kind}{where}: expected {about}, but {detail}",
        "policy_key": key,
    }


def _broken_bound(key: str, kwargs: Mapping[str, Any], examples: Sequence[Any]) -> str:
    """``KEY.min`` or ``KEY.max`` (or both) by which side the unexpected values fell on."""
    low, high = kwargs.get("min_value"), kwargs.get("max_value")
    sides = []
    numbers = [v for v in examples if isinstance(v, int | float) and not isinstance(v, bool)]
    if low is not None and (any(v < low for v in numbers) or not numbers):
        sides.append("min")
    if high is not None and (any(v > high for v in numbers) or not numbers):
        sides.append("max")
    return " / ".join(f"{key}.{side}" for side in sides) or key


def _exception_message(info: Any) -> str | None:
    """GX's exception text, whether it reports one exception or one per metric."""
    if not isinstance(info, Mapping):
        return None
    if info.get("raised_exception"):
        return str(info.get("exception_message") or "an exception")
    for nested in info.values():
        if isinstance(nested, Mapping) and nested.get("raised_exception"):
            return str(nested.get("exception_message") or "an exception")
    return None
