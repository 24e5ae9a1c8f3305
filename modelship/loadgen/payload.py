"""Which payload rows each request carries (pure).

Request ``i`` takes the next ``batch_size`` rows, cyclically, so every transport can
build each distinct request once and the canary knows which row a record answered.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from modelship.errors import UsageError


def check_payload(payload: Mapping[str, np.ndarray]) -> int:
    """Number of rows of a payload whose arrays share a leading row dimension.

    Raises:
        UsageError: No inputs, a scalar, or arrays with different row counts.
    """
    if not payload:
        raise UsageError("the payload has no input arrays")
    rows = {
        name: np.asarray(a).shape[0] if np.asarray(a).ndim else 0 for name, a in payload.items()
    }
    counts = set(rows.values())
    if len(counts) != 1 or 0 in counts:
        raise UsageError(
            f"payload arrays need one shared, non-empty leading row dimension, got {rows}"
        )
    return counts.pop()


def request_rows(request_index: int, batch_size: int, n_rows: int) -> list[int]:
    """Payload rows of the ``request_index``-th request: the next ``batch_size`` rows,
    wrapping around the payload."""
    first = request_index * batch_size
    return [(first + j) % n_rows for j in range(batch_size)]


def distinct_requests(batch_size: int, n_rows: int) -> int:
    """How many requests before the row sequence repeats."""
    return n_rows // math.gcd(n_rows, batch_size)
