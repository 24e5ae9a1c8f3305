"""The shadow canary (``canary.traffic: shadow``, issue 20 item 3): the candidate gets a
copy of live production requests through the traffic router, and is judged on them.

The run, in order (the decisions are :mod:`tasks.shadow_plan`'s, pure):

1. **Load** the candidate C alone on the canary Triton (its staged config, versions
   ``[C]``), so the mirrored copies of ``/v2/models/M/infer`` reach exactly C.
2. **Golden rows**: each golden row goes once to production (a replica, ``/versions/P``)
   and once to C: the agreement on the rows the check knows, for the record.
3. **The window**: the sample log is emptied, Triton's counters are read on the canary
   and every replica (one tick), then the router holds ``mirror_pct`` % through
   :func:`tasks.traffic_state.holding` (written to the release's record before it is
   set, read back, and returned to 100 % production on every way out: the window's end,
   an error, a signal). Every second: a tick, the router read back, the sampled bodies
   counted; :func:`tasks.shadow_plan.window_action` holds, ends, or aborts (a dead or
   stuck router: exit 1, the mirror back to 0).
4. **Agreement on real inputs**: nginx logged each mirrored request's body
   (:data:`modelship.nginx.SAMPLE_FORMAT`; a gRPC ``ModelInfer`` frame is turned into the
   KServe HTTP request with the same tensors, :func:`tasks.shadow_plan.grpc_as_http`).
   Up to ``canary.min_samples`` of them, spread over the window, are sent byte for byte
   to production (``/versions/P`` on a replica) and to C (``/versions/C`` on the canary)
   and the answers compared (:func:`tasks.agreement.rows_agree`). The log is deleted
   afterwards: it holds production's inputs. The candidate's answers go nowhere but this
   comparison.
5. **Judge** with the policy's gates (:func:`tasks.gates.evaluate`) on a
   :class:`~modelship.measurements.CanarySnapshot` built from Triton's counters
   (per-version, server-side: requests, failures, queue + compute µs; per-second
   intervals for ``server_latency_ratio``) and the live agreement; client-side latency
   rules become server-side ones or are skipped (:func:`tasks.shadow_plan.shadow_rules`).

Why sample through nginx's log rather than a sampler process on the mirror's path: the
log is written by the gateway itself after the client's answer, nothing new runs or can
die in front of the candidate, the mirrored copies keep going straight to the canary, and
the sampled bodies are exactly the mirrored ones (both read one ``split_clients`` draw).
Limits: a body larger than the gateway's buffer (1 MiB) is not sampled (counted); a
mirrored request whose body was not logged (gRPC streaming inference) is judged on Triton's
counters only: the record's ``traffic.shadow.not_compared`` counts them and the report and
the thread say so.

**The Gateway API router** (Kubernetes) carries the mirror (an HTTPRoute ``RequestMirror``
filter with ``percent``/``fraction``, Gateway API >= v1.3) but keeps no copy of the bodies:
the window then waits for the counters only, latency and errors are judged the same way,
and the agreement judged is the golden rows' (``agreement_source: golden rows``; the record,
the report and the Slack thread say live agreement was not measured). Live agreement on
Kubernetes needs a component on the mirror's path that keeps the bodies (docs/gateway.md).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from modelship.candidate import ReleaseCandidate
from modelship.clients import Clients
from modelship.errors import InfrastructureError, UsageError
from modelship.ledger import now_iso
from modelship.loadgen.spec import Target
from modelship.loadgen.transports.kserve_http import answer_outputs, build_body, http_base
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import Policy
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.traffic.port import PRODUCTION_ONLY, TrafficRouter
from modelship.triton.client import TritonServer
from modelship.triton.metrics import Scrape, scrape
from modelship.triton.model_config import to_json, with_versions
from modelship.triton.target import render_for_servers
from tasks.agreement import agreement_kind, rows_agree
from tasks.canary import (
    KEPT_LOADED,
    CanaryResult,
    canary_clients,
    candidate_inputs,
    new_report_dir,
    publish,
    run_canary,
    unload_canary,
    wait_ready,
)
from tasks.canary_slot import in_canary_slot
from tasks.gates import evaluate
from tasks.live_traffic import split_scope
from tasks.record import ReleaseJournal
from tasks.shadow_plan import (
    ArmTotals,
    Sampled,
    SampledRequest,
    ShadowPlan,
    answer_problem,
    arm_totals,
    not_compared,
    parse_samples,
    pick,
    screen,
    shadow_intervals,
    shadow_rules,
    versioned_uri,
    window_action,
)
from tasks.traffic_state import configured_router, holding, read_live, traffic_intent

__all__ = ["LOOK_S", "replay_of", "run_shadow", "shadow_task"]

#: Seconds between looks at the window (one tick of Triton's counters each).
LOOK_S = 1.0

Outputs = dict[str, np.ndarray]


def _infer(base_url: str, uri: str, body: bytes, headers: Mapping[str, str],
           timeout_s: float) -> Outputs:
    """One inference with these exact bytes; raises on anything but an answer."""
    request = urllib.request.Request(http_base(base_url) + uri, data=body, method="POST",
                                     headers=dict(headers))
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
        length = response.headers.get("Inference-Header-Content-Length")
        return answer_outputs(response.read(), int(length) if length else None)


def _compare(pairs: list[tuple[Outputs, Outputs]], policy: Policy
             ) -> tuple[float | None, int, str]:
    """Share of rows whose answers agree, rows compared, and the kind (None: none)."""
    configured = policy.canary.agreement.kind
    if not pairs:
        return None, 0, configured if configured != "auto" else "classifier"
    kind = agreement_kind(pairs[0][1], policy.canary.agreement.kind)
    agreed = compared = 0
    for candidate, baseline in pairs:
        rows = rows_agree(kind, candidate, baseline, policy.canary.agreement)
        agreed += int(rows.sum())
        compared += int(rows.size)
    return (agreed / compared if compared else None), compared, kind


def _sample_log(router: TrafficRouter) -> Path | None:
    """The file a router logs the mirrored requests' bodies to: the local gateway's (its
    layout's ``sample_log``), None for a router that keeps no copy (the Gateway API)."""
    layout = getattr(router, "layout", None)
    found = getattr(layout, "sample_log", None)
    return found if isinstance(found, Path) else None


class _Shadow:
    """The executor of one shadow window (see the module docstring)."""

    def __init__(self, settings: Settings, clients: Clients, policy: Policy, *, model: str,
                 candidate: int, baseline: int, router: TrafficRouter, canary: TritonServer,
                 progress: Progress) -> None:
        self.settings, self.policy, self.model = settings, policy, model
        self.candidate, self.baseline = candidate, baseline
        self.router, self.canary, self.progress = router, canary, progress
        #: Where the router logs the mirrored bodies (the local gateway's sample log);
        #: None for a router that keeps none (the Gateway API).
        self.sample_log = _sample_log(router)
        self.sampling = self.sample_log is not None
        self.golden_kind = ""
        self.replicas = list(clients.replicas)
        self.plan = ShadowPlan.from_policy(policy.canary)
        self.notes: list[str] = []
        self.ticks: list[dict[str, Scrape | None]] = []
        self.events: list[dict[str, Any]] = []
        self.window_s = 0.0
        self.lines: list[bytes] = []  # the sample log, read before the mirror goes off
        self.left_out: Counter[str] = Counter()  # sampled inputs not compared, and why

    # ---------------------------------------------------------------- I/O steps

    def _scrape(self, server: TritonServer) -> Scrape | None:
        try:
            return scrape(server.endpoint.metrics, self.settings.http_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a missed tick leaves its interval out
            self.notes.append(f"a metrics scrape of {server.name} failed ({exc}); its "
                              "interval is left out")
            return None

    def tick(self) -> None:
        self.ticks.append({"canary": self._scrape(self.canary),
                           **{r.name: self._scrape(r) for r in self.replicas}})

    def replay_golden(self, payload: Mapping[str, np.ndarray]) -> tuple[float | None, int]:
        """Each golden row to production and to C, once: their agreement and rows."""
        rows = int(next(iter(payload.values())).shape[0])
        pairs = []
        for row in range(rows):
            body, headers = build_body(Target("", self.model),
                                       {k: v[row:row + 1] for k, v in payload.items()})
            pair = self.pair(SampledRequest("", body, int(headers[
                "Inference-Header-Content-Length"]) if "Inference-Header-Content-Length"
                in headers else None, headers["Content-Type"]))
            if pair is not None:
                pairs.append(pair)
        agreement, compared, self.golden_kind = _compare(pairs, self.policy)
        return agreement, compared

    def pair(self, sample: SampledRequest, *, live: bool = False
             ) -> tuple[Outputs, Outputs] | None:
        """``(candidate's, production's)`` answers to the same bytes; None when either
        failed (an error, not a disagreement: Triton's counters judge errors) or either
        answer holds a NaN or an infinity (never agreement). ``live``: a sampled live
        input, whose leaving out is counted in :attr:`left_out`."""
        timeout = self.settings.http_timeout_s
        try:
            production = _infer(self.replicas[0].endpoint.http,
                                versioned_uri(self.model, self.baseline), sample.body,
                                sample.headers(), timeout)
            candidate = _infer(self.canary.endpoint.http,
                               versioned_uri(self.model, self.candidate), sample.body,
                               sample.headers(), timeout)
        except Exception as exc:  # noqa: BLE001 - a live input never crashes the judge
            if live:
                self.left_out["not answered by both versions"] += 1
            if len(self.notes) < 20:
                self.notes.append(f"a sampled input was not answered by both versions "
                                  f"({type(exc).__name__}: {str(exc)[:200]})")
            return None
        why = answer_problem(candidate, production)
        if why is not None:
            if live:
                self.left_out[why] += 1
            return None
        return candidate, production

    def sampled_lines(self) -> list[bytes]:
        if self.sample_log is None:
            return []
        try:
            return self.sample_log.read_bytes().splitlines()
        except FileNotFoundError:
            return []

    def forget_samples(self) -> None:
        """The sample log holds production's inputs: never left behind."""
        if self.sample_log is not None:
            self.sample_log.unlink(missing_ok=True)

    # ---------------------------------------------------------------- the window

    def window(self, write: Callable[[dict[str, Any]], None],
               announce: Callable[[str], None]) -> dict[str, Any]:
        """Mirror, watch, end (or abort); returns the record's ``traffic`` document."""
        plan = self.plan
        self.forget_samples()
        self.tick()
        started, mirrored, sampled = time.monotonic(), 0, 0
        announce(f"shadow: mirroring {plan.mirror_pct:g} % of live requests to "
                 f"{self.model} v{self.candidate} on the canary (answers discarded)")
        with holding(self.router, plan.split, write=write, progress=self.progress) as doc:
            while True:
                time.sleep(LOOK_S)
                self.tick()
                cand, _ = arm_totals(self.ticks[0], self.ticks[-1], model=self.model,
                                     candidate=self.candidate, baseline=self.baseline)
                mirrored = cand.requests if cand is not None else 0
                sampled = len(parse_samples(self.sampled_lines(), self.model).requests)
                intervals = len(shadow_intervals(self.ticks, model=self.model,
                                                 candidate=self.candidate,
                                                 baseline=self.baseline))
                live, problem = read_live(self.router)
                elapsed = time.monotonic() - started
                action = window_action(plan, elapsed_s=elapsed, mirrored=mirrored,
                                       sampled=sampled, live=live, problem=problem,
                                       intervals=intervals, sampling=self.sampling)
                if action.kind == "hold":
                    continue
                self.window_s = elapsed
                self.events.append({"at": now_iso(), "action": action.kind,
                                    "elapsed_s": round(elapsed, 3), "mirrored": mirrored,
                                    "sampled": sampled, "reason": action.reason})
                self.progress(f"shadow: {action.kind}: {action.reason}")
                # read while the mirror is on: turning it off deletes the log
                self.lines = self.sampled_lines()
                if action.kind == "abort":
                    raise InfrastructureError(action.reason, hint="check the gateway "
                                              "(`modelship doctor`), then promote again",
                                              component=self.router.name)
                break
        announce(f"shadow: window over after {self.window_s:.0f} s: {mirrored} mirrored, "
                 f"{sampled} sampled; mirror back to 0")
        return traffic_intent(doc, router=self.router.name, split=PRODUCTION_ONLY,
                              at=now_iso())

    # ---------------------------------------------------------------- the judgement

    def snapshot(self, agreement: tuple[float | None, int, str],
                 golden: tuple[float | None, int], summary: dict[str, Any]
                 ) -> CanarySnapshot:
        cand, prod = arm_totals(self.ticks[0], self.ticks[-1], model=self.model,
                                candidate=self.candidate, baseline=self.baseline)
        if cand is None or prod is None:
            self.notes.append("Triton's counters are missing or restarted for "
                              + ("the candidate" if cand is None else "production")
                              + " over the window; the server-side rules cannot judge")
        window = max(self.window_s, 1e-9)

        def arm(version: int, totals: ArmTotals | None) -> ArmMeasurements:
            if totals is None:
                return ArmMeasurements(version, np.array([], dtype=float), 0, 0)
            return ArmMeasurements(version, np.array([], dtype=float), totals.requests,
                                   totals.failures, totals.answered / window,
                                   totals.mean_us("queue"), totals.mean_us("compute"))

        intervals = shadow_intervals(self.ticks, model=self.model, candidate=self.candidate,
                                     baseline=self.baseline)
        return CanarySnapshot(
            model=self.model, candidate=arm(self.candidate, cand),
            baseline=arm(self.baseline, prod), agreement=agreement[0],
            agreement_samples=agreement[1], agreement_kind=agreement[2],
            window_s=self.window_s,
            extra={"server_metrics": {"candidate": None if cand is None else cand.to_dict(),
                                      "baseline": None if prod is None else prod.to_dict()},
                   "server_intervals": intervals, "payload_source": "live (mirrored)",
                   "notes": self.notes, "gpu": None, "shadow": summary,
                   "golden_agreement": golden[0]})


@in_canary_slot  # one canary at a time on the canary Triton; the slot's holder owns the mirror
def run_shadow(settings: Settings, clients: Clients, policy: Policy, *, model: str,
               candidate: int, baseline: int | None, router: TrafficRouter | None,
               write: Callable[[dict[str, Any]], None],
               announce: Callable[[str], None] = lambda _: None,
               progress: Progress = quiet, report_dir: Path | None = None,
               keep_loaded: bool = False,
               release: ReleaseCandidate | None = None) -> CanaryResult:
    """The shadow canary of ``candidate`` against production ``baseline``.

    Args:
        router: The configured traffic router: the stack's local gateway (it samples
            the mirrored bodies: agreement on live inputs), or the Gateway API route (its
            RequestMirror carries the copy; no body is kept, so the agreement is the golden
            rows' and the record says so).
        write: Puts the ``traffic`` document on the release's record and writes it (before
            every change of the router).
        announce: Receives the window's start and end (the Slack thread).
        keep_loaded: After a window that completed, load P beside C on the canary and
            leave both loaded (the approval wait's watcher probes them side by side, as
            after a replay canary); the caller unloads them.
        Others: as :func:`tasks.canary.run_canary`.

    Returns:
        The result; ``load`` is the shadow's summary (``mode``, ``mirrored``, ``sampled``,
        ``compared``, ``agreement``, ``golden_agreement``, ``verdicts``).

    Raises:
        UsageError: no production version (nothing to mirror), or no router (exit 2).
        InfrastructureError: the router did not take the mirror, stopped answering or got
            stuck (the mirror is returned to 0 where it answers), or the canary Triton
            could not load C (exit 1).
    """
    router, baseline = _mirroring(model, baseline, router)
    started = time.monotonic()
    server, storage = canary_clients(clients, model, candidate, baseline)
    config, payload, _ = candidate_inputs(settings, clients, storage, policy=policy,
                                           model=model, candidate=candidate,
                                           baseline=baseline, release=release)
    both, _ = render_for_servers(config, [server], timeout_s=settings.http_timeout_s)
    run = _Shadow(settings, clients, policy, model=model, candidate=candidate,
                  baseline=baseline, router=router, canary=server, progress=progress)
    completed = False
    try:
        progress(f"shadow: loading {model} v{candidate} alone on the canary {server.name}")
        server.load_model(model, config_json=to_json(with_versions(both, [candidate])))
        wait_ready(server, model, [candidate], settings.control_timeout_s)
        golden = run.replay_golden(payload)
        traffic = run.window(write, announce)
        found = parse_samples(run.lines, model)
        usable, screened = screen(found.requests)
        run.left_out.update(screened)
        chosen = pick(usable, run.plan.min_samples)
        if run.sampling:
            progress(f"shadow: comparing {len(chosen)} of {len(found.requests)} sampled live "
                     "inputs on both versions"
                     + (f" ({sum(screened.values())} left out: {dict(screened)})"
                        if screened else ""))
        else:
            progress(f"shadow: no live inputs to compare: {router.name} keeps no copy of the "
                     "mirrored bodies; agreement is judged on the golden rows")
        pairs = [p for p in (run.pair(c, live=True) for c in chosen) if p is not None]
        if keep_loaded:  # the approval wait's watcher probes P and C side by side here
            server.load_model(model, config_json=to_json(both))
            wait_ready(server, model, [baseline, candidate], settings.control_timeout_s)
        completed = True
    finally:
        run.forget_samples()
        cleanup = KEPT_LOADED if keep_loaded and completed else unload_canary(server, model,
                                                                         progress)
    result = _judge(run, policy, write, traffic=traffic, golden=golden, pairs=pairs,
                    found=found, cleanup=cleanup)
    result.seconds = time.monotonic() - started
    publish(result, report_dir or new_report_dir(settings, model, candidate), progress)
    announce(f"shadow: {result.verdict}: {_agreement_said(result.load)}")
    return result


def _agreement_said(summary: Mapping[str, Any]) -> str:
    """The agreement line of the Slack thread and the progress (pure)."""
    golden = summary["golden_agreement"]
    golden_text = f"{golden:.1%}" if golden is not None else "not measured"
    skipped = summary.get("not_compared") or {}
    unseen = (f"; {skipped['requests']} mirrored requests not compared ({skipped['why']})"
              if skipped.get("requests") else "")
    if summary.get("agreement_source") == "golden rows":
        return (f"agreement on live inputs not measured ({summary['router']} keeps no "
                f"mirrored bodies); golden rows {golden_text} over "
                f"{summary['golden_rows']} rows, judged{unseen}")
    live = summary["agreement"]
    return ("agreement on live inputs "
            + (f"{live:.1%}" if live is not None else "not measured")
            + f" over {summary['compared_rows']} rows (golden rows {golden_text}){unseen}")


def _mirroring(model: str, baseline: int | None,
               router: TrafficRouter | None) -> tuple[TrafficRouter, int]:
    """The router a shadow mirrors through and the production version it mirrors, or the
    refusal (exit 2): a shadow needs both. Either router mirrors (the local gateway's
    ``mirror``, the Gateway API's RequestMirror with ``percent``/``fraction``); only the
    local gateway also samples the mirrored bodies (:class:`_Shadow` ``sampling``)."""
    if baseline is None:
        raise UsageError(f"a shadow canary of {model} needs a production version to mirror "
                         "live requests from; there is none yet",
                         hint="release the first version with canary.traffic: replay",
                         key="canary.traffic")
    if router is None:
        raise UsageError(
            "canary.traffic: shadow needs a traffic router to mirror live requests to the "
            "candidate, and none is configured",
            hint="run `modelship stack up` (its gateway also samples the mirrored bodies for "
            "the agreement on live inputs), or set MODELSHIP_K8S_ROUTE (Gateway API "
            "RequestMirror), or use canary.traffic: replay", key="canary.traffic")
    return router, baseline


def _judge(run: _Shadow, policy: Policy, write: Callable[[dict[str, Any]], None], *,
           traffic: dict[str, Any], golden: tuple[float | None, int],
           pairs: list[tuple[Outputs, Outputs]], found: Sampled, cleanup: str) -> CanaryResult:
    """The window's verdict: the policy's gates on the server-side snapshot and the
    agreement on the replayed live inputs, written to the record's ``traffic.shadow``."""
    model, candidate, baseline = run.model, run.candidate, run.baseline
    agreement = _compare(pairs, policy)
    if not run.sampling:  # no live bodies (the Gateway API): the golden rows' agreement
        agreement = (golden[0], golden[1], run.golden_kind or agreement[2])
    judged, skipped = shadow_rules(policy.gates)
    summary: dict[str, Any] = {"mode": "shadow", "router": run.router.name,
                               "agreement_source": "live inputs" if run.sampling else "golden rows",
                               "mirror_pct": run.plan.mirror_pct,
                               "window_s": round(run.window_s, 3), "events": run.events,
                               "sampled": len(found.requests),
                               "left_out": dict(found.left_out + run.left_out),
                               "compared_inputs": len(pairs),
                               "compared_rows": agreement[1] if run.sampling else 0,
                               "agreement": agreement[0] if run.sampling else None,
                               "golden_agreement": golden[0], "golden_rows": golden[1]}
    run.notes.append(
        f"shadow: {run.plan.mirror_pct:g} % of live requests mirrored to the candidate for "
        f"{run.window_s:.0f} s; "
        + (f"{len(found.requests)} bodies sampled, {len(pairs)} replayed on both versions"
           if run.sampling else f"no bodies sampled ({run.router.name} keeps no copy of the "
           "mirrored requests): the agreement judged is the golden rows'")
        + " (the report's load and client-latency lines do not apply: the candidate's "
        "answers never reached a client)")
    snapshot = run.snapshot(agreement, golden, summary)
    summary["mirrored"] = snapshot.candidate.requests
    summary["not_compared"] = not_compared(snapshot.candidate.requests,
                                           found if run.sampling else None)
    if summary["not_compared"]["requests"]:
        run.notes.append(f"shadow: {summary['not_compared']['requests']} mirrored requests "
                         f"not compared: {summary['not_compared']['why']}")
    summary["production_requests"] = snapshot.baseline.requests if snapshot.baseline else 0
    report = evaluate(snapshot, judged, min_samples=policy.canary.min_samples)
    summary["verdicts"] = {r["rule"]: {"metric": r["metric"], "verdict": r["verdict"],
                                       "value": r["value"]}
                           for r in report.to_dict()["results"]}
    write({**traffic, "shadow": json.loads(json.dumps(summary, default=str))})
    return CanaryResult(model=model, candidate=candidate, baseline=baseline,
                        verdict=str(report.verdict), snapshot=snapshot, gate_report=report,
                        load=summary, cleanup=cleanup, skipped_rules=skipped)


def replay_of(policy: Policy) -> Policy:
    """``policy`` with the replay canary (a first release has no production to mirror)."""
    canary = policy.canary.model_copy(update={"traffic": "replay", "mirror_pct": None})
    return policy.model_copy(update={"canary": canary})


@task(name="canary", task_run_name="shadow canary {model} v{candidate} vs {baseline}",
      cache_policy=NO_CACHE)
def shadow_task(settings: Settings, clients: Clients, policy: Policy, journal: ReleaseJournal,
                model: str, candidate: int, baseline: int | None, keep_loaded: bool = False,
                release: ReleaseCandidate | None = None) -> CanaryResult:
    """The shadow canary inside a promotion: the mirror's hold is written to the release's
    record (``traffic``) before each change of the router, the window's start, end and
    verdict go to the Slack thread. A first release has no production to mirror: the
    replay canary judges it (noted on the record)."""
    progress = get_run_logger().info
    if baseline is None:
        journal.note("canary.traffic: shadow: no production version to mirror live requests "
                     "from on a first release; the replay canary judges it")
        return run_canary(settings, clients, replay_of(policy), model=model,
                          candidate=candidate, baseline=None, progress=progress,
                          keep_loaded=keep_loaded, release=release)

    def write(doc: dict[str, Any]) -> None:
        journal.record.traffic = doc
        journal.save()

    def announce(text: str) -> None:
        journal.thread.reply(text, [])

    return run_shadow(settings, clients, policy, model=model, candidate=candidate,
                      baseline=baseline,
                      router=configured_router(settings, progress,
                                               scope=split_scope(clients, model, progress)),
                      write=write, announce=announce, progress=progress,
                      keep_loaded=keep_loaded, release=release)
