"""The gates' verdicts as types: :class:`Verdict`, one rule's :class:`RuleResult`, the
stage's :class:`GateReport`, and :func:`combine` (worst-wins). Pure, and light to import:
the canary's result, the report writer, the ledger record and the CLI hold a
:class:`GateReport` without loading the tests of :mod:`tasks.gates`.

Questions a caller asks of a report live here too (:func:`tail_reference_refusal`,
:func:`shared_errors`), so they read typed fields and cannot silently miss a renamed one.
``GateReport.to_dict()`` is the ``gates`` document of ``canary --json``, of the ledger
record and of ``canary.json``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from modelship.jsonable import jsonable

__all__ = ["GateReport", "RuleResult", "Verdict", "combine", "shared_errors",
           "tail_reference_refusal"]


class Verdict(StrEnum):
    """Outcome of one rule or of the whole gate stage (argo-rollouts' analysis phases)."""

    PASSED = "passed"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"
    FAILED = "failed"

    @property
    def severity(self) -> int:
        """Rank for worst-wins: failed (3) beats error (2) beats inconclusive (1) beats passed."""
        return _SEVERITY[self]

    def worse(self, other: Verdict) -> Verdict:
        """The worse of two verdicts."""
        return other if other.severity > self.severity else self


_SEVERITY = {Verdict.PASSED: 0, Verdict.INCONCLUSIVE: 1, Verdict.ERROR: 2, Verdict.FAILED: 3}


@dataclass(frozen=True)
class RuleResult:
    """The verdict of one rule, with what it was based on.

    Attributes:
        rule: Rule name from the policy.
        metric: The metric judged (see ``modelship.policy.KNOWN_METRICS``).
        test: ``mann_whitney``, ``quantile``, ``exact_rate``, ``threshold`` (or
            ``sequential`` for the canary's always-valid watch, see tasks.canary).
        verdict: The rule's verdict.
        value: The candidate's measured value of the metric (None when unmeasured).
        baseline: The baseline's value of the metric, or None.
        threshold: The bound, for humans (``"≥ 0.98"``, ``"≤ 7.04 ms (…)"``).
        threshold_value: The bound as a number in the metric's unit, when it is one number.
        p_value: p-value of the deciding test (None for threshold rules).
        samples: Samples behind the verdict: (candidate, baseline or None).
        dry_run: Reported but never blocking.
        message: One sentence naming the rule, the measured value and the bound; for an
            inconclusive verdict, the likely cause.
        details: Test-specific figures (Hodges-Lehmann shift and its interval, per-route
            p-values), JSON-ready.
    """

    rule: str
    metric: str
    test: str
    verdict: Verdict
    value: float | None
    baseline: float | None
    threshold: str
    threshold_value: float | None
    p_value: float | None
    samples: tuple[int, int | None]
    dry_run: bool
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def blocking(self) -> bool:
        """Whether this result counts in :func:`combine` (dry-run rules never do)."""
        return not self.dry_run

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (NaN becomes None, so the document stays valid JSON)."""
        return {
            "rule": self.rule, "metric": self.metric, "test": self.test,
            "verdict": str(self.verdict), "value": _finite(self.value),
            "baseline": _finite(self.baseline), "threshold": self.threshold,
            "threshold_value": _finite(self.threshold_value), "p_value": _finite(self.p_value),
            "samples": {"candidate": self.samples[0], "baseline": self.samples[1]},
            "dry_run": self.dry_run, "message": self.message,
            "details": jsonable(self.details),
        }


@dataclass(frozen=True)
class GateReport:
    """The gate stage's outcome: the combined verdict and every rule's result.

    Attributes:
        verdict: Worst-wins over the blocking results (see :func:`combine`).
        results: One result per rule, in policy order, dry-run ones included.
        required_samples: Samples per version the rules need (:func:`plan_samples`, sized
            from the measured baseline), so a report can say when a canary ran too short.
        family_alpha: The family-wise false-fail rate of the blocking statistical rules
            (:func:`family_alpha`: Bonferroni, the sum of their α); None when there are none.
    """

    verdict: Verdict
    results: tuple[RuleResult, ...]
    required_samples: int
    family_alpha: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"verdict": str(self.verdict), "required_samples": self.required_samples,
                "family_alpha": self.family_alpha,
                "results": [r.to_dict() for r in self.results]}


def combine(results: Iterable[RuleResult | Verdict]) -> Verdict:
    """Worst-wins over the blocking results; nothing blocking means inconclusive.

    Dry-run results are skipped (they are reported, never block). An empty set, or one of
    dry-run rules only, is ``inconclusive``: no evidence is never a pass.
    """
    worst: Verdict | None = None
    for item in results:
        if isinstance(item, RuleResult):
            if item.dry_run:
                continue
            item = item.verdict
        worst = item if worst is None else worst.worse(item)
    return Verdict.INCONCLUSIVE if worst is None else worst


def tail_reference_refusal(report: GateReport) -> str | None:
    """Why a blocking quantile rule refused to judge (too few baseline requests above its
    quantile), when that is what keeps the gates from a verdict; None otherwise (pure).

    A failed verdict stands: a refusal never hides a rule that failed.
    """
    if report.verdict == Verdict.FAILED:
        return None
    for result in report.results:
        if result.details.get("reference_too_small") and not result.dry_run:
            return result.message
    return None


def shared_errors(report: GateReport) -> str | None:
    """The message of a blocking rule that found both arms failing alike (see tasks.gates),
    or None (pure)."""
    for result in report.results:
        if result.details.get("infrastructure") and not result.dry_run:
            return result.message
    return None


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None
