"""What a load run is asked to do: the targets and the load's shape (pure, no I/O).

Kept apart from the engine so that the CLI, the canary and the bake can build and
validate a spec (and the arrival gaps can be table-tested) without an event loop.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from modelship.errors import UsageError

Protocol_ = Literal["grpc", "http"]
Arrival = Literal["constant", "poisson"]


@dataclass(frozen=True)
class Target:
    """Where one stream of requests goes.

    Attributes:
        url: ``host:port`` (gRPC) or ``http://host:port`` (HTTP); a scheme is tolerated
            for gRPC and added for HTTP.
        model: Triton model name.
        version: Explicit version, or ``""`` for Triton's choice (highest ready).
    """

    url: str
    model: str
    version: str = ""


@dataclass(frozen=True)
class LoadSpec:
    """How to load the targets. Exactly one of ``concurrency`` and ``rate_rps``.

    Attributes:
        protocol: ``grpc`` (default, fastest) or ``http``.
        concurrency: Closed-loop workers (pairs in paired mode).
        rate_rps: Open-loop arrivals per second (pairs per second in paired mode).
        arrival: ``constant`` gaps or ``poisson`` (exponential gaps) in rate mode.
        max_outstanding: In-flight bound in rate mode, so a slow server cannot make the
            client open requests without limit.
        batch_size: Rows per request, taken cyclically from the payload.
        warmup_s: Seconds before measurement starts (connections, caches, batcher).
        window_s: Length of one measurement window, in seconds.
        stability_pct: Allowed deviation of each of the last ``stable_windows`` windows
            from their mean, for throughput and p95 latency, in percent.
        stable_windows: How many consecutive windows must agree (perf_analyzer uses 3).
        max_duration_s: Give up on stability after this many seconds, warm-up included,
            and report ``stable: false``.
        duration_s: Fixed-duration mode when set: run this long (warm-up included), keep
            every record, apply no stability rule.
        timeout_s: Per-request timeout, in seconds.
        seed: Seed of the Poisson arrivals.
        keep_outputs: Keep each answer's output arrays on its record (the canary compares
            the two arms' outputs); costs client CPU, so off for plain load.
    """

    protocol: Protocol_ = "grpc"
    concurrency: int | None = None
    rate_rps: float | None = None
    arrival: Arrival = "constant"
    max_outstanding: int = 256
    batch_size: int = 1
    warmup_s: float = 1.0
    window_s: float = 2.0
    stability_pct: float = 10.0
    stable_windows: int = 3
    max_duration_s: float = 60.0
    duration_s: float | None = None
    timeout_s: float = 10.0
    seed: int = 0
    keep_outputs: bool = False

    @property
    def mode(self) -> str:
        """``concurrency`` or ``rate``."""
        return "rate" if self.rate_rps is not None else "concurrency"

    def validate(self) -> None:
        """Refuse a spec that cannot describe a bounded run.

        Raises:
            UsageError: Both or neither load shapes, or a non-positive size or duration.
        """
        if (self.concurrency is None) == (self.rate_rps is None):
            raise UsageError(
                "give exactly one of concurrency and rate_rps",
                hint="Use --concurrency C for a closed loop or --rate R for an open loop",
            )
        if self.concurrency is not None and self.concurrency < 1:
            raise UsageError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate_rps is not None and not (self.rate_rps > 0 and math.isfinite(self.rate_rps)):
            raise UsageError(f"rate_rps must be a positive number, got {self.rate_rps}")
        if self.protocol not in ("grpc", "http"):
            raise UsageError(f"protocol must be grpc or http, got {self.protocol!r}")
        if self.arrival not in ("constant", "poisson"):
            raise UsageError(f"arrival must be constant or poisson, got {self.arrival!r}")
        positive = {
            "max_outstanding": self.max_outstanding,
            "batch_size": self.batch_size,
            "window_s": self.window_s,
            "max_duration_s": self.max_duration_s,
            "timeout_s": self.timeout_s,
            "stable_windows": self.stable_windows,
        }
        if self.duration_s is not None:
            positive["duration_s"] = self.duration_s
        for name, value in positive.items():
            if not value > 0:
                raise UsageError(f"{name} must be > 0, got {value}")
        if self.warmup_s < 0 or self.stability_pct < 0:
            raise UsageError("warmup_s and stability_pct must be >= 0")


def arrival_gaps_s(spec: LoadSpec, rng: random.Random) -> Callable[[], float]:
    """Seconds to the next arrival: constant ``1/rate`` or exponential with that mean."""
    rate = float(spec.rate_rps or 1.0)
    if spec.arrival == "poisson":
        return lambda: rng.expovariate(rate)
    return lambda: 1.0 / rate
