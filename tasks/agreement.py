"""Output agreement between the candidate and the baseline on the same inputs (pure).

The canary sends every golden row to both versions (:func:`modelship.loadgen.run_paired`,
records tagged :data:`BASELINE` and :data:`CANDIDATE`); for each row answered by both,
the answers agree when:

- **classifier**: the same top-1 label (the label output, else argmax of the class
  probabilities);
- **regressor**: every numeric output element within ``regressor_abs_tol +
  regressor_rel_tol * |baseline|``; a NaN never agrees, and an output missing on either
  side is a disagreement.

``canary.agreement.kind: auto`` picks classifier when the model returns a label or class
probabilities, regressor otherwise. No answered pair is no agreement (None), never 100%.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from modelship.errors import UsageError
from modelship.policy import AgreementPolicy

if TYPE_CHECKING:  # annotations only: the load generator's package imports its engine
    from modelship.loadgen import RequestRecord

__all__ = ["BASELINE", "CANDIDATE", "agreement_kind", "compute_agreement", "pair_by_row",
           "rows_agree", "top1_labels"]

BASELINE, CANDIDATE = "baseline", "candidate"
"""The arms' tags on the paired load's records."""


def _rows(array: np.ndarray) -> np.ndarray:
    """An output as one row per input row (a scalar per row stays 1-D)."""
    arr = np.asarray(array)
    if arr.ndim == 0:
        return arr.reshape(1)
    if arr.ndim > 1 and int(np.prod(arr.shape[1:])) == 1:
        return arr.reshape(arr.shape[0])
    return arr


def _label_output(outputs: Mapping[str, np.ndarray]) -> str | None:
    """The output holding a predicted label: integer or string, one value per row."""
    for name in sorted(outputs):
        arr = _rows(outputs[name])
        if arr.ndim == 1 and (arr.dtype.kind in "iuSUO" or arr.dtype == np.bool_):
            return name
    return None


def _probability_output(outputs: Mapping[str, np.ndarray]) -> str | None:
    """A float output with one column per class (named ``prob*`` first)."""
    candidates = [n for n in sorted(outputs)
                  if np.asarray(outputs[n]).dtype.kind == "f" and _rows(outputs[n]).ndim == 2
                  and _rows(outputs[n]).shape[1] > 1]
    named = [n for n in candidates if n.lower().startswith("prob")]
    chosen = named or candidates
    return chosen[0] if chosen else None


def agreement_kind(outputs: Mapping[str, np.ndarray], configured: str = "auto") -> str:
    """``classifier`` or ``regressor``: as configured, else from the outputs' shapes.

    ``auto`` means classifier when the model returns a label (an integer or string per row)
    or class probabilities (a float matrix), and regressor otherwise.
    """
    if configured in ("classifier", "regressor"):
        return configured
    if _label_output(outputs) or _probability_output(outputs):
        return "classifier"
    return "regressor"


def top1_labels(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The predicted label of each row: the label output, else argmax of the probabilities.

    Raises:
        UsageError: The outputs hold neither (set ``canary.agreement.kind: regressor``).
    """
    label = _label_output(outputs)
    if label is not None:
        return _rows(outputs[label])
    probabilities = _probability_output(outputs)
    if probabilities is not None:
        return np.argmax(_rows(outputs[probabilities]), axis=1)
    raise UsageError(
        f"no label or probability output among {sorted(outputs)} to compare top-1 labels",
        hint="set canary.agreement.kind to regressor in the model's policy",
    )


def rows_agree(kind: str, candidate: Mapping[str, np.ndarray],
               baseline: Mapping[str, np.ndarray], policy: AgreementPolicy) -> np.ndarray:
    """Whether each row's answers agree (pure): a boolean per input row.

    Classifier: the same top-1 label. Regressor: every numeric output element within
    ``regressor_abs_tol + regressor_rel_tol * |baseline|``; a NaN never agrees, and an
    output missing on either side is a disagreement.
    """
    if kind == "classifier":
        c, b = top1_labels(candidate), top1_labels(baseline)
        if c.shape != b.shape:
            return np.zeros(max(len(c), len(b)), dtype=bool)
        return np.asarray(c == b, dtype=bool)
    names = sorted(n for n in baseline if np.asarray(baseline[n]).dtype.kind in "fiub")
    n_rows = len(_rows(next(iter(baseline.values())))) if baseline else 0
    agree = np.ones(n_rows, dtype=bool)
    for name in names:
        if name not in candidate:
            return np.zeros(n_rows, dtype=bool)
        b = np.asarray(baseline[name], dtype=float).reshape(n_rows, -1)
        c = np.asarray(candidate[name], dtype=float)
        if c.size != b.size:
            return np.zeros(n_rows, dtype=bool)
        c = c.reshape(n_rows, -1)
        close = np.abs(c - b) <= policy.regressor_abs_tol + policy.regressor_rel_tol * np.abs(b)
        agree &= close.all(axis=1)
    return agree


def pair_by_row(records: Sequence[RequestRecord]
                ) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """(candidate, baseline) outputs for the same input rows (pure).

    ``run_paired`` sends each row to both arms; answered records of one row are matched in
    completion order, arm against arm. Rows answered by one arm only are not paired (their
    failures count as errors, not as disagreements).
    """
    by_row: dict[int, dict[str, list[dict[str, np.ndarray]]]] = defaultdict(
        lambda: {BASELINE: [], CANDIDATE: []})
    for record in records:
        if record.ok and record.outputs is not None and record.tag in (BASELINE, CANDIDATE):
            by_row[record.row][record.tag].append(record.outputs)
    pairs: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
    for row in sorted(by_row):
        arms = by_row[row]
        pairs.extend(zip(arms[CANDIDATE], arms[BASELINE], strict=False))
    return pairs


def compute_agreement(records: Sequence[RequestRecord], policy: AgreementPolicy
                      ) -> tuple[float | None, int, str]:
    """Share of paired rows whose answers agree, the number of rows compared, and the kind.

    Returns ``(None, 0, kind)`` when no pair was answered: no data is not agreement.
    """
    pairs = pair_by_row(records)
    if not pairs:
        return None, 0, policy.kind if policy.kind != "auto" else "classifier"
    kind = agreement_kind(pairs[0][1], policy.kind)
    agreed = compared = 0
    for candidate, baseline in pairs:
        rows = rows_agree(kind, candidate, baseline, policy)
        agreed += int(rows.sum())
        compared += int(rows.size)
    return (agreed / compared if compared else None), compared, kind
