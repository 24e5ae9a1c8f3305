"""The short release policy of tests whose subject is not a stage's measurement.

What most release tests prove is a path (a crash's recovery, a night, a deploy, a journal,
an approval, a holdback), not the canary's statistics, the bake's watch or the batching
pause (test_canary, test_promote, test_bake_traffic and test_swap measure those). Their
releases keep every stage, each as short as it can be.
"""

from __future__ import annotations

from typing import Any

#: The cheapest canary: :data:`ERROR_GATE` needs only ``min_samples``, so the canary ends
#: after its first round (two 0.25-s windows, no warm-up). An exact-rate rule sized to catch
#: a few percent of errors needs 200 requests a version, up to its cap.
FIRST_ROUND_CANARY: dict[str, Any] = {"warmup_s": 0.0, "window_s": 0.25,
                                      "stability_pct": 100.0, "max_duration_s": 8.0,
                                      "min_samples": 20}
#: A deterministic gate: any error above 1 % fails the candidate.
ERROR_GATE: dict[str, Any] = {"name": "error_rate", "metric": "error_rate",
                              "test": "threshold", "max": 0.01}
#: A bake of one 1-s window on errors alone (a 1-s reference is below two windows, so no
#: latency rule applies).
ONE_WINDOW_BAKE: dict[str, Any] = {"duration_s": 1.0, "window_s": 1.0, "baseline_s": 1.0,
                                   "max_latency_increase_pct": 400.0}
#: The swap without the batching pause: one reload per replica, not three.
NO_PAUSE: dict[str, Any] = {"pause_batching": False}


def short_policy(*, canary: dict[str, Any] | None = None,
                 bake: dict[str, Any] | None = None,
                 swap: dict[str, Any] | None = NO_PAUSE,
                 **sections: Any) -> dict[str, Any]:
    """A release policy of :data:`FIRST_ROUND_CANARY` (with ``canary``'s keys over it),
    :data:`ERROR_GATE`, no bake unless ``bake`` is given, and the swap of ``swap`` (None:
    the policy's default, which pauses batching); ``sections`` add or replace whole
    sections (``gates``, ``approval``, ...)."""
    policy: dict[str, Any] = {"canary": {**FIRST_ROUND_CANARY, **(canary or {})},
                              "gates": [ERROR_GATE],
                              "bake": bake if bake is not None else {"duration_s": 0.0}}
    if swap is not None:
        policy["swap"] = swap
    return {**policy, **sections}
