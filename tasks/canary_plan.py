"""The canary's plan (pure): what it will load, which rules it judges, the load's shape, how
long each measurement round runs and when the rounds stop, and how the measurement is
judged. :func:`tasks.canary.run_canary` is the executor: it asks this module what to do
next, does it on the canary Triton, and records what came back (the shape of
:mod:`modelship.triton.swap_plan` with :mod:`tasks.swap`).

- :func:`plan_canary`: the versions (``[P, C]``, or ``[C]`` on a first release; on a GPU
  canary P alone first so the rise of memory tells the footprints apart), the rules
  judged and those skipped with the reason, the fixed gates' α when the sequential watch
  spends its share, the warm-up and the measurement load.
- :func:`next_round`: the next measurement round's load, or None to stop. The first round
  runs until the windows are stable, for at most ``_STABILITY_SHARE`` of the budget (a
  stable round keeps only its stable windows; a round that ends unstable keeps everything
  after the warm-up); later rounds are sized from the observed throughput until each arm
  has the requests the gates need (:func:`tasks.canary_sizing.required_samples`, floored
  at ``canary.min_samples``) or ``canary.max_duration_s`` is spent. With the sequential
  watch every round is one look of ``canary.sequential_round_s``.
- :func:`watch_stops` and :func:`enough_samples`: the stop rules after a round.
- :func:`judge_measured`: the gates on the snapshot, minus the watched rules after an early
  pass, plus the watch's own line (:func:`with_sequential`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from modelship.loadgen import LoadReport, LoadSpec, RequestRecord
from modelship.measurements import CanarySnapshot
from modelship.policy import GPU_METRICS, CanaryPolicy, GateRule, Policy
from tasks.agreement import BASELINE, CANDIDATE
from tasks.canary_sizing import SEQUENTIAL_SHARE, required_samples, spend_alpha, watched
from tasks.gate_report import GateReport, RuleResult, Verdict, combine
from tasks.gates import evaluate
from tasks.sequential import SequentialCanary, SequentialDecision

__all__ = ["CanaryPlan", "Measured", "broken_canary", "enough_samples", "gpu_rules_skipped",
           "is_comparative", "judge_measured", "load_spec", "load_summary", "next_round",
           "next_round_s", "ok_by_arm", "plan_canary", "shortfall", "watch_look",
           "watch_stops", "with_sequential"]

_MIN_ROUND_S = 0.5

#: The share of the remaining budget the stability round may use (at least 4 windows).
_STABILITY_SHARE = 0.4

_ROUND_MARGIN = 1.2

_COMPARATIVE_METRICS = frozenset({"agreement", "throughput_ratio", "server_latency_ratio",
                                  "gpu_memory_growth_pct"})



@dataclass(frozen=True)
class CanaryPlan:
    """What one canary will do, decided before it touches the canary Triton.

    Attributes:
        model: Model name.
        candidate: The version under test (C).
        baseline: The production version (P), or None on a first release.
        canary: The policy's canary section: load shape, budget, floor, agreement.
        on_gpu: Whether the canary server has GPUs (``nv_gpu_*`` metrics).
        judged: The rules the gates judge, at their own α (what the load is sized for).
        fixed: The same rules as the fixed-horizon gates judge them: with the sequential
            watch on, each watched rule keeps the α the watch leaves (:func:`spend_alpha`).
        skipped: Rules not judged: comparative ones on a first release, GPU ones on a CPU
            canary.
        notes: Why they were skipped, in words, for the report.
        spec: The measurement load (no warm-up of its own; keeps outputs when paired, for
            the agreement).
        warmup: The warm-up round's load, or None when ``canary.warmup_s`` is 0.
    """

    model: str
    candidate: int
    baseline: int | None
    canary: CanaryPolicy
    on_gpu: bool
    judged: tuple[GateRule, ...]
    fixed: tuple[GateRule, ...]
    skipped: tuple[str, ...]
    notes: tuple[str, ...]
    spec: LoadSpec
    warmup: LoadSpec | None

    @property
    def paired(self) -> bool:
        """Whether every row goes to both versions (there is a baseline)."""
        return self.baseline is not None

    @property
    def versions(self) -> list[int]:
        """The versions loaded side by side on the canary, the baseline first."""
        return [v for v in (self.baseline, self.candidate) if v is not None]

    @property
    def footprints_first(self) -> bool:
        """Load P alone first (a GPU canary with a baseline): the rise of GPU memory then
        tells P's footprint from C's."""
        return self.on_gpu and self.baseline is not None

    @property
    def sequential(self) -> bool:
        """Whether the sequential watch looks after every round (on, and paired)."""
        return self.canary.sequential and self.paired

    @property
    def share(self) -> float:
        """The share of each watched rule's α the sequential watch spends (0 without it)."""
        return SEQUENTIAL_SHARE if self.sequential else 0.0

    def samples_needed(self, records: Sequence[RequestRecord]) -> int:
        """Answered requests per version the gates need, sized from ``records`` so far."""
        return required_samples(self.judged, records, paired=self.paired,
                                floor=self.canary.min_samples, share=self.share)

    def reference_ms(self, records: Sequence[RequestRecord]) -> np.ndarray | None:
        """The sequential watch's latency reference: the baseline's answered warm-up
        requests, or None without any."""
        reference = np.asarray([r.latency_ms for r in records
                                if r.ok and r.tag == BASELINE], dtype=float)
        return reference if reference.size else None


def plan_canary(policy: Policy, *, model: str, candidate: int, baseline: int | None,
                on_gpu: bool, server_name: str, timeout_s: float) -> CanaryPlan:
    """The plan of one canary from the policy (pure).

    Args:
        policy: The model's policy: ``canary`` and ``gates``.
        model: Model name.
        candidate: The version under test.
        baseline: The production version, or None on a first release.
        on_gpu: Whether the canary server reports GPUs.
        server_name: The canary server's name, for the notes.
        timeout_s: Per-request timeout of the load, in s.
    """
    canary = policy.canary
    rules = list(policy.gates)
    first = [] if baseline is not None else [r.name for r in rules if is_comparative(r)]
    no_gpu = [n for n in gpu_rules_skipped(rules, on_gpu=on_gpu) if n not in first]
    skipped = first + no_gpu
    judged = [r for r in rules if r.name not in skipped]
    # With the sequential watch on, it spends a fifth of each watched rule's α and the
    # fixed tests the rest: the family-wise α of the rule set is spent once.
    fixed = spend_alpha(judged) if canary.sequential and baseline is not None else judged
    notes = []
    if first:
        notes.append(f"first release of {model}: no baseline, so the comparative rules "
                     f"({', '.join(first)}) were not judged")
    if no_gpu:
        notes.append(f"the canary {server_name} reports no GPU (no nv_gpu_* metrics: a CPU "
                     f"server), so the rules on GPU metrics ({', '.join(no_gpu)}) were not "
                     "judged")
    spec = load_spec(canary, timeout_s=timeout_s, keep_outputs=baseline is not None)
    warmup = (replace(spec, duration_s=canary.warmup_s, keep_outputs=False,
                      window_s=min(spec.window_s, canary.warmup_s))
              if canary.warmup_s > 0 else None)
    return CanaryPlan(model=model, candidate=candidate, baseline=baseline, canary=canary,
                      on_gpu=on_gpu, judged=tuple(judged), fixed=tuple(fixed),
                      skipped=tuple(skipped), notes=tuple(notes), spec=spec, warmup=warmup)


def load_spec(canary: CanaryPolicy, *, timeout_s: float, keep_outputs: bool) -> LoadSpec:
    """The load shape of the policy, without a warm-up (the canary runs its own first)."""
    return LoadSpec(
        protocol=canary.protocol,
        concurrency=canary.concurrency if canary.mode == "concurrency" else None,
        rate_rps=canary.rate_rps if canary.mode == "rate" else None,
        arrival="poisson" if canary.poisson else "constant",
        warmup_s=0.0,
        window_s=canary.window_s,
        stability_pct=canary.stability_pct,
        max_duration_s=canary.max_duration_s,
        timeout_s=timeout_s,
        keep_outputs=keep_outputs,
    )


def next_round_s(*, missing: int, ok_per_s: float, remaining_s: float,
                 min_round_s: float = _MIN_ROUND_S) -> float | None:
    """How long the next measurement round should run, in s, or None to stop.

    Sized from the observed per-arm rate of answered requests with a margin; never past
    the remaining budget, and no round shorter than ``min_round_s`` (its figures would be
    noise). None when nothing is missing, nothing was answered, or time is up.
    """
    if missing <= 0 or ok_per_s <= 0 or remaining_s < min_round_s:
        return None
    return min(max(missing / ok_per_s * _ROUND_MARGIN, min_round_s), remaining_s)


def is_comparative(rule: GateRule) -> bool:
    """Whether a rule needs a baseline: latency tests against it, agreement, throughput,
    the server-side latency ratio."""
    return rule.test in ("mann_whitney", "quantile") or rule.metric in _COMPARATIVE_METRICS


def gpu_rules_skipped(rules: Sequence[GateRule], *, on_gpu: bool) -> list[str]:
    """Names of the rules on GPU metrics, when the canary has no GPU to measure (pure)."""
    return [] if on_gpu else [r.name for r in rules if r.metric in GPU_METRICS]


# --------------------------------------------------------------------------- the rounds


@dataclass
class Measured:
    """What the measurement rounds collected so far.

    Attributes:
        records: Every measured request, on one timeline (each round shifted after the
            previous ones: the gates split the run into time blocks by these send times).
        measured_s: Measured time so far, in s.
        rounds: One summary per round: mode, duration, requests, errors, stability.
        stable: Whether the first round's windows became stable.
        required: Answered requests per version the gates need (re-sized after each round).
        decision: The sequential watch's last decision, or None without the watch.
    """

    records: list[RequestRecord] = field(default_factory=list)
    measured_s: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)
    stable: bool | None = None
    required: int = 1
    decision: SequentialDecision | None = None

    def add(self, report: LoadReport, mode: str) -> list[RequestRecord]:
        """Record one round's load report; returns the round's measured records."""
        measured = report.measured_records()
        offset = self.measured_s
        # the first round is on the timeline as it is; later ones are shifted copies (the
        # round's own records keep their clock), built directly, not by dataclasses.replace
        self.records.extend(measured if offset == 0 else _shifted(measured, offset))
        self.measured_s += report.duration_s
        if mode == "stability":
            self.stable = report.stable
        self.rounds.append({"mode": mode, "duration_s": round(report.duration_s, 3),
                            "sent_s": round(report.measured_to_s, 3),
                            "requests": report.requests, "errors": report.errors,
                            "stable": report.stable})
        return measured


def _shifted(records: Sequence[RequestRecord], offset: float) -> list[RequestRecord]:
    """Copies of ``records`` sent ``offset`` s later (pure)."""
    return [RequestRecord(r.start_s + offset, r.latency_ms, r.ok, r.error, r.server,
                          r.model_version, r.row, r.tag, r.outputs) for r in records]


def round_mode(plan: CanaryPlan, measured: Measured) -> str:
    """``sequential`` (one look of the watch), ``stability`` (the first round) or ``sized``."""
    if plan.sequential:
        return "sequential"
    return "sized" if measured.rounds else "stability"


def next_round(plan: CanaryPlan, measured: Measured, remaining_s: float) -> LoadSpec | None:
    """The next measurement round's load, or None to stop (pure).

    ``remaining_s`` is what is left of ``canary.max_duration_s`` (loading excluded).
    """
    spec = plan.spec
    mode = round_mode(plan, measured)
    if mode == "sequential":
        round_s = plan.canary.sequential_round_s
        if remaining_s < min(round_s, _MIN_ROUND_S):
            return None
        look_s = min(round_s, remaining_s)
        return replace(spec, duration_s=look_s, window_s=min(spec.window_s, look_s),
                       max_duration_s=max(look_s, spec.max_duration_s))
    if mode == "stability":
        if remaining_s < min(spec.window_s, _MIN_ROUND_S):
            return None
        cap_s = max(_STABILITY_SHARE * remaining_s, spec.warmup_s + 4 * spec.window_s)
        return replace(spec, max_duration_s=max(min(remaining_s, cap_s), _MIN_ROUND_S))
    ok = ok_by_arm(measured.records, plan.paired)
    missing = measured.required - min(ok.values())
    rate = min(ok.values()) / measured.measured_s if measured.measured_s > 0 else 0.0
    duration_s = next_round_s(missing=missing, ok_per_s=rate, remaining_s=remaining_s)
    if duration_s is None:
        return None
    return replace(spec, duration_s=duration_s, window_s=min(spec.window_s, duration_s),
                   max_duration_s=max(duration_s, spec.max_duration_s))


def watch_stops(plan: CanaryPlan, measured: Measured) -> bool:
    """Whether the sequential watch's last look ends the rounds (pure): it is certain of a
    regression, or that both arms fail alike, or, once each arm has ``canary.min_samples``
    answers, that the candidate is clearly within tolerance."""
    decision = measured.decision
    if decision is None:
        return False
    counts = ok_by_arm(measured.records, plan.paired)
    return decision.status in ("failed", "inconclusive") or (
        decision.status == "passed" and min(counts.values()) >= plan.canary.min_samples)


def enough_samples(plan: CanaryPlan, measured: Measured) -> bool:
    """Whether each arm has the answered requests the gates need (pure)."""
    return min(ok_by_arm(measured.records, plan.paired).values()) >= measured.required


def ok_by_arm(records: Sequence[RequestRecord], paired: bool) -> dict[str, int]:
    """Answered requests per arm (pure)."""
    counts = {CANDIDATE: 0, **({BASELINE: 0} if paired else {})}
    for r in records:
        if r.ok:
            arm = r.tag or CANDIDATE
            counts[arm] = counts.get(arm, 0) + 1
    return counts


def watch_look(watch: SequentialCanary, records: Sequence[RequestRecord]) -> SequentialDecision:
    """One look: the round's answers of each arm, in completion order, and its errors."""
    arms: dict[str, list[float]] = {BASELINE: [], CANDIDATE: []}
    errors = {BASELINE: 0, CANDIDATE: 0}
    failed: dict[str, list[bool]] = {BASELINE: [], CANDIDATE: []}
    for r in sorted(records, key=lambda rec: rec.start_s):
        arm = r.tag or CANDIDATE
        failed[arm].append(not r.ok)
        if r.ok:
            arms[arm].append(r.latency_ms)
        else:
            errors[arm] += 1
    return watch.update(np.asarray(arms[BASELINE]), np.asarray(arms[CANDIDATE]),
                        baseline_errors=errors[BASELINE], candidate_errors=errors[CANDIDATE],
                        baseline_failed=np.asarray(failed[BASELINE], dtype=bool),
                        candidate_failed=np.asarray(failed[CANDIDATE], dtype=bool))


# --------------------------------------------------------------------------- the judgement


def shortfall(plan: CanaryPlan, measured: Measured) -> str | None:
    """A note when the budget ran out before the gates had their samples (pure)."""
    counts = ok_by_arm(measured.records, plan.paired)
    if min(counts.values()) >= measured.required:
        return None
    return (f"only {min(counts.values())} answered requests per version within "
            f"{plan.canary.max_duration_s:g} s; the gates wanted {measured.required}")


def judge_measured(plan: CanaryPlan, measured: Measured, snapshot: CanarySnapshot
                   ) -> GateReport:
    """The gates' report on what was measured (pure).

    An early pass of the sequential watch showed every watched rule within its tolerance
    (confidence sequences): those rules are not judged again on a sample smaller than
    their plan, the others are, at the policy's floor. The watch's decision is one more
    line (:func:`with_sequential`).
    """
    counts = ok_by_arm(measured.records, plan.paired)
    decision = measured.decision
    early_pass = decision is not None and decision.status == "passed" \
        and min(counts.values()) < measured.required
    report = evaluate(snapshot, [r for r in plan.fixed if not (early_pass and watched(r))],
                      min_samples=plan.canary.min_samples if early_pass else measured.required)
    return with_sequential(report, decision) if decision is not None else report


def load_summary(plan: CanaryPlan, measured: Measured, *, url: str, payload_rows: int,
                 payload_source: str) -> dict[str, Any]:
    """The ``load`` document of the result: shape, rounds, samples against the plan."""
    canary = plan.canary
    counts = ok_by_arm(measured.records, plan.paired)
    decision = measured.decision
    return {
        "sequential": decision.to_dict() if decision is not None else None,
        "protocol": canary.protocol,
        "mode": canary.mode,
        "concurrency": canary.concurrency if canary.mode == "concurrency" else None,
        "rate_rps": canary.rate_rps if canary.mode == "rate" else None,
        "paired": plan.paired,
        "warmup_s": canary.warmup_s,
        "measured_s": round(measured.measured_s, 3),
        "stable": measured.stable,
        "rounds": measured.rounds,
        "required_samples": measured.required,
        "samples": counts,
        "enough_samples": min(counts.values()) >= measured.required,
        "payload_rows": payload_rows,
        "payload_source": payload_source,
        "url": url,
    }


def with_sequential(report: GateReport, decision: SequentialDecision) -> GateReport:
    """The gate report with the sequential watch's verdict as one more blocking rule (pure).

    ``failed`` (a regression certain at every look) fails the canary whatever the
    fixed-horizon rules say with the samples collected so far; ``inconclusive`` (both arms
    failing alike) is raised by the caller; ``passed`` and ``continue`` add a passing or
    inconclusive line that the fixed-horizon rules then decide with.
    """
    verdict = {"failed": Verdict.FAILED, "passed": Verdict.PASSED,
               "inconclusive": Verdict.INCONCLUSIVE}.get(decision.status, Verdict.PASSED)
    details = decision.to_dict()
    if decision.status == "inconclusive":
        details["infrastructure"] = True
    result = RuleResult(
        rule="sequential", metric="latency and errors", test="sequential", verdict=verdict,
        value=None, baseline=None, threshold="always-valid e-value ≥ rules/α",
        threshold_value=None, p_value=None, samples=decision.samples, dry_run=False,
        message=f"sequential: {decision.status}: {decision.reason}", details=details)
    results = (*report.results, result)
    return GateReport(combine(results), results, report.required_samples)


def broken_canary(records: Sequence[RequestRecord], paired: bool) -> str | None:
    """Why the load says the canary itself is broken, or None (pure).

    Every measured request failed, on both arms when paired (on the one arm otherwise):
    whatever the candidate is, nothing was judged. The first error names the cause.
    """
    if not records:
        return "no request was sent during the measurement"
    if any(r.ok for r in records):
        return None
    arms = {r.tag or CANDIDATE for r in records}
    if paired and arms != {BASELINE, CANDIDATE}:
        return None
    first = next((r.error for r in records if r.error), "unknown error")
    return (f"all {len(records)} measured requests failed on "
            f"{'both arms' if paired else 'the candidate'} (first error: {first})")
