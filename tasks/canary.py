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
   (:func:`tasks.canary_sizing.required_samples`, floored at ``canary.min_samples``) or
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

What to do is decided in pure code, :mod:`tasks.canary_plan` (the versions, the rules
judged, the load, the rounds and their stop rules, the judgement), with the sample sizes
of :mod:`tasks.canary_sizing` and the agreement of :mod:`tasks.agreement`; this module is
the executor that does it on the canary Triton and records what came back. Their public
names stay importable from here.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from modelship.candidate import ReleaseCandidate
from modelship.clients import Clients
from modelship.errors import GatesInconclusive, InfrastructureError, ModelshipError, UsageError
from modelship.jsonable import jsonable
from modelship.loadgen import LoadReport, LoadSpec, RequestRecord, Target, run_load, run_paired
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import Policy
from modelship.progress import Progress, quiet
from modelship.repository import staged_config, verify_staged
from modelship.settings import Settings
from modelship.storage import S3Storage
from modelship.triton.client import TritonServer
from modelship.triton.gpu import (
    GpuEvidence,
    GpuSample,
    canary_gpu_evidence,
    fleet_target,
    parse_gpu_metrics,
)
from modelship.triton.metrics import (
    COMPUTE_INFER_US,
    COMPUTE_INPUT_US,
    COMPUTE_OUTPUT_US,
    QUEUE_US,
    Scrape,
    delta,
    parse_metrics,
    scrape,
    scrape_text,
)
from modelship.triton.model_config import ModelConfig, from_pbtxt, to_json, with_versions
from modelship.triton.target import render_for_servers
from tasks.agreement import BASELINE, CANDIDATE, compute_agreement, rows_agree
from tasks.canary_plan import (
    CanaryPlan,
    Measured,
    broken_canary,
    enough_samples,
    gpu_rules_skipped,
    is_comparative,
    judge_measured,
    load_spec,
    load_summary,
    next_round,
    next_round_s,
    ok_by_arm,
    plan_canary,
    round_mode,
    shortfall,
    watch_look,
    watch_stops,
    with_sequential,
)
from tasks.canary_sizing import (
    SEQUENTIAL_SHARE,
    plan_rules,
    sequential_config,
    spend_alpha,
    watch_plan_factor,
    watched,
)
from tasks.canary_slot import in_canary_slot
from tasks.gate_report import GateReport, shared_errors, tail_reference_refusal
from tasks.payload import load_payload
from tasks.report import (
    PLOT_NAME,
    plot_latency_ecdf,
    prepare_plotting,
    publish_markdown_artifact,
    write_canary_report,
)
from tasks.sequential import SequentialCanary
from tasks.traffic_plan import not_carried_out

__all__ = [  # the stage, and the pure parts' public names as they were imported before
    "BASELINE", "CANDIDATE", "KEPT_LOADED", "SEQUENTIAL_SHARE", "CanaryResult",
    "broken_canary", "compute_agreement", "gpu_rules_skipped", "is_comparative",
    "load_spec", "next_round_s", "plan_rules", "rows_agree", "run_canary",
    "sequential_config", "server_intervals", "shared_errors", "spend_alpha",
    "tail_reference_refusal", "watch_plan_factor", "watched", "with_sequential",
    # the steps the shadow canary (tasks/shadow.py) shares with this one
    "canary_clients", "candidate_inputs", "new_report_dir", "publish", "unload_canary",
    "wait_ready",
]

_READY_POLL_S = 0.2
_UNLOAD_WAIT_S = 15.0
_BUSY_STATES = frozenset({"READY", "LOADING", "UNLOADING"})
_SCRAPE_PERIOD_S = 1.0


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
        gate_report: The gates' report (:class:`tasks.gate_report.GateReport`).
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
    gate_report: GateReport
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


# --------------------------------------------------------------------------- I/O steps


def wait_ready(server: TritonServer, model: str, versions: Sequence[int],
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


def unload_canary(server: TritonServer, model: str, progress: Progress) -> str:
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


def _arm(version: int, records: Sequence[RequestRecord], measured_s: float,
         server: dict[str, Any] | None) -> ArmMeasurements:
    """One arm's measurements, with the send time of every request (the gates' blocks).

    The rounds' clocks each start at 0; :meth:`tasks.canary_plan.Measured.add` shifts each
    round after the previous ones, so the send times form one timeline."""
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
    try:
        return scrape_text(server.endpoint.metrics, timeout_s)
    except ModelshipError as exc:
        notes.append(f"could not read Triton's metrics {when} ({exc.message}); GPU figures "
                     "are missing")
        return None


def _scrape(server: TritonServer, timeout_s: float, notes: list[str]) -> Scrape | None:
    """Triton's metrics, or None with a note: server-side figures are extra evidence, and
    their absence makes the rules that use them inconclusive rather than the canary fail."""
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


def _note_cleanup(exc: BaseException, cleanup: str) -> None:
    """Attach the cleanup outcome to an error on its way out; say so when it failed."""
    if isinstance(exc, ModelshipError):
        exc.details["cleanup"] = cleanup
        if cleanup not in ("unloaded", "not loaded"):
            exc.message = f"{exc.message.rstrip('.')}; cleanup: {cleanup}"


def new_report_dir(settings: Settings, model: str, candidate: int) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model)
    return Path(settings.home) / "reports" / f"canary-{safe}-v{candidate}-{stamp}"


# --------------------------------------------------------------------------- the executor


class _CanaryRun:
    """The executor of one :class:`~tasks.canary_plan.CanaryPlan`: does each step on the
    canary Triton and records what came back (the notes for the report, Triton's metrics
    around and during the load, and the cleanup state: ``not loaded``, ``load requested``,
    ``loaded``, then ``unloaded``, :data:`KEPT_LOADED` or why the unload failed)."""

    def __init__(self, settings: Settings, server: TritonServer, plan: CanaryPlan, *,
                 payload: Mapping[str, np.ndarray], notes: list[str],
                 empty_text: str | None, progress: Progress) -> None:
        self.settings, self.server, self.plan = settings, server, plan
        self.payload, self.notes, self.progress = payload, notes, progress
        self.url = server.endpoint.grpc if plan.spec.protocol == "grpc" else server.endpoint.http
        self.where = f"canary {server.name}"
        self.cleanup = "not loaded"
        self.empty_text = empty_text
        self.baseline_text: str | None = None
        self.both_text: str | None = None
        self.before: Scrape | None = None
        self.after: Scrape | None = None
        self.ticker = _MetricsTicker(server, settings.http_timeout_s, _SCRAPE_PERIOD_S)

    def measure(self, config: ModelConfig) -> Measured:
        """Load the versions, warm up and measure; on any failure unload, then raise.

        Raises:
            InfrastructureError: The load call raised or timed out, the canary Triton
                stopped answering, or every measured request failed.
        """
        plan = self.plan
        self.progress(f"loading {plan.model} " + (f"v{plan.baseline} (baseline) and "
                                                  if plan.paired else "")
                      + f"v{plan.candidate} (candidate) on the {self.where}")
        try:
            # Triton loads the versions (server-side, seconds) while this thread imports
            # what the report's plot needs: that import no longer waits on its own
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="canary-load") as pool:
                loading = pool.submit(self._load, config)
                try:
                    prepare_plotting()
                finally:
                    loading.result()
            measured = self._rounds()
            _check_alive(self.server, self.where)
            broken = broken_canary(measured.records, plan.paired)
            if broken:
                raise InfrastructureError(
                    f"the canary of {plan.model} v{plan.candidate} measured nothing: {broken}",
                    hint="the candidate was not judged; check the canary Triton's log and the "
                         "golden inputs, then run the canary again",
                    model=plan.model, candidate=plan.candidate, baseline=plan.baseline,
                    reason="no answers")
        except BaseException as exc:
            if self.cleanup != "not loaded":
                self.progress(f"unloading {plan.model} from the {self.where}")
                self.cleanup = unload_canary(self.server, plan.model, self.progress)
            _note_cleanup(exc, self.cleanup)
            if isinstance(exc, ModelshipError) or not isinstance(exc, OSError | TimeoutError):
                raise
            raise InfrastructureError(
                f"the canary of {plan.model} v{plan.candidate} broke: "
                f"{type(exc).__name__}: {exc}",
                hint="the candidate was not judged; check the canary Triton and run again",
                model=plan.model, candidate=plan.candidate, cleanup=self.cleanup) from exc
        return measured

    def _load(self, config: ModelConfig) -> None:
        """Load the plan's versions and wait until every one is READY."""
        plan, server, timeout_s = self.plan, self.server, self.settings.http_timeout_s
        # Set before the call: a load that times out on our side may still complete on the
        # server, so it must be unloaded too.
        self.cleanup = "load requested"
        if plan.on_gpu and plan.baseline is not None:
            # P alone first, so the rise of GPU memory tells P's footprint from C's.
            self.progress(f"GPU canary: loading v{plan.baseline} alone first to measure "
                          "footprints")
            server.load_model(plan.model,
                              config_json=to_json(with_versions(config, [plan.baseline])))
            wait_ready(server, plan.model, [plan.baseline], self.settings.control_timeout_s)
            self.baseline_text = _metrics_text(server, timeout_s, self.notes,
                                               f"with v{plan.baseline} loaded")
        server.load_model(plan.model, config_json=to_json(config))
        self.cleanup = "loaded"
        wait_ready(server, plan.model, plan.versions, self.settings.control_timeout_s)
        if plan.on_gpu:
            self.both_text = _metrics_text(server, timeout_s, self.notes,
                                           "with every version loaded")

    def _rounds(self) -> Measured:
        """Warm up, then the measurement rounds between two scrapes of Triton's metrics."""
        plan, timeout_s = self.plan, self.settings.http_timeout_s
        # Time spent loading does not count against the load budget.
        deadline = time.monotonic() + plan.canary.max_duration_s
        warm: list[RequestRecord] = []
        if plan.warmup is not None:
            self.progress(f"warming up for {plan.canary.warmup_s:g} s")
            warm = self._load_once(plan.warmup).records
        measured = Measured(required=plan.samples_needed(warm))
        self.before = _scrape(self.server, timeout_s, self.notes)
        self.progress(f"measuring until {measured.required} answered requests per version "
                      f"(at most {max(deadline - time.monotonic(), 0):.0f} s left)")
        watch = (SequentialCanary(sequential_config(plan.judged),
                                  reference_ms=plan.reference_ms(warm))
                 if plan.sequential else None)
        with self.ticker:
            self._measure(measured, watch, deadline)
        self.after = _scrape(self.server, timeout_s, self.notes)
        return measured

    def _load_once(self, spec: LoadSpec) -> LoadReport:
        plan = self.plan
        return _load_once(self.url, plan.model, plan.candidate, plan.baseline, self.payload,
                          spec)

    def _measure(self, measured: Measured, watch: SequentialCanary | None,
                 deadline: float) -> None:
        """Measurement rounds until each arm has the answers the gates need or time is up.

        After each round the plan re-sizes ``measured.required`` from the records so far
        (the baseline's real latency spread replaces the assumption). With a sequential
        ``watch`` every round is one look, and the rounds stop as soon as it is certain
        (:func:`tasks.canary_plan.watch_stops`).
        """
        plan = self.plan
        while (spec := next_round(plan, measured, deadline - time.monotonic())) is not None:
            mode = round_mode(plan, measured)
            report = self._load_once(spec)
            records = measured.add(report, mode)
            counts = ok_by_arm(measured.records, plan.paired)
            if report.requests > 0 and not any(r.ok for r in records):
                # Nothing answered in a whole round: more rounds only burn the budget; the
                # caller diagnoses why (dead server, broken inputs) before judging anything.
                measured.rounds[-1]["answered"] = 0
                self.progress(f"canary round {len(measured.rounds)}: none of "
                              f"{report.requests} requests was answered; stopping the load")
                return
            measured.required = max(plan.samples_needed(measured.records), 1)
            self.progress(f"canary round {len(measured.rounds)}: {report.duration_s:.1f} s, "
                          "answered " + ", ".join(f"{arm} {n}" for arm, n in
                                                  sorted(counts.items()))
                          + f" (need {measured.required} each)")
            if watch is not None:
                decision = measured.decision = watch_look(watch, records)
                if watch_stops(plan, measured):
                    self.progress(f"sequential watch: {decision.status} after "
                                  f"{len(measured.rounds)} looks: {decision.reason}")
                    return
            if enough_samples(plan, measured):
                return

    def release(self, keep_loaded: bool,
                while_unloading: Callable[[], object] = lambda: None) -> None:
        """After a measurement that completed: keep the versions loaded for the approval
        wait, or unload them (a failed unload is a note: unload by hand).
        ``while_unloading`` runs in this thread while the canary unloads (waiting on the
        server, about a second); when the versions stay loaded it simply runs."""
        model = self.plan.model
        if keep_loaded:
            self.cleanup = KEPT_LOADED
            self.progress(f"keeping {model} loaded on the {self.where} for the approval wait")
            while_unloading()
            return
        self.progress(f"unloading {model} from the {self.where}")
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="canary-unload") as pool:
            unloading = pool.submit(unload_canary, self.server, model, self.progress)
            try:
                while_unloading()
            finally:
                self.cleanup = unloading.result()  # unload_canary never raises
        if self.cleanup != "unloaded":
            self.notes.append(f"cleanup: {self.cleanup}; unload {model} from the {self.where} "
                              "by hand")

    def release_and_judge(self, measured: Measured, source: str, keep_loaded: bool, *,
                          plot: Path) -> tuple[GpuEvidence | None, CanarySnapshot, GateReport]:
        """:meth:`release` the versions and meanwhile (Triton unloads for a second or two)
        judge what was measured and draw the report's plot into ``plot``, unless the gates
        could not judge (the canary then raises and writes no report)."""
        judged: list[tuple[GpuEvidence | None, CanarySnapshot, GateReport]] = []

        def judge() -> None:
            gpu = self.gpu_evidence()
            snapshot = self.snapshot(measured, source, gpu)
            report = judge_measured(self.plan, measured, snapshot)
            judged.append((gpu, snapshot, report))
            if not (tail_reference_refusal(report) or shared_errors(report)):
                plot_latency_ecdf(snapshot, plot)

        self.release(keep_loaded, while_unloading=judge)
        return judged[0]

    def gpu_evidence(self) -> GpuEvidence | None:
        """The GPU footprints and utilization, when every scrape they need was read."""
        if not self.plan.on_gpu or self.empty_text is None or self.both_text is None \
                or (self.plan.baseline is not None and self.baseline_text is None):
            return None
        return canary_gpu_evidence(self.empty_text, self.baseline_text, self.both_text,
                                   under_load=self.ticker.gpus)

    def snapshot(self, measured: Measured, source: str,
                 gpu: GpuEvidence | None) -> CanarySnapshot:
        """What the gates judge: each arm's requests, Triton's server-side figures, the
        agreement of the paired answers, and the notes."""
        plan, notes, ticker = self.plan, self.notes, self.ticker
        arms = {CANDIDATE: plan.candidate,
                **({BASELINE: plan.baseline} if plan.baseline is not None else {})}
        server_side = _server_side(self.before, self.after, plan.model, arms, notes)
        intervals = server_intervals([self.before, *ticker.scrapes, self.after], plan.model,
                                     arms) if plan.paired else []
        if ticker.failures:
            notes.append(f"{ticker.failures} of Triton's metrics scrapes during the load "
                         "failed; the server-side intervals around them are longer")
        by_arm: dict[str, list[RequestRecord]] = {arm: [] for arm in arms}
        for record in measured.records:
            by_arm[record.tag or CANDIDATE].append(record)
        agreement, compared, kind = (compute_agreement(measured.records, plan.canary.agreement)
                                     if plan.paired else (None, 0, plan.canary.agreement.kind))
        short = shortfall(plan, measured)
        if short:
            notes.append(short)
        return CanarySnapshot(
            model=plan.model,
            candidate=_arm(plan.candidate, by_arm[CANDIDATE], measured.measured_s,
                           server_side[CANDIDATE]),
            baseline=(_arm(plan.baseline, by_arm[BASELINE], measured.measured_s,
                           server_side[BASELINE]) if plan.baseline is not None else None),
            agreement=agreement,
            agreement_samples=compared,
            agreement_kind=kind if kind != "auto" else "classifier",
            window_s=measured.measured_s,
            extra={"server_metrics": server_side, "server_intervals": intervals,
                   "payload_source": source, "notes": notes,
                   "gpu": gpu.metrics() if gpu is not None else None},
        )


def canary_clients(clients: Clients, model: str, candidate: int,
                    baseline: int | None) -> tuple[TritonServer, S3Storage]:
    """The canary Triton and the repository, or a usage error saying what is missing."""
    server, storage = clients.canary, clients.storage
    if server is None or storage is None:
        raise UsageError("the canary needs a canary Triton and the S3 repository",
                         hint="run `modelship stack up`, or set MODELSHIP_TRITON_CANARY and "
                              "MODELSHIP_S3_ENDPOINT")
    if baseline == candidate:
        raise UsageError(f"{model} v{candidate} is already the production version",
                         hint="a canary compares a new version against production")
    return server, storage


def candidate_inputs(settings: Settings, clients: Clients, storage: S3Storage, *,
                      policy: Policy, model: str, candidate: int, baseline: int | None,
                      release: ReleaseCandidate | None = None
                      ) -> tuple[ModelConfig, dict[str, np.ndarray], str]:
    """Both versions verified as staged, C's staged config for ``[P, C]``, and the rows
    to replay (the golden inputs, else rows shaped by the config) with their source.

    With ``release`` (a promotion, which staged C itself) C's config and rows are the
    release's own: neither S3 nor MLflow is read again for C."""
    versions = [v for v in (baseline, candidate) if v is not None]
    if release is not None:
        if baseline is not None:
            verify_staged(storage, model=model, version=baseline,
                          repository_prefix=settings.repository_prefix)
        return (with_versions(from_pbtxt(release.config_pbtxt), versions), release.feed,
                release.feed_source)
    for version in versions:
        verify_staged(storage, model=model, version=version,
                      repository_prefix=settings.repository_prefix)
    config = with_versions(staged_config(storage, repository_prefix=settings.repository_prefix,
                                         model=model, version=candidate), versions)
    payload, source = load_payload(storage, clients.registry,
                                   repository_prefix=settings.repository_prefix, model=model,
                                   version=candidate, rows=policy.export.golden_max_rows)
    return config, payload, source


def _refuse_unjudged(report: GateReport, plan: CanaryPlan, cleanup: str) -> None:
    """Raise when the gates could not judge: a tail too thin to refer to (a usage error
    naming ``canary.min_samples``) or both arms failing alike (inconclusive, exit 6)."""
    model, candidate = plan.model, plan.candidate
    refused = tail_reference_refusal(report)
    if refused:
        raise UsageError(
            f"the canary of {model} v{candidate} cannot judge the tail: {refused}",
            hint="raise canary.min_samples (and canary.max_duration_s so the canary can reach "
                 "it), or judge a lower percentile",
            model=model, candidate=candidate, key="canary.min_samples", cleanup=cleanup)
    shared = shared_errors(report)
    if shared:
        raise GatesInconclusive(
            f"the canary of {model} v{candidate} cannot tell the candidate from the "
            f"baseline: {shared}",
            hint="both versions fail alike, so the cause is shared (inputs, the canary "
                 "server, the load path); fix it and run the canary again",
            model=model, candidate=candidate, baseline=plan.baseline, reason="shared errors",
            cleanup=cleanup)


def publish(result: CanaryResult, out_dir: Path, progress: Progress, *,
             plotted: bool = False) -> None:
    """Write the report (markdown, PNG, JSON) and attach it to the Prefect run, if any
    (``plotted``: the PNG is drawn already, :func:`tasks.report.write_canary_report`)."""
    paths = write_canary_report(result, out_dir, plotted=plotted)
    result.report_paths = paths.to_dict()
    publish_markdown_artifact(Path(paths.markdown).read_text(encoding="utf-8"),
                              key=f"canary-{result.model}-v{result.candidate}")
    progress(f"canary of {result.model} v{result.candidate}: {result.verdict} "
             f"(report {paths.markdown})")


# --------------------------------------------------------------------------- the stage


@in_canary_slot  # one canary at a time on the canary Triton (issue 18; owner: locks)
def run_canary(settings: Settings, clients: Clients, policy: Policy, *, model: str,
               candidate: int, baseline: int | None,
               progress: Progress = quiet, report_dir: Path | None = None,
               keep_loaded: bool = False,
               release: ReleaseCandidate | None = None) -> CanaryResult:
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
        release: The promotion's candidate (config and rows), so nothing about C is read
            again; None (a standalone canary): read from S3 and MLflow.

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
    if (refusal := not_carried_out(policy, bake=False)) is not None:  # live traffic: not yet
        raise refusal
    started = time.monotonic()
    server, storage = canary_clients(clients, model, candidate, baseline)
    config, payload, source = candidate_inputs(settings, clients, storage, policy=policy,
                                                model=model, candidate=candidate,
                                                baseline=baseline, release=release)
    notes: list[str] = []
    empty_text = _metrics_text(server, settings.http_timeout_s, notes, "before the load")
    on_gpu = empty_text is not None and fleet_target(empty_text) == "gpu"
    # The staged config in the canary's form (CPU derivation of a GPU config on a CPU canary)
    config, _ = render_for_servers(config, [server], timeout_s=settings.http_timeout_s,
                                   texts={server.name: empty_text})
    plan = plan_canary(policy, model=model, candidate=candidate, baseline=baseline,
                       on_gpu=on_gpu, server_name=server.name,
                       timeout_s=settings.http_timeout_s)
    run = _CanaryRun(settings, server, plan, payload=payload, notes=[*notes, *plan.notes],
                     empty_text=empty_text, progress=progress)
    measured = run.measure(config)
    out_dir = report_dir or new_report_dir(settings, model, candidate)
    gpu, snapshot, gate_report = run.release_and_judge(measured, source, keep_loaded,
                                                       plot=out_dir / PLOT_NAME)
    _refuse_unjudged(gate_report, plan, run.cleanup)
    load = load_summary(plan, measured, url=run.url, payload_source=source,
                        payload_rows=int(next(iter(payload.values())).shape[0]))
    result = CanaryResult(model=model, candidate=candidate, baseline=baseline,
                          verdict=str(gate_report.verdict), snapshot=snapshot,
                          gate_report=gate_report, load=load, cleanup=run.cleanup,
                          skipped_rules=list(plan.skipped), gpu=gpu)
    result.seconds = time.monotonic() - started
    publish(result, out_dir, progress, plotted=True)
    return result
