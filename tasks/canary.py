"""Stage 5, canary: the candidate C next to the baseline P on the canary Triton, same inputs.

As Kayenta does, C is judged against a baseline running at the same time on the same
server, not against history: both versions are loaded side by side
(``version_policy: specific [P, C]``, C's staged config) and addressed explicitly as
``/versions/N``, and every golden row goes to both, back-to-back, alternating which goes
first (:func:`modelship.loadgen.run_paired`). On a first release there is no P: C is loaded
alone and only the absolute gates apply.

The run, in order, all inside one ``try`` whose ``finally`` unloads the canary model:

1. **Load** ``[P, C]`` (or ``[C]``) with a full-config override over gRPC and wait until
   every version is READY.
2. **Warm up** for ``canary.warmup_s`` (records discarded), then **scrape** Triton's
   metrics, so the server-side figures cover exactly the measured load.
3. **Measure** in rounds: the first runs until the windows are stable, for at most
   ``_STABILITY_SHARE`` of the budget (a stable round keeps only its stable windows, so a
   round that settled late on a busy machine threw most of its samples away and left too
   little time to collect them again: the gates came back inconclusive; a round that ends
   unstable keeps everything after the warm-up, paired like the rest); later rounds are
   sized from the observed throughput until each arm has the sample size the gates need
   (:func:`tasks.gates.plan_samples`, floored at ``canary.min_samples``) or
   ``canary.max_duration_s`` (warm-up included) is spent. Too few samples is not hidden:
   the gates then say inconclusive.
4. **Scrape** again; per-version deltas give the mean queue and compute µs per request
   (counter resets and vanished series handled in :mod:`modelship.triton.metrics`).

   **GPU evidence**, when the canary exports ``nv_gpu_*`` gauges (a GPU server; see
   :mod:`modelship.triton.gpu`): a scrape before anything loads, P loaded alone first
   (then scraped), then ``[P, C]`` (scraped again), so the rises of used memory are P's and
   C's footprints; the per-second scrapes during the load give utilization and peak
   memory. ``gpu_memory_growth_pct`` and friends become gate metrics, and C's bytes go to
   the swap's headroom preflight. On a CPU canary none of this happens: the load order is
   unchanged and rules on GPU metrics are skipped with a note, never failed.
5. **Agreement**: for the same row, the candidate's answer against the baseline's (top-1
   label for classifiers, ``|c - b| <= abs_tol + rel_tol * |b|`` for regressors).
6. **Judge** the :class:`~modelship.measurements.CanarySnapshot` with the pure gates and
   write the report (markdown, PNG, JSON; a Prefect artifact inside a flow run).
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from modelship.clients import Clients
from modelship.errors import GatesInconclusive, InfrastructureError, ModelshipError, UsageError
from modelship.jsonable import jsonable
from modelship.loadgen import LoadReport, LoadSpec, RequestRecord, Target, run_load, run_paired
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import (
    GPU_METRICS,
    AgreementPolicy,
    CanaryPolicy,
    ExactRateRule,
    GateRule,
    MannWhitneyRule,
    Policy,
    QuantileRule,
)
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.triton.client import TritonServer
from modelship.triton.gpu import GpuEvidence, GpuSample, canary_gpu_evidence, fleet_target
from modelship.triton.metrics import Scrape
from modelship.triton.target import render_for_servers
from tasks.canary_slot import in_canary_slot
from tasks.sequential import SequentialCanary, SequentialConfig, SequentialDecision, WatchRule

if TYPE_CHECKING:  # tasks.gates imports scipy: loaded where the canary judges, not at import
    from tasks.gates import GateReport


BASELINE, CANDIDATE = "baseline", "candidate"
_READY_POLL_S = 0.2
_UNLOAD_WAIT_S = 15.0
_BUSY_STATES = frozenset({"READY", "LOADING", "UNLOADING"})
_MIN_ROUND_S = 0.5
#: The share of the remaining budget the stability round may use (at least 4 windows).
_STABILITY_SHARE = 0.4
_ROUND_MARGIN = 1.2
_SCRAPE_PERIOD_S = 1.0
_COMPARATIVE_METRICS = frozenset({"agreement", "throughput_ratio", "server_latency_ratio",
                                  "gpu_memory_growth_pct"})


#: ``CanaryResult.cleanup`` when ``run_canary(keep_loaded=True)`` left the versions loaded.
KEPT_LOADED = "kept loaded"


# --------------------------------------------------------------------------- results


@dataclass
class CanaryResult:
    """What a canary measured and decided; ``to_dict()`` is the ``--json`` document.

    Attributes:
        model: Model name.
        candidate: The version under test.
        baseline: The production version it ran against, or None on a first release.
        verdict: The gates' combined verdict (``passed``, ``inconclusive``, ``error`` or
            ``failed``).
        snapshot: The measurements the gates judged.
        gate_report: The gates' report (:class:`tasks.gates.GateReport`).
        load: Summary of the load: shape, rounds, samples reached against required.
        seconds: Wall time of the whole canary, load and unload included, in s.
        report_paths: Where the markdown, PNG and JSON report were written.
        cleanup: ``unloaded``, or why the canary model could not be unloaded.
        skipped_rules: Comparative rules not judged on a first release (no baseline), and
            rules on GPU metrics on a canary without GPUs.
        gpu: The canary GPU's evidence (footprints of P and C, utilization under load);
            None on a CPU canary.
    """

    model: str
    candidate: int
    baseline: int | None
    verdict: str
    snapshot: CanarySnapshot
    gate_report: Any
    load: dict[str, Any]
    seconds: float = 0.0
    report_paths: dict[str, str] = field(default_factory=dict)
    cleanup: str = "pending"
    skipped_rules: list[str] = field(default_factory=list)
    gpu: GpuEvidence | None = None

    @property
    def candidate_bytes(self) -> int | None:
        """C's GPU footprint measured on the canary, bytes per GPU (the swap's headroom
        preflight uses it); None on a CPU canary or when the rise was not measured."""
        return self.gpu.candidate_bytes if self.gpu is not None else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the verdict first, then the evidence."""
        return {
            "model": self.model,
            "candidate": self.candidate,
            "baseline": self.baseline,
            "verdict": self.verdict,
            "gates": self.gate_report.to_dict(),
            "skipped_rules": self.skipped_rules,
            "snapshot": jsonable(self.snapshot.to_dict()),
            "load": self.load,
            "report": self.report_paths,
            "cleanup": self.cleanup,
            "seconds": round(self.seconds, 3),
            "gpu": jsonable(self.gpu.to_dict()) if self.gpu is not None else None,
            "candidate_bytes": self.candidate_bytes,
        }


# --------------------------------------------------------------------------- agreement (pure)


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


# --------------------------------------------------------------------------- load plan (pure)


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


# --------------------------------------------------------------------------- I/O steps


@dataclass
class _Measured:
    records: list[RequestRecord] = field(default_factory=list)
    measured_s: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)
    stable: bool | None = None
    required: int = 1
    decision: SequentialDecision | None = None


def _wait_ready(server: TritonServer, model: str, versions: Sequence[int],
                deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    pending = [str(v) for v in versions]
    while pending:
        pending = [v for v in pending if not server.is_model_ready(model, v)]
        if not pending:
            return
        if time.monotonic() > end:
            raise InfrastructureError(
                f"{model} versions {', '.join(pending)} did not become ready on the canary "
                f"{server.name} within {deadline_s:g} s",
                hint="see the canary Triton log; the staged files may be incomplete",
                model=model, versions=pending,
            )
        time.sleep(_READY_POLL_S)


def _unload(server: TritonServer, model: str, progress: Progress) -> str:
    """Unload the canary model and wait until no version of it is left; never raises.

    Waits through ``UNLOADING`` too (about a second here), so that the next canary of the
    same model does not race a half-unloaded one.
    """
    try:
        server.unload_model(model)
        end = time.monotonic() + _UNLOAD_WAIT_S
        while True:
            left = sorted({str(m.get("state")) for m in server.repository_index()
                           if m.get("name") == model and m.get("state") in _BUSY_STATES})
            if not left:
                return "unloaded"
            if time.monotonic() > end:
                return f"still {'/'.join(left)} {_UNLOAD_WAIT_S:g} s after the unload"
            time.sleep(_READY_POLL_S)
    except Exception as exc:  # noqa: BLE001 - cleanup reports, the caller's error wins
        progress(f"canary cleanup: could not unload {model}: {exc}")
        return f"unload failed: {exc}"


def _run(coro: Any) -> LoadReport:
    result: LoadReport = asyncio.run(coro)
    return result


def _load_once(url: str, model: str, candidate: int, baseline: int | None,
               payload: Mapping[str, np.ndarray], spec: LoadSpec) -> LoadReport:
    if baseline is None:
        return _run(run_load([url], model, payload, spec, version=str(candidate)))
    return _run(run_paired(Target(url, model, str(baseline)), Target(url, model, str(candidate)),
                           payload, spec, tags=(BASELINE, CANDIDATE)))


def _ok_by_arm(records: Sequence[RequestRecord], paired: bool) -> dict[str, int]:
    counts = {CANDIDATE: 0, **({BASELINE: 0} if paired else {})}
    for r in records:
        if r.ok:
            arm = r.tag or CANDIDATE
            counts[arm] = counts.get(arm, 0) + 1
    return counts


SEQUENTIAL_SHARE = 0.2
"""Share of each watched rule's α that the sequential watch spends; the fixed test gets the
rest, so the rule set's family-wise α (:func:`tasks.gates.family_alpha`) is spent once. A
fifth: the watch is for clear regressions, which it stops at any level. The fixed test at
80% of α runs on a plan grown by :func:`watch_plan_factor` (:func:`plan_rules`), so it
alone catches at least as often as the watch-off test wherever that one catches half the
time: a candidate at 2× the error budget is caught at least as often with the watch on
(bench/judge.py, ``errors_2x_*``)."""

_QUANTILES = {"latency_p50_ms": 0.5, "latency_mean_ms": 0.5, "latency_p90_ms": 0.9,
              "latency_p95_ms": 0.95, "latency_p99_ms": 0.99}


def watched(rule: GateRule) -> TypeGuard[MannWhitneyRule | QuantileRule | ExactRateRule]:
    """Whether the sequential watch judges a rule too (blocking latency and error rules)."""
    return not rule.dry_run and rule.test in ("mann_whitney", "quantile", "exact_rate")


def sequential_config(rules: Sequence[GateRule], *,
                      share: float = SEQUENTIAL_SHARE) -> SequentialConfig:
    """The sequential watch's rules from the policy's gates (pure): one per watched rule,
    with its own tolerance, effect and power, and ``share`` of its α.

    Latency rules watch their quantile (0.5 for p50 and mean) within ``max_increase_pct``;
    ``effect`` (default: the tolerance itself) centres the regression prior, and
    ``power`` sets the early pass: a rule is shown within tolerance when its confidence
    sequence at ``power`` excludes everything beyond it, so a candidate exactly at the
    tolerance passes early at most ``1 - power`` of the time. The scalar fields summarise
    (smallest tolerance and budget, total α) for messages and older callers.
    """
    base = SequentialConfig()
    watch: list[WatchRule] = []
    for rule in (r for r in rules if watched(r)):
        if rule.test == "exact_rate":
            budget = float(rule.max_rate or 0.0)
            effect = float(rule.effect if rule.effect is not None else budget or 1e-3)
            watch.append(WatchRule(rule.name, "errors", budget, rule.alpha * share,
                                   rule.power, effect))
        else:
            pct = float(rule.max_increase_pct or base.max_increase_pct)
            watch.append(WatchRule(rule.name, "latency", pct, rule.alpha * share, rule.power,
                                   float(rule.effect if rule.effect is not None else pct),
                                   _QUANTILES.get(rule.metric, 0.5)))
    latency = [w for w in watch if w.kind == "latency"]
    errors = [w for w in watch if w.kind == "errors"]
    return SequentialConfig(
        alpha=sum(w.alpha for w in watch) if watch else base.alpha,
        max_increase_pct=min([w.tolerance for w in latency] or [base.max_increase_pct]),
        max_error_rate=min([w.tolerance for w in errors] or [base.max_error_rate]),
        rules=tuple(watch),
    )


def spend_alpha(rules: Sequence[GateRule], *, share: float = SEQUENTIAL_SHARE
                ) -> list[GateRule]:
    """The fixed gates when the sequential watch runs too (pure): every watched rule keeps
    ``1 - share`` of its α (the watch spends the rest), so the family-wise α is spent once.
    The canary plans its load for them with :func:`plan_rules` (``share``), so the fixed
    tests lose no power to the watch."""
    return [r.model_copy(update={"alpha": r.alpha * (1.0 - share)}) if watched(r) else r
            for r in rules]


def _feed(watch: SequentialCanary, records: Sequence[RequestRecord]) -> SequentialDecision:
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


def _measure(url: str, model: str, candidate: int, baseline: int | None,
             payload: Mapping[str, np.ndarray], spec: LoadSpec, *,
             plan: Callable[[Sequence[RequestRecord]], int], required: int,
             deadline: float, progress: Progress, watch: SequentialCanary | None = None,
             round_s: float = 1.0, floor: int = 1) -> _Measured:
    """Measurement rounds until each arm has the answers the gates need or time is up.

    ``required`` is the first estimate; after each round ``plan`` re-sizes it from the
    records measured so far (the baseline's real latency spread replaces the assumption).
    With a sequential ``watch``, every round lasts ``round_s`` and is one look: the rounds
    stop as soon as the watch is certain of a regression (or that both arms fail alike),
    or, once each arm has ``floor`` answers, that the candidate is clearly fine.
    """
    out = _Measured(required=required)
    paired = baseline is not None
    first = watch is None
    while True:
        remaining_s = deadline - time.monotonic()
        if watch is not None:
            if remaining_s < min(round_s, _MIN_ROUND_S):
                break
            look_s = min(round_s, remaining_s)
            round_spec = replace(spec, duration_s=look_s, window_s=min(spec.window_s, look_s),
                                 max_duration_s=max(look_s, spec.max_duration_s))
        elif first:
            if remaining_s < min(spec.window_s, _MIN_ROUND_S):
                break
            cap_s = max(_STABILITY_SHARE * remaining_s, spec.warmup_s + 4 * spec.window_s)
            round_spec = replace(spec, max_duration_s=max(min(remaining_s, cap_s),
                                                          _MIN_ROUND_S))
        else:
            ok = _ok_by_arm(out.records, paired)
            missing = out.required - min(ok.values())
            rate = min(ok.values()) / out.measured_s if out.measured_s > 0 else 0.0
            duration_s = next_round_s(missing=missing, ok_per_s=rate, remaining_s=remaining_s)
            if duration_s is None:
                break
            round_spec = replace(spec, duration_s=duration_s,
                                 window_s=min(spec.window_s, duration_s),
                                 max_duration_s=max(duration_s, spec.max_duration_s))
        report = _load_once(url, model, candidate, baseline, payload, round_spec)
        measured = report.measured_records()
        # One timeline across rounds (each round's clock starts at 0): the gates split the
        # run into time blocks by these send times.
        offset = out.measured_s
        out.records.extend(replace(r, start_s=r.start_s + offset) for r in measured)
        out.measured_s += report.duration_s
        if first:
            out.stable = report.stable
        out.rounds.append({"mode": "sequential" if watch is not None
                           else "stability" if first else "sized",
                           "duration_s": round(report.duration_s, 3),
                           "requests": report.requests, "errors": report.errors,
                           "stable": report.stable})
        counts = _ok_by_arm(out.records, paired)
        if report.requests > 0 and not any(r.ok for r in measured):
            # Nothing answered in a whole round: more rounds only burn the budget; the
            # caller diagnoses why (dead server, broken inputs) before judging anything.
            out.rounds[-1]["answered"] = 0
            progress(f"canary round {len(out.rounds)}: none of {report.requests} requests "
                     "was answered; stopping the load")
            break
        out.required = max(plan(out.records), 1)
        progress(f"canary round {len(out.rounds)}: {report.duration_s:.1f} s, answered "
                 + ", ".join(f"{arm} {n}" for arm, n in sorted(counts.items()))
                 + f" (need {out.required} each)")
        first = False
        if watch is not None and paired:
            out.decision = _feed(watch, measured)
            status = out.decision.status
            if status in ("failed", "inconclusive") or (
                    status == "passed" and min(counts.values()) >= floor):
                progress(f"sequential watch: {status} after {len(out.rounds)} looks: "
                         f"{out.decision.reason}")
                break
        if min(counts.values()) >= out.required:
            break
    return out


def _arm(version: int, records: Sequence[RequestRecord], measured_s: float,
         server: dict[str, Any] | None) -> ArmMeasurements:
    """One arm's measurements, with the send time of every request (the gates' blocks).

    The rounds' clocks each start at 0; :func:`_measure` shifts each round after the
    previous ones, so the send times form one timeline."""
    ok = [r.latency_ms for r in records if r.ok]
    return ArmMeasurements(
        latency_s=np.asarray([r.start_s for r in records if r.ok], dtype=float),
        error_s=np.asarray([r.start_s for r in records if not r.ok], dtype=float),
        version=version,
        latency_ms=np.asarray(ok, dtype=float),
        requests=len(records),
        errors=sum(1 for r in records if not r.ok),
        throughput_rps=len(ok) / measured_s if measured_s > 0 else None,
        queue_us_mean=server.get("queue_us_mean") if server else None,
        compute_us_mean=server.get("compute_us_mean") if server else None,
    )


def _metrics_text(server: TritonServer, timeout_s: float, notes: list[str], when: str
                  ) -> str | None:
    """Triton's metrics text for the GPU evidence, or None with a note saying when."""
    from modelship.triton.metrics import scrape_text

    try:
        return scrape_text(server.endpoint.metrics, timeout_s)
    except ModelshipError as exc:
        notes.append(f"could not read Triton's metrics {when} ({exc.message}); GPU figures "
                     "are missing")
        return None


def gpu_rules_skipped(rules: Sequence[GateRule], *, on_gpu: bool) -> list[str]:
    """Names of the rules on GPU metrics, when the canary has no GPU to measure (pure)."""
    return [] if on_gpu else [r.name for r in rules if r.metric in GPU_METRICS]


def _scrape(server: TritonServer, timeout_s: float, notes: list[str]) -> Scrape | None:
    """Triton's metrics, or None with a note: server-side figures are extra evidence, and
    their absence makes the rules that use them inconclusive rather than the canary fail."""
    from modelship.triton.metrics import scrape

    try:
        return scrape(server.endpoint.metrics, timeout_s)
    except ModelshipError as exc:
        notes.append(f"could not read Triton's metrics ({exc.message}); server-side figures "
                     "are missing")
        return None


class _MetricsTicker:
    """Scrapes Triton's metrics every ``period_s`` in a thread while the load runs.

    Each pair of consecutive scrapes is one interval of the server-side test
    (:func:`tasks.gates._judge_server_ratio`); a failed scrape only makes an interval
    longer, never a figure up.
    """

    def __init__(self, server: TritonServer, timeout_s: float, period_s: float) -> None:
        self.scrapes: list[Scrape] = []
        self.gpus: list[dict[str, GpuSample]] = []
        self.failures = 0
        self._server = server
        self._timeout_s = timeout_s
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="canary-metrics", daemon=True)

    def _run(self) -> None:
        from modelship.triton.gpu import parse_gpu_metrics
        from modelship.triton.metrics import parse_metrics, scrape_text

        while not self._stop.wait(self._period_s):
            try:
                text = scrape_text(self._server.endpoint.metrics, self._timeout_s)
            except ModelshipError:
                self.failures += 1
                continue
            self.scrapes.append(parse_metrics(text))
            gpus = parse_gpu_metrics(text)
            if gpus:
                self.gpus.append(gpus)

    def __enter__(self) -> _MetricsTicker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self._timeout_s + self._period_s)


def server_intervals(scrapes: Sequence[Scrape | None], model: str,
                     versions: Mapping[str, int]) -> list[dict[str, dict[str, float]]]:
    """Per interval between consecutive scrapes, each arm's queue + compute µs and answers.

    Pure. Intervals where a version's counters restarted or its series vanished are left
    out (their difference is not a measurement of the interval).
    """
    from modelship.triton.metrics import (
        COMPUTE_INFER_US,
        COMPUTE_INPUT_US,
        COMPUTE_OUTPUT_US,
        QUEUE_US,
        delta,
    )

    kept = [s for s in scrapes if s is not None]
    out: list[dict[str, dict[str, float]]] = []
    for before, after in zip(kept, kept[1:], strict=False):
        changes = delta(before, after)
        interval: dict[str, dict[str, float]] = {}
        for arm, version in versions.items():
            change = changes.get((model, str(version)))
            if change is None or change.resets or change.new:
                break
            us = sum(change.counters.get(n, 0.0) for n in (QUEUE_US, COMPUTE_INPUT_US,
                                                           COMPUTE_INFER_US, COMPUTE_OUTPUT_US))
            interval[arm] = {"us": us, "n": change.requests}
        else:
            out.append(interval)
    return out


def _server_side(before: Scrape | None, after: Scrape | None, model: str,
                 versions: Mapping[str, int],
                 notes: list[str]) -> dict[str, dict[str, Any] | None]:
    from modelship.triton.metrics import delta

    if before is None or after is None:
        return {arm: None for arm in versions}
    changes = delta(before, after)
    out: dict[str, dict[str, Any] | None] = {}
    for arm, version in versions.items():
        change = changes.get((model, str(version)))
        if change is None:
            notes.append(f"Triton reported no metrics for {model}/{version} after the load "
                         "(the series vanished: unloaded or reloaded?); server-side figures "
                         "are missing for the " + arm)
            out[arm] = None
            continue
        if change.resets:
            notes.append(f"Triton's counters of {model}/{version} restarted during the load "
                         f"({', '.join(change.resets)}); server-side figures cover only the "
                         "time since the restart")
        out[arm] = jsonable(change.to_dict())
    return out


def watch_plan_factor(alpha: float, share: float) -> float:
    """Sample-size factor of a watched rule's fixed test when the watch spends ``share`` of
    its α: ``(z_{(1-share)α} / z_α)²`` (1 without a watch).

    Why this and not the plan at the smaller α: under the normal approximation the fixed
    test's power is ``Φ(δ a - z)`` with ``a ∝ √n``. With ``a_on = a_off · z_on / z_α``
    the watch-on margin is the watch-off margin scaled by ``z_on / z_α > 1``:
    ``δ a_on - z_on = (z_on / z_α)(δ a_off - z_α)``, so wherever the watch-off test catches
    a candidate at least half the time, the watch-on fixed test alone catches it at least
    as often, and the watch's own early failures only add. (Sizing at the smaller α for
    the rule's ``effect`` keeps the power there only: below it, e.g. at 2× the error
    budget, the watch-on canary was caught less often.) The factor is ≥ the ratio of the
    plans at the two α, so the rule's stated power at its effect holds too.
    """
    if not 0 < share < 1 or not 0 < alpha < 0.5:
        return 1.0
    z_off = NormalDist().inv_cdf(1.0 - alpha)
    z_on = NormalDist().inv_cdf(1.0 - alpha * (1.0 - share))
    return (z_on / z_off) ** 2


def plan_rules(rules: Sequence[GateRule], *, baseline_latency_ms: np.ndarray | None,
               baseline_error_rate: float, floor: int, share: float = 0.0) -> int:
    """Requests per version the canary runs for (pure): the max over blocking rules of
    :func:`tasks.gates.required_samples` at the rule's own α, times
    :func:`watch_plan_factor` for the watched rules when the sequential watch spends
    ``share`` of their α (``rules`` are the policy's, not :func:`spend_alpha`'s)."""
    from tasks.gates import required_samples as rule_samples
    from tasks.gates import tail_reference_floor

    sizes = [floor]
    for rule in rules:
        if rule.dry_run:
            continue
        n = rule_samples(rule, baseline_latency_ms=baseline_latency_ms,
                         baseline_error_rate=baseline_error_rate, floors=False)
        if share and watched(rule):  # the power plan grows, not the floors
            grown = math.ceil(n * watch_plan_factor(rule.alpha, share))
            if rule.test == "exact_rate":
                grown = _rate_dominance_n(float(rule.max_rate or 0.0), rule.alpha, share, n,
                                          grown)
            n = grown
        sizes.append(max(n, tail_reference_floor(rule)))
    return int(max(sizes))


@functools.lru_cache(maxsize=256)
def _rate_dominance_n(max_rate: float, alpha: float, share: float, n_off: int,
                      start: int) -> int:
    """The exact binomial test's own version of :func:`watch_plan_factor` (pure).

    Errors are few, so the normal approximation misjudges the exact test's tail: the
    smallest n from ``start`` up (steps of 1%) at which the test at ``(1 - share) α``
    has at least the power of the test at ``α`` with ``n_off`` at every error rate where
    the latter catches half the candidates or more (up to 99.9%)."""
    from scipy import stats

    if not 0 < max_rate < 1:
        return start

    def power(n: int, level: float, rates: np.ndarray) -> np.ndarray:
        # tasks.gates.rate_power's critical count, vectorised over the rates
        c = int(stats.binom.isf(level, n, max_rate))
        c = c if stats.binom.sf(c, n, max_rate) < level else c + 1
        return np.asarray(stats.binom.sf(c, n, rates), dtype=float)

    rates = max_rate * np.exp(np.linspace(0.0, math.log(min(50.0, 0.5 / max_rate)), 400))[1:]
    off = power(n_off, alpha, rates)
    keep = (off >= 0.5) & (off <= 0.999)
    n = start
    for _ in range(60):
        if np.all(power(n, alpha * (1.0 - share), rates[keep]) >= off[keep]):
            return n
        n = math.ceil(n * 1.01)
    return n


def required_samples(rules: Sequence[GateRule], records: Sequence[RequestRecord], *,
                     paired: bool, floor: int, share: float = 0.0) -> int:
    """Answered requests per version the gates need, sized from what was measured so far.

    The latency tests are sized from the baseline's own latencies (the candidate's on a
    first release), the error-rate test from the baseline's error rate; without records
    the gates' lognormal default applies. Never below the policy's ``floor``. With the
    sequential watch on (``share`` > 0), watched rules plan for their fixed test at the α
    the watch leaves (:func:`plan_rules`).
    """
    arm = BASELINE if paired else None
    own = [r for r in records if r.tag == arm]
    latency = np.asarray([r.latency_ms for r in own if r.ok], dtype=float)
    error_rate = sum(1 for r in own if not r.ok) / len(own) if own and paired else 0.0
    return plan_rules(rules, baseline_latency_ms=latency if latency.size >= 2 else None,
                      baseline_error_rate=error_rate, floor=floor, share=share)


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


def _check_alive(server: TritonServer, where: str) -> None:
    """Raise when the canary Triton stopped answering: never blame the candidate."""
    try:
        server.ping()
    except ModelshipError as exc:
        raise InfrastructureError(
            f"the {where} stopped answering during the canary: {exc.message}",
            hint="the candidate was not judged; restart the canary Triton (`modelship stack "
                 "up`, or check its pod) and run the canary again",
            endpoint=server.endpoint.grpc, reason="canary server down",
        ) from exc


def tail_reference_refusal(report: GateReport) -> str | None:
    """Why a blocking quantile rule refused to judge (too few baseline requests above its
    quantile), when that is what keeps the gates from a verdict; None otherwise (pure).

    A failed verdict stands: a refusal never hides a rule that failed.
    """
    if str(report.verdict) == "failed":
        return None
    for result in report.results:
        if result.details.get("reference_too_small") and not result.dry_run:
            return str(result.message)
    return None


def shared_errors(report: GateReport) -> str | None:
    """The message of a blocking rule that found both arms failing alike (see tasks.gates),
    or None (pure)."""
    for result in report.results:
        if result.details.get("infrastructure") and not result.dry_run:
            return str(result.message)
    return None


def _note_cleanup(exc: BaseException, cleanup: str) -> None:
    """Attach the cleanup outcome to an error on its way out; say so when it failed."""
    if isinstance(exc, ModelshipError):
        exc.details["cleanup"] = cleanup
        if cleanup not in ("unloaded", "not loaded"):
            exc.message = f"{exc.message.rstrip('.')}; cleanup: {cleanup}"


def with_sequential(report: GateReport, decision: SequentialDecision) -> GateReport:
    """The gate report with the sequential watch's verdict as one more blocking rule (pure).

    ``failed`` (a regression certain at every look) fails the canary whatever the
    fixed-horizon rules say with the samples collected so far; ``inconclusive`` (both arms
    failing alike) is raised by the caller; ``passed`` and ``continue`` add a passing or
    inconclusive line that the fixed-horizon rules then decide with.
    """
    from tasks.gates import GateReport, RuleResult, Verdict, combine

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


def _report_dir(settings: Settings, model: str, candidate: int) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model)
    return Path(settings.home) / "reports" / f"canary-{safe}-v{candidate}-{stamp}"


# --------------------------------------------------------------------------- the stage


@in_canary_slot  # one canary at a time on the canary Triton (issue 18; owner: locks)
def run_canary(settings: Settings, clients: Clients, policy: Policy, *, model: str,
               candidate: int, baseline: int | None,
               progress: Progress = quiet, report_dir: Path | None = None,
               keep_loaded: bool = False) -> CanaryResult:
    """Run the canary of ``candidate`` against ``baseline`` and judge it with the gates.

    Args:
        settings: Timeouts and the home folder (reports go to ``home/reports/`` by default).
        clients: ``canary`` (the Triton it runs on), ``storage`` (staged configs) and, for
            golden rows, ``registry``.
        policy: The model's policy: ``canary`` (load shape, budget, agreement) and ``gates``.
        model: Model name (Triton and MLflow).
        candidate: The staged version under test.
        baseline: The production version, staged; None on a first release.
        progress: Receives one line per step, for the CLI's stderr.
        report_dir: Where the report goes; default ``home/reports/canary-MODEL-vC-STAMP``.

    Returns:
        The result; its ``verdict`` is the gates' verdict (``passed``, ``failed``,
        ``inconclusive``, or ``error`` when a rule's test broke). A failed gate is not
        raised here: the caller decides (``GateFailed``/``GatesInconclusive`` in the flow).

    An infrastructure failure is never a gate failure: it is raised, never returned as a
    verdict. The candidate is unloaded on every path (also when the load call itself
    raised, since a timed-out load may still complete on the server), and a failed
    cleanup is added to the error's message and ``details["cleanup"]``. With
    ``keep_loaded`` (a release that waits for an approval: the watcher keeps probing the
    candidate), a measurement that completed leaves both versions loaded (``cleanup`` is
    ``kept loaded``) and the caller must unload them on every path after it, this
    function raising included (:func:`tasks.approve.canary_cleanup`); a failure before the
    measurement completed still unloads here.

    Raises:
        UsageError: No canary Triton or S3 repository is configured, or baseline == candidate.
        ModelNotFound: The candidate or the baseline is not staged.
        StagingError: A staged version fails its manifest.
        InfrastructureError: The canary could not load or serve the versions: the load call
            raised or timed out, the canary Triton stopped answering, or every measured
            request failed on both arms (exit 1).
        GatesInconclusive: Both arms fail alike above the error budget while the server
            answers (a shared cause: inputs, the load path); the candidate cannot be told
            apart from the baseline (exit 6).
    """
    from modelship.repository import staged_config, verify_staged
    from modelship.triton.model_config import to_json, with_versions
    from tasks.gates import evaluate
    from tasks.payload import load_payload
    from tasks.report import publish_markdown_artifact, write_canary_report

    started = time.monotonic()
    server, storage = clients.canary, clients.storage
    if server is None or storage is None:
        raise UsageError("the canary needs a canary Triton and the S3 repository",
                         hint="run `modelship stack up`, or set MODELSHIP_TRITON_CANARY and "
                              "MODELSHIP_S3_ENDPOINT")
    if baseline == candidate:
        raise UsageError(f"{model} v{candidate} is already the production version",
                         hint="a canary compares a new version against production")
    canary = policy.canary
    versions = [v for v in (baseline, candidate) if v is not None]
    for version in versions:
        verify_staged(storage, model=model, version=version,
                      repository_prefix=settings.repository_prefix)
    config = with_versions(staged_config(storage, repository_prefix=settings.repository_prefix,
                                         model=model, version=candidate), versions)
    payload, source = load_payload(storage, clients.registry,
                                   repository_prefix=settings.repository_prefix, model=model,
                                   version=candidate, rows=policy.export.golden_max_rows)
    rules = list(policy.gates)
    notes: list[str] = []
    empty_text = _metrics_text(server, settings.http_timeout_s, notes, "before the load")
    on_gpu = empty_text is not None and fleet_target(empty_text) == "gpu"
    # The staged config in the canary's form (CPU derivation of a GPU config on a CPU canary)
    config, _ = render_for_servers(config, [server], timeout_s=settings.http_timeout_s,
                                   texts={server.name: empty_text})
    skipped = [] if baseline is not None else [r.name for r in rules if is_comparative(r)]
    no_gpu = [n for n in gpu_rules_skipped(rules, on_gpu=on_gpu) if n not in skipped]
    skipped += no_gpu
    judged = [r for r in rules if r.name not in skipped]
    # With the sequential watch on, it spends a fifth of each watched rule's α and the
    # fixed tests the rest: the family-wise α of the rule set is spent once.
    fixed = spend_alpha(judged) if canary.sequential and baseline is not None else judged
    paired = baseline is not None
    url = server.endpoint.grpc if canary.protocol == "grpc" else server.endpoint.http
    spec = load_spec(canary, timeout_s=settings.http_timeout_s, keep_outputs=paired)
    if len(skipped) > len(no_gpu):
        notes.append(f"first release of {model}: no baseline, so the comparative rules "
                     f"({', '.join(n for n in skipped if n not in no_gpu)}) were not judged")
    if no_gpu:
        notes.append(f"the canary {server.name} reports no GPU (no nv_gpu_* metrics: a CPU "
                     f"server), so the rules on GPU metrics ({', '.join(no_gpu)}) were not "
                     "judged")
    baseline_text = both_text = None

    where = f"canary {server.name}"
    progress(f"loading {model} " + (f"v{baseline} (baseline) and " if paired else "")
             + f"v{candidate} (candidate) on the {where}")
    cleanup = "not loaded"
    try:
        # Set before the call: a load that times out on our side may still complete on the
        # server, so it must be unloaded too.
        cleanup = "load requested"
        if on_gpu and baseline is not None:
            # P alone first, so the rise of GPU memory tells P's footprint from C's.
            progress(f"GPU canary: loading v{baseline} alone first to measure footprints")
            server.load_model(model, config_json=to_json(with_versions(config, [baseline])))
            _wait_ready(server, model, [baseline], settings.control_timeout_s)
            baseline_text = _metrics_text(server, settings.http_timeout_s, notes,
                                          f"with v{baseline} loaded")
        server.load_model(model, config_json=to_json(config))
        cleanup = "loaded"
        _wait_ready(server, model, versions, settings.control_timeout_s)
        if on_gpu:
            both_text = _metrics_text(server, settings.http_timeout_s, notes,
                                      "with every version loaded")
        # Time spent loading does not count against the load budget.
        deadline = time.monotonic() + canary.max_duration_s
        warm_records: list[RequestRecord] = []
        if canary.warmup_s > 0:
            progress(f"warming up for {canary.warmup_s:g} s")
            warm = replace(spec, duration_s=canary.warmup_s, keep_outputs=False,
                           window_s=min(spec.window_s, canary.warmup_s))
            warm_records = _load_once(url, model, candidate, baseline, payload, warm).records

        share = SEQUENTIAL_SHARE if canary.sequential and paired else 0.0

        def plan(records: Sequence[RequestRecord]) -> int:
            return required_samples(judged, records, paired=paired, floor=canary.min_samples,
                                    share=share)

        first_plan = plan(warm_records)
        before = _scrape(server, settings.http_timeout_s, notes)
        progress(f"measuring until {first_plan} answered requests per version "
                 f"(at most {max(deadline - time.monotonic(), 0):.0f} s left)")
        watch = None
        if canary.sequential and paired:
            reference = np.asarray([r.latency_ms for r in warm_records
                                    if r.ok and r.tag == BASELINE], dtype=float)
            watch = SequentialCanary(sequential_config(judged),
                                     reference_ms=reference if reference.size else None)
        with _MetricsTicker(server, settings.http_timeout_s, _SCRAPE_PERIOD_S) as ticker:
            measured = _measure(url, model, candidate, baseline, payload, spec, plan=plan,
                                required=first_plan, deadline=deadline, progress=progress,
                                watch=watch, round_s=canary.sequential_round_s,
                                floor=canary.min_samples)
        after = _scrape(server, settings.http_timeout_s, notes)
        _check_alive(server, where)
        broken = broken_canary(measured.records, paired)
        if broken:
            raise InfrastructureError(
                f"the canary of {model} v{candidate} measured nothing: {broken}",
                hint="the candidate was not judged; check the canary Triton's log and the "
                     "golden inputs, then run the canary again",
                model=model, candidate=candidate, baseline=baseline, reason="no answers")
    except BaseException as exc:
        if cleanup != "not loaded":
            progress(f"unloading {model} from the {where}")
            cleanup = _unload(server, model, progress)
        _note_cleanup(exc, cleanup)
        if isinstance(exc, ModelshipError) or not isinstance(exc, OSError | TimeoutError):
            raise
        raise InfrastructureError(
            f"the canary of {model} v{candidate} broke: {type(exc).__name__}: {exc}",
            hint="the candidate was not judged; check the canary Triton and run again",
            model=model, candidate=candidate, cleanup=cleanup) from exc
    if keep_loaded:
        cleanup = KEPT_LOADED
        progress(f"keeping {model} loaded on the {where} for the approval wait")
    else:
        progress(f"unloading {model} from the {where}")
        cleanup = _unload(server, model, progress)
        if cleanup != "unloaded":
            notes.append(f"cleanup: {cleanup}; unload {model} from the {where} by hand")

    gpu = None
    if on_gpu and empty_text is not None and both_text is not None \
            and (baseline is None or baseline_text is not None):
        gpu = canary_gpu_evidence(empty_text, baseline_text, both_text,
                                  under_load=ticker.gpus)
    arms = {CANDIDATE: candidate, **({BASELINE: baseline} if baseline is not None else {})}
    server_side = _server_side(before, after, model, arms, notes)
    intervals = server_intervals([before, *ticker.scrapes, after], model, arms) \
        if baseline is not None else []
    if ticker.failures:
        notes.append(f"{ticker.failures} of Triton's metrics scrapes during the load failed; "
                     "the server-side intervals around them are longer")
    by_arm: dict[str, list[RequestRecord]] = {arm: [] for arm in arms}
    for record in measured.records:
        by_arm[record.tag or CANDIDATE].append(record)
    agreement, compared, kind = (compute_agreement(measured.records, canary.agreement)
                                 if paired else (None, 0, canary.agreement.kind))
    counts = _ok_by_arm(measured.records, paired)
    required = measured.required
    if min(counts.values()) < required:
        notes.append(f"only {min(counts.values())} answered requests per version within "
                     f"{canary.max_duration_s:g} s; the gates wanted {required}")
    snapshot = CanarySnapshot(
        model=model,
        candidate=_arm(candidate, by_arm[CANDIDATE], measured.measured_s,
                       server_side[CANDIDATE]),
        baseline=(_arm(baseline, by_arm[BASELINE], measured.measured_s, server_side[BASELINE])
                  if baseline is not None else None),
        agreement=agreement,
        agreement_samples=compared,
        agreement_kind=kind if kind != "auto" else "classifier",
        window_s=measured.measured_s,
        extra={"server_metrics": server_side, "server_intervals": intervals,
               "payload_source": source, "notes": notes,
               "gpu": gpu.metrics() if gpu is not None else None},
    )
    decision = measured.decision
    early_pass = decision is not None and decision.status == "passed" \
        and min(counts.values()) < required
    # An early pass showed every watched rule within its tolerance (confidence sequences):
    # those rules are not judged again on a sample smaller than their plan, the others are.
    gate_report = evaluate(snapshot, [r for r in fixed if not (early_pass and watched(r))],
                           min_samples=canary.min_samples if early_pass else required)
    if decision is not None:
        gate_report = with_sequential(gate_report, decision)
    refused = tail_reference_refusal(gate_report)
    if refused:
        raise UsageError(
            f"the canary of {model} v{candidate} cannot judge the tail: {refused}",
            hint="raise canary.min_samples (and canary.max_duration_s so the canary can reach "
                 "it), or judge a lower percentile",
            model=model, candidate=candidate, key="canary.min_samples", cleanup=cleanup)
    shared = shared_errors(gate_report)
    if shared:
        raise GatesInconclusive(
            f"the canary of {model} v{candidate} cannot tell the candidate from the "
            f"baseline: {shared}",
            hint="both versions fail alike, so the cause is shared (inputs, the canary "
                 "server, the load path); fix it and run the canary again",
            model=model, candidate=candidate, baseline=baseline, reason="shared errors",
            cleanup=cleanup)
    load = {
        "sequential": decision.to_dict() if decision is not None else None,
        "protocol": canary.protocol,
        "mode": canary.mode,
        "concurrency": canary.concurrency if canary.mode == "concurrency" else None,
        "rate_rps": canary.rate_rps if canary.mode == "rate" else None,
        "paired": paired,
        "warmup_s": canary.warmup_s,
        "measured_s": round(measured.measured_s, 3),
        "stable": measured.stable,
        "rounds": measured.rounds,
        "required_samples": required,
        "samples": counts,
        "enough_samples": min(counts.values()) >= required,
        "payload_rows": int(next(iter(payload.values())).shape[0]),
        "payload_source": source,
        "url": url,
    }
    result = CanaryResult(
        model=model, candidate=candidate, baseline=baseline,
        verdict=str(getattr(gate_report.verdict, "value", gate_report.verdict)),
        snapshot=snapshot, gate_report=gate_report, load=load, cleanup=cleanup,
        skipped_rules=skipped, gpu=gpu,
    )
    result.seconds = time.monotonic() - started
    paths = write_canary_report(result, report_dir or _report_dir(settings, model, candidate))
    result.report_paths = paths.to_dict()
    publish_markdown_artifact(Path(paths.markdown).read_text(encoding="utf-8"),
                              key=f"canary-{model}-v{candidate}")
    progress(f"canary of {model} v{candidate}: {result.verdict} "
             f"(report {paths.markdown})")
    return result
