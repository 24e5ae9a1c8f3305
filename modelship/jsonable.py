"""One way to make a value JSON-safe, for every report, record and ``--json`` document."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np


def jsonable(value: Any, *, nonfinite_as_text: bool = False) -> Any:
    """Plain JSON values: numpy scalars and arrays become Python ones, NaN and ±inf become
    None (JSON has none, and no data is never a number), paths and dates become strings,
    dataclasses and objects with ``to_dict()`` become dicts, anything else its ``str``.

    With ``nonfinite_as_text``, NaN and ±inf become ``"nan"``, ``"inf"`` and ``"-inf"``
    instead: where the value itself is the finding (a data check that observed a NaN)."""
    def inner(item: Any) -> Any:
        return jsonable(item, nonfinite_as_text=nonfinite_as_text)

    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float | np.floating):
        if math.isfinite(value):
            return float(value)
        return str(float(value)) if nonfinite_as_text else None
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    if isinstance(value, np.ndarray):
        return inner(value.tolist())
    if isinstance(value, Enum):
        return inner(value.value)
    if isinstance(value, Mapping):
        return {str(k): inner(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [inner(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return inner(to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return inner(dataclasses.asdict(value))
    return str(value)
