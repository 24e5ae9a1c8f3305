"""Output agreement (tasks/agreement.py, pure): tables of answers against their verdicts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from modelship.errors import UsageError
from modelship.loadgen import RequestRecord
from modelship.policy import AgreementPolicy
from tasks.agreement import (
    BASELINE,
    CANDIDATE,
    agreement_kind,
    compute_agreement,
    pair_by_row,
    rows_agree,
    top1_labels,
)

PROBS = np.array([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7]], np.float32)


def _record(tag: str | None, row: int, outputs: dict[str, np.ndarray] | None,
            ok: bool = True) -> RequestRecord:
    return RequestRecord(start_s=float(row), latency_ms=1.0, ok=ok,
                         error=None if ok else "boom", server=0, model_version="1", row=row,
                         tag=tag, outputs=outputs if ok else None)


@pytest.mark.parametrize(
    ("outputs", "configured", "kind"),
    [
        ({"label": np.array([1, 2])}, "auto", "classifier"),          # integer label per row
        ({"label": np.array([[1], [2]])}, "auto", "classifier"),      # (n, 1) is one per row
        ({"name": np.array(["a", "b"])}, "auto", "classifier"),       # string label
        ({"probabilities": PROBS}, "auto", "classifier"),             # class probabilities
        ({"y": np.array([[1.5], [2.5]])}, "auto", "regressor"),       # one float per row
        ({"y": np.array([1.5, 2.5])}, "auto", "regressor"),
        ({"y": np.array([[1.5], [2.5]])}, "classifier", "classifier"),  # configured wins
        ({"label": np.array([1, 2])}, "regressor", "regressor"),
    ],
)
def test_agreement_kind_from_the_outputs_unless_configured(outputs: dict[str, np.ndarray],
                                                           configured: str, kind: str) -> None:
    assert agreement_kind(outputs, configured) == kind


@pytest.mark.parametrize(
    ("outputs", "labels"),
    [
        ({"label": np.array([3, 1]), "probabilities": PROBS}, [3, 1]),  # the label output first
        ({"probabilities": PROBS}, [0, 2]),                              # else argmax
        ({"probs": PROBS, "logits": PROBS[::-1]}, [0, 2]),               # prob* named first
    ],
)
def test_top1_labels(outputs: dict[str, np.ndarray], labels: list[int]) -> None:
    assert top1_labels(outputs).tolist() == labels


def test_top1_labels_without_a_label_or_probabilities_says_what_to_set() -> None:
    with pytest.raises(UsageError) as err:
        top1_labels({"y": np.array([[1.5], [2.5]])})
    assert "regressor" in str(err.value.hint)


REG = AgreementPolicy(kind="regressor", regressor_rel_tol=1e-2, regressor_abs_tol=1e-3)


@pytest.mark.parametrize(
    ("kind", "candidate", "baseline", "agree"),
    [
        ("classifier", {"label": np.array([0, 2])}, {"label": np.array([0, 1])}, [True, False]),
        ("classifier", {"label": np.array([0])}, {"label": np.array([0, 1])}, [False, False]),
        # regressor: |c - b| <= abs_tol + rel_tol * |b|; exactly at the bound agrees
        ("regressor", {"y": np.array([[101.0]])}, {"y": np.array([[100.0]])}, [True]),
        ("regressor", {"y": np.array([[101.2]])}, {"y": np.array([[100.0]])}, [False]),
        ("regressor", {"y": np.array([[0.0009]])}, {"y": np.array([[0.0]])}, [True]),
        ("regressor", {"y": np.array([[np.nan]])}, {"y": np.array([[np.nan]])}, [False]),
        # every element of a row must agree
        ("regressor", {"y": np.array([[1.0, 2.0]])}, {"y": np.array([[1.0, 3.0]])}, [False]),
        # an output missing on the candidate, or of another size, disagrees on every row
        ("regressor", {"z": np.array([[1.0], [2.0]])}, {"y": np.array([[1.0], [2.0]])},
         [False, False]),
        ("regressor", {"y": np.array([[1.0]])}, {"y": np.array([[1.0], [2.0]])},
         [False, False]),
        # non-numeric outputs are not compared by a regressor
        ("regressor", {"y": np.array([[1.0]]), "s": np.array(["a"])},
         {"y": np.array([[1.0]]), "s": np.array(["b"])}, [True]),
    ],
)
def test_rows_agree(kind: str, candidate: dict[str, np.ndarray],
                    baseline: dict[str, np.ndarray], agree: list[bool]) -> None:
    assert rows_agree(kind, candidate, baseline, REG).tolist() == agree


def test_pairs_match_rows_arm_against_arm_and_skip_unanswered() -> None:
    a, b = {"label": np.array([0])}, {"label": np.array([1])}
    records = [_record(BASELINE, 1, b), _record(CANDIDATE, 0, a), _record(BASELINE, 0, b),
               _record(CANDIDATE, 1, a), _record(CANDIDATE, 1, b),   # a second answer of row 1
               _record(BASELINE, 2, None, ok=False), _record(CANDIDATE, 2, a),  # one arm only
               _record(None, 3, a)]                                   # not a paired record
    pairs = pair_by_row(records)
    assert [(c["label"][0], base["label"][0]) for c, base in pairs] == [(0, 1), (0, 1)]


@pytest.mark.parametrize(
    ("records", "policy", "expected"),
    [
        ([], AgreementPolicy(), (None, 0, "classifier")),      # no data is no agreement
        ([], REG, (None, 0, "regressor")),
        ([_record(CANDIDATE, 0, {"label": np.array([0])}),
          _record(BASELINE, 0, None, ok=False)], AgreementPolicy(), (None, 0, "classifier")),
        ([_record(CANDIDATE, 0, {"label": np.array([0, 1])}),
          _record(BASELINE, 0, {"label": np.array([0, 2])})], AgreementPolicy(),
         (0.5, 2, "classifier")),
        ([_record(CANDIDATE, 0, {"y": np.array([[1.0], [5.0]])}),
          _record(BASELINE, 0, {"y": np.array([[1.0], [5.0]])})], AgreementPolicy(),
         (1.0, 2, "regressor")),
    ],
)
def test_compute_agreement(records: list[RequestRecord], policy: AgreementPolicy,
                           expected: tuple[Any, int, str]) -> None:
    assert compute_agreement(records, policy) == expected
