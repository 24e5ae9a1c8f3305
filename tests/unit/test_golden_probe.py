"""The golden probe recorded at staging: round trip through JSON and tolerant comparison."""

from __future__ import annotations

import json

import numpy as np
import pytest

from modelship.triton.infer import GoldenProbe

FEED = {"input": np.arange(12, dtype=np.float32).reshape(6, 2)}
OUT = {"label": np.array([0, 1, 2, 1, 0, 2], dtype=np.int64),
       "probabilities": np.linspace(0, 1, 18, dtype=np.float32).reshape(6, 3)}


def probe() -> GoldenProbe:
    return GoldenProbe.record(FEED, OUT, rows=4, atol=1e-4, rtol=1e-3)


def test_record_keeps_the_first_rows_and_round_trips_through_json() -> None:
    recorded = probe()
    assert recorded.inputs["input"].shape == (4, 2)
    back = GoldenProbe.from_dict(json.loads(json.dumps(recorded.to_dict())))
    assert back.inputs["input"].dtype == np.float32
    np.testing.assert_array_equal(back.inputs["input"], FEED["input"][:4])
    assert back.outputs["label"].dtype == np.int64
    assert back.output_names == ["label", "probabilities"]
    assert back.mismatches({k: v[:4] for k, v in OUT.items()}) == []


def test_bytes_inputs_round_trip() -> None:
    words = {"text": np.array([b"a", b"b"], dtype=object).reshape(2, 1)}
    back = GoldenProbe.from_dict(json.loads(json.dumps(
        GoldenProbe.record(words, {"label": np.array([1, 0])}).to_dict())))
    assert back.inputs["text"].tolist() == [[b"a"], [b"b"]]


@pytest.mark.parametrize(("case", "answered", "found"), [
    ("within tolerance", {"label": OUT["label"][:4],
                          "probabilities": OUT["probabilities"][:4] + 5e-5}, None),
    ("a flipped label", {"label": np.array([1, 1, 2, 1]),
                         "probabilities": OUT["probabilities"][:4]}, "label[0] is 1"),
    ("a float past the tolerance", {"label": OUT["label"][:4],
                                    "probabilities": OUT["probabilities"][:4] + 0.01},
     "probabilities[0, 0]"),
    ("Triton's [N, 1] for the graph's [N]", {"label": OUT["label"][:4].reshape(4, 1),
                                             "probabilities": OUT["probabilities"][:4]}, None),
    ("an output missing", {"label": OUT["label"][:4]}, "probabilities is missing"),
    ("another shape", {"label": OUT["label"][:3], "probabilities": OUT["probabilities"][:4]},
     "label has shape [3]"),
])
def test_mismatches(case: str, answered: dict[str, np.ndarray], found: str | None) -> None:
    problems = probe().mismatches(answered)
    if found is None:
        assert problems == [], case
    else:
        assert any(found in p for p in problems), (case, problems)


@pytest.mark.parametrize("bad", [None, {}, {"inputs": {"x": {"dtype": "<f4"}}, "outputs": {}},
                                 {"inputs": {"x": 1}, "outputs": {"y": 1}}])
def test_a_malformed_probe_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        GoldenProbe.from_dict(bad)
