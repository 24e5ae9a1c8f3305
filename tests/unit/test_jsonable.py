"""The one way to make a value JSON-safe (modelship.jsonable), and its NaN-as-text form for
data checks, whose observed NaN is the finding."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.jsonable import jsonable


class Color(Enum):
    RED = "red"


@dataclass
class Point:
    x: float
    y: np.float32


@pytest.mark.parametrize(("value", "plain", "as_text"), [
    (None, None, None),
    (True, True, True),
    (3, 3, 3),
    (np.int64(7), 7, 7),
    (np.bool_(True), True, True),
    (1.5, 1.5, 1.5),
    (np.float32(0.5), 0.5, 0.5),
    (math.nan, None, "nan"),
    (np.float64(math.inf), None, "inf"),
    (-math.inf, None, "-inf"),
    (np.array([1.0, math.nan]), [1.0, None], [1.0, "nan"]),
    ({"a": (1, math.nan)}, {"a": [1, None]}, {"a": [1, "nan"]}),
    ({1: {2}}, {"1": [2]}, {"1": [2]}),
    (b"caf\xc3\xa9", "café", "café"),
    (Color.RED, "red", "red"),
    (datetime(2026, 12, 3, 1, 2, 3, tzinfo=UTC), "2026-12-03T01:02:03+00:00",
     "2026-12-03T01:02:03+00:00"),
    (Path("/a/b"), "/a/b", "/a/b"),
    (Point(1.0, np.float32(math.nan)), {"x": 1.0, "y": None}, {"x": 1.0, "y": "nan"}),
    (object, str(object), str(object)),
])
def test_values_become_plain_json(value: Any, plain: Any, as_text: Any) -> None:
    assert jsonable(value) == plain
    assert jsonable(value, nonfinite_as_text=True) == as_text
    json.dumps(jsonable(value), allow_nan=False)  # strict JSON: no NaN survives
    json.dumps(jsonable(value, nonfinite_as_text=True), allow_nan=False)


def test_an_object_with_to_dict_becomes_its_dict() -> None:
    class Report:
        def to_dict(self) -> dict[str, Any]:
            return {"p99": np.float64(math.nan)}

    assert jsonable(Report()) == {"p99": None}
    assert jsonable(Report(), nonfinite_as_text=True) == {"p99": "nan"}
