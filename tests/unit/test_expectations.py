"""The GX data checks of the validate stage, run with the real Great Expectations in process.

Most cases skip the Data Docs build (~0.4 s each); one test builds them and checks that a
single index lists both suites of a release.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from modelship.errors import ValidationFailed
from modelship.policy import ValidationPolicy
from tasks import expectations
from tasks.expectations import (
    DataCheckResult,
    check_inputs,
    check_outputs,
    raise_for_failures,
)

SIGNATURE = [
    {"name": "age", "type": "long", "required": True},
    {"name": "amount", "type": "double", "required": True},
    {"name": "country", "type": "string", "required": True},
    {"name": "is_new", "type": "boolean", "required": True},
]


def golden(rows: int = 6) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "age": np.arange(20, 20 + rows, dtype=np.int64),
            "amount": np.linspace(1.0, 99.0, rows),
            "country": ["fr", "de", "us"] * (rows // 3) + ["fr"] * (rows % 3),
            "is_new": [True, False] * (rows // 2) + [True] * (rows % 2),
        }
    )


def policy(**data: Any) -> ValidationPolicy:
    return ValidationPolicy.model_validate(data)


def inputs(
    frame: pd.DataFrame,
    tmp_path: Path,
    pol: ValidationPolicy | None = None,
    signature: list[dict[str, Any]] | None = SIGNATURE,
) -> DataCheckResult:
    return check_inputs(
        frame, pol or policy(), signature_columns=signature, out_dir=tmp_path, docs=False
    )


def outputs(
    arrays: dict[str, np.ndarray], tmp_path: Path, pol: ValidationPolicy | None = None
) -> DataCheckResult:
    return check_outputs(arrays, pol or policy(), out_dir=tmp_path, docs=False)


def classifier(rows: int = 6) -> dict[str, np.ndarray]:
    """A sane binary classifier's answer: labels 0/1 and probabilities that sum to 1."""
    p1 = np.linspace(0.1, 0.9, rows, dtype=np.float32)
    return {
        "label": (p1 > 0.5).astype(np.int64),
        "probabilities": np.stack([1 - p1, p1], axis=1),
    }


def failed(result: DataCheckResult) -> list[tuple[str, str | None]]:
    return [(f["expectation"], f["column"]) for f in result.failures]


# --------------------------------------------------------------------------------------
# inputs


def test_valid_inputs_pass(tmp_path: Path) -> None:
    pol = policy(inputs={"columns": {"age": {"min": 18, "max": 99}, "amount": {"min": 0}}})
    result = inputs(golden(), tmp_path, pol)
    assert result.success, result.failures
    assert result.failures == []
    assert result.evaluated >= 1 + 4 + 4 + 2  # rows, types, not-null, ranges
    assert result.docs_path is None
    raise_for_failures(result, "fraud/7 golden inputs")  # a pass does not raise


def test_value_out_of_range_fails_naming_the_column_and_the_bound(tmp_path: Path) -> None:
    frame = golden()
    frame.loc[2, "age"] = 150
    pol = policy(inputs={"columns": {"age": {"min": 18, "max": 99}}})
    result = inputs(frame, tmp_path, pol)
    assert not result.success
    assert failed(result) == [("expect_column_values_to_be_between", "age")]
    failure = result.failures[0]
    assert failure["observed"]["examples"] == [150]
    assert failure["policy_key"] == "validation.inputs.columns.age.max"
    with pytest.raises(ValidationFailed) as info:
        raise_for_failures(result, "fraud/7 golden inputs")
    err = info.value
    assert err.exit_code == 3
    assert "fraud/7 golden inputs" in err.message
    assert "expect_column_values_to_be_between on 'age'" in err.message
    assert "[150]" in err.message
    assert err.hint is not None and "`validation.inputs.columns.age.max`" in err.hint
    assert err.details["failures"] == result.failures


def test_nulls_fail_unless_the_column_allows_them(tmp_path: Path) -> None:
    frame = golden()
    frame["amount"] = frame["amount"].astype(float)
    frame.loc[1, "amount"] = np.nan
    result = inputs(frame, tmp_path)
    assert failed(result) == [("expect_column_values_to_not_be_null", "amount")]
    assert result.failures[0]["policy_key"] == "validation.inputs.not_null"
    assert result.failures[0]["observed"]["unexpected_count"] == 1

    allowed = policy(inputs={"columns": {"amount": {"not_null": False}}})
    assert inputs(frame, tmp_path, allowed).success
    assert inputs(frame, tmp_path, policy(inputs={"not_null": False})).success


def test_zero_rows_fail(tmp_path: Path) -> None:
    result = inputs(golden().iloc[:0], tmp_path)
    assert not result.success
    assert failed(result) == [("expect_table_row_count_to_be_between", None)]
    assert result.failures[0]["observed"] == 0
    # A tensor signature with no data at all fails the same way.
    empty = inputs(pd.DataFrame(), tmp_path, signature=None)
    assert failed(empty) == [("expect_table_row_count_to_be_between", None)]


def test_a_string_in_a_numeric_signature_column_fails(tmp_path: Path) -> None:
    frame = golden()
    frame["amount"] = frame["amount"].astype(object)
    frame.loc[3, "amount"] = "12,5"
    result = inputs(frame, tmp_path)
    assert failed(result) == [("expect_column_values_to_be_in_type_list", "amount")]
    assert result.failures[0]["observed"]["examples"] == ["12,5"]
    assert result.failures[0]["policy_key"] is None
    # A whole column of the wrong dtype is named by its dtype.
    text = golden().assign(age=lambda f: f["age"].astype(str))
    assert failed(inputs(text, tmp_path)) == [("expect_column_values_to_be_in_type_list", "age")]


def test_missing_signature_and_policy_columns_fail(tmp_path: Path) -> None:
    pol = policy(inputs={"columns": {"agee": {"max": 99}}})
    result = inputs(golden().drop(columns=["country"]), tmp_path, pol)
    assert sorted(failed(result), key=str) == [
        ("expect_column_to_exist", "agee"),
        ("expect_column_to_exist", "country"),
    ]
    keys = {f["column"]: f["policy_key"] for f in result.failures}
    assert keys == {"agee": "validation.inputs.columns.agee", "country": None}


def test_optional_signature_columns_may_be_missing_or_null(tmp_path: Path) -> None:
    signature = [*SIGNATURE, {"name": "promo", "type": "string", "required": False}]
    assert inputs(golden(), tmp_path, signature=signature).success
    frame = golden().assign(promo=["a", None, "b", None, "c", None])
    assert inputs(frame, tmp_path, signature=signature).success


def test_tensor_signature_checks_rows_and_nulls_only(tmp_path: Path) -> None:
    frame = pd.DataFrame(np.random.default_rng(0).normal(size=(5, 3)))
    result = inputs(frame, tmp_path, signature=None)
    assert result.success
    assert result.evaluated == 1 + 3
    frame.iloc[0, 1] = np.nan
    assert failed(inputs(frame, tmp_path, signature=None)) == [
        ("expect_column_values_to_not_be_null", "1")
    ]
    tensor = [{"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": [-1, 3]}}]
    assert not inputs(frame, tmp_path, signature=tensor).success


# --------------------------------------------------------------------------------------
# outputs


def test_a_good_classifier_output_passes(tmp_path: Path) -> None:
    result = outputs(classifier(), tmp_path, policy(max_class_share=0.9))
    assert result.success, result.failures
    assert result.suite == "model_outputs"


def test_nan_in_an_output_fails(tmp_path: Path) -> None:
    arrays = classifier()
    arrays["score"] = np.array([0.1, np.nan, 0.3, 0.4, 0.5, 0.6], dtype=np.float32)
    result = outputs(arrays, tmp_path)
    assert failed(result) == [("expect_column_values_to_not_be_null", "score")]
    assert "score" in result.failures[0]["message"]


@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_inf_in_an_output_fails(tmp_path: Path, bad: float) -> None:
    result = outputs({"score": np.array([[1.0], [bad], [3.0]])}, tmp_path)
    assert failed(result) == [("expect_column_values_to_be_between", "score")]
    assert result.failures[0]["observed"]["examples"] == [str(bad)]


def test_probabilities_above_one_fail(tmp_path: Path) -> None:
    arrays = classifier()
    arrays["probabilities"][0] = [-0.2, 1.2]  # still sums to 1
    result = outputs(arrays, tmp_path)
    assert sorted(failed(result)) == [
        ("expect_column_values_to_be_between", "probabilities[0]"),
        ("expect_column_values_to_be_between", "probabilities[1]"),
    ]
    assert {f["policy_key"] for f in result.failures} == {"validation.outputs.probabilities"}


def test_float_rounding_just_outside_zero_and_one_passes(tmp_path: Path) -> None:
    """A random forest exported to ONNX answers -3.6e-07 for a class it never predicts."""
    arrays = classifier()
    arrays["probabilities"][0] = [np.float32(-3.5762787e-07), np.float32(1.0000004)]
    assert outputs(arrays, tmp_path).success
    arrays["probabilities"][0] = [-0.01, 1.01]  # beyond the tolerance (1e-3): a real defect
    assert sorted(failed(outputs(arrays, tmp_path))) == [
        ("expect_column_values_to_be_between", "probabilities[0]"),
        ("expect_column_values_to_be_between", "probabilities[1]"),
    ]


def test_rows_not_summing_to_one_fail(tmp_path: Path) -> None:
    arrays = classifier()
    arrays["probabilities"][4] = [0.5, 0.6]
    result = outputs(arrays, tmp_path)
    assert failed(result) == [("expect_column_values_to_be_between", "probabilities.row_sum")]
    assert result.failures[0]["policy_key"] == "validation.outputs.sum_tolerance"
    loose = policy(outputs={"sum_tolerance": 0.2})
    assert outputs(arrays, tmp_path, loose).success


def test_class_share_above_the_max_fails(tmp_path: Path) -> None:
    arrays = classifier()
    arrays["label"][:] = 1
    result = outputs(arrays, tmp_path, policy(max_class_share=0.8))
    assert failed(result) == [("expect_column_max_to_be_between", "label.class_share")]
    assert result.failures[0]["observed"] == 1.0
    with pytest.raises(ValidationFailed) as info:
        raise_for_failures(result, "fraud/7 outputs")
    assert info.value.hint is not None and "`validation.max_class_share`" in info.value.hint
    assert outputs(arrays, tmp_path).success  # no bound, no check


def test_class_share_from_argmax_and_without_any_class_source(tmp_path: Path) -> None:
    probs = np.tile(np.array([[0.1, 0.9]], dtype=np.float32), (5, 1))
    result = outputs({"output_probability": probs}, tmp_path, policy(max_class_share=0.7))
    assert failed(result) == [
        ("expect_column_max_to_be_between", "argmax(output_probability).class_share")
    ]
    regressor = outputs({"y": np.ones(4)}, tmp_path, policy(max_class_share=0.7))
    assert failed(regressor) == [("expect_column_to_exist", "predicted_class")]
    assert regressor.failures[0]["policy_key"] == "validation.max_class_share"


def test_wide_outputs_are_checked_through_row_summaries(tmp_path: Path) -> None:
    probs = np.full((4, 40), 1 / 40)
    assert outputs({"probabilities": probs}, tmp_path).evaluated == 1 + 2 + 2 + 1
    probs[2, 17] = np.nan
    result = outputs({"probabilities": probs}, tmp_path)
    assert ("expect_column_values_to_not_be_null", "probabilities.row_min") in failed(result)


def test_explicit_probability_outputs(tmp_path: Path) -> None:
    arrays = {"scores": np.array([[0.3, 0.3], [0.5, 0.5]])}
    assert outputs(arrays, tmp_path).success  # not named like prob*: not probabilities
    named = policy(outputs={"probabilities": ["scores", "probz"]})
    assert sorted(failed(outputs(arrays, tmp_path, named)), key=str) == [
        ("expect_column_to_exist", "probz"),
        ("expect_column_values_to_be_between", "scores.row_sum"),
    ]


def test_outputs_that_cannot_form_a_table_raise(tmp_path: Path) -> None:
    with pytest.raises(ValidationFailed, match="disagree on the number of rows"):
        check_outputs(
            {"a": np.zeros(3), "b": np.zeros(4)}, policy(), out_dir=tmp_path, docs=False
        )
    with pytest.raises(ValidationFailed, match="no outputs"):
        check_outputs({}, policy(), out_dir=tmp_path, docs=False)


# --------------------------------------------------------------------------------------
# artifacts


def test_result_json_and_data_docs_are_written(tmp_path: Path) -> None:
    good = check_inputs(golden(), policy(), signature_columns=SIGNATURE, out_dir=tmp_path)
    arrays = classifier()
    arrays["score"] = np.array([np.inf, 1, 2, 3, 4, 5], dtype=np.float64)
    bad = check_outputs(arrays, policy(), out_dir=tmp_path)
    assert good.success and not bad.success

    for result in (good, bad):
        assert result.result_path.is_file()

        def strict(token: str) -> None:
            raise AssertionError(f"non-standard JSON constant {token}")

        raw = json.loads(result.result_path.read_text(encoding="utf-8"), parse_constant=strict)
        assert raw["success"] is result.success
        assert len(raw["results"]) == result.evaluated

    index = tmp_path / "data_docs" / "index.html"
    assert good.docs_path == index and bad.docs_path == index
    html = index.read_text(encoding="utf-8")
    assert "golden_inputs" in html and "model_outputs" in html
    assert json.dumps(bad.to_dict())  # JSON-ready for the release record


def test_one_context_builds_each_validations_docs_in_its_own_folder(tmp_path: Path) -> None:
    """One GX context serves the process; the Data Docs follow each validation's folder."""
    first, second = tmp_path / "first", tmp_path / "second"
    a = check_inputs(golden(), policy(), signature_columns=SIGNATURE, out_dir=first)
    b = check_outputs(classifier(), policy(), out_dir=second)
    c = check_inputs(golden(), policy(), signature_columns=SIGNATURE, out_dir=first)
    assert a.docs_path == c.docs_path == first / "data_docs" / "index.html"
    assert b.docs_path == second / "data_docs" / "index.html"
    assert "model_outputs" in b.docs_path.read_text(encoding="utf-8")
    built = {folder: sorted(p.name for p in (folder / "data_docs" / "validations").iterdir())
             for folder in (first, second)}
    assert built == {first: ["golden_inputs"], second: ["model_outputs"]}
    assert expectations._context() is expectations._context()
