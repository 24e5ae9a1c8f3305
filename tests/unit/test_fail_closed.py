"""Recorded checks fail closed when their result is missing (issue 19 item 9): a check
that compared nothing, or whose result lacks its verdict, never records a pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from modelship.candidate import ResolvedVersion
from modelship.errors import ValidationFailed
from modelship.policy import ExportPolicy
from tasks import export

RESOLVED = ResolvedVersion(name="m", version=1, flavor="sklearn", flavors=("sklearn",),
                           source="models:/m-1", run_id="r", signature=None, metrics={},
                           aliases=(), tags={}, local_dir=Path("/nowhere"))


def _parity(monkeypatch: pytest.MonkeyPatch, graph: dict[str, Any],
            native: dict[str, Any]) -> dict[str, Any]:
    """export._parity with the graph's and the native model's answers given."""
    monkeypatch.setattr(export, "golden_feed", lambda *a, **k: {"x": np.zeros((3, 1))})
    monkeypatch.setattr(export, "_run_onnx", lambda *a, **k: graph)
    monkeypatch.setattr(export, "_native_outputs", lambda *a, **k: (native, None))
    return export._parity(RESOLVED, pd.DataFrame({"x": [0.0, 1.0, 2.0]}), None,  # type: ignore[arg-type]
                          Path("/nowhere/model.onnx"), ExportPolicy())


LABELS = np.array([0, 1, 1])


def test_parity_that_compared_an_output_passes_on_equal_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    report = _parity(monkeypatch, {"label": LABELS, "extra": LABELS}, {"label": LABELS})
    assert report["passed"] is True
    assert report["outputs"]["label"]["compared"] is True
    assert report["outputs"]["extra"] == {"compared": False, "reason": "no native counterpart"}


def test_parity_that_compared_nothing_is_refused_not_passed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The native model answered nothing comparable: before, every output was 'not
    compared' and all() over their missing 'passed' keys recorded a pass."""
    with pytest.raises(ValidationFailed, match="no output of the ONNX graph"):
        _parity(monkeypatch, {"label": LABELS}, {})
