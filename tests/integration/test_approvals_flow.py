"""The approve stage in a real flow run on the stack's Prefect server.

The Prefect UI form resumes a paused run without passing through the Slack endpoint, so
the stage re-checks every input with the same rules: the requester's approval and a stale
digest are refused and recorded, and the run pauses again until a valid approver decides.
While it waits, a watcher that finds a breach rejects the release itself (exit 5). With
approval required the candidate stays loaded on the canary Triton during the wait, the
watcher's paired probe reaches it (Triton's inference count rises), and it is unloaded
after an approval, a rejection or an expiry.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from flows.check import run_check
from modelship.approvals.server import PrefectRuns
from modelship.candidate import ReleaseCandidate, ResolvedVersion
from modelship.clients import Clients, build_clients
from modelship.errors import ModelshipError
from modelship.ledger import ReleaseRecord
from modelship.policy import Policy
from modelship.settings import Settings
from modelship.slack.client import SlackClient
from modelship.slack.notifier import NullNotifier, SlackNotifier
from modelship.triton.infer import TritonInference
from modelship.triton.model_config import from_pbtxt, to_json, with_versions
from tasks.approve import (
    WATCHER,
    ApprovalChannels,
    ApprovalRequest,
    EvidenceJudge,
    Finding,
    approve,
    canary_cleanup,
    evidence_watch,
)
from tasks.canary import KEPT_LOADED, CanaryResult, run_canary, sequential_config, wait_ready
from tasks.evidence import release_candidate
from tasks.record import ReleaseJournal
from tests import models
from tests.integration.test_approvals_security import BOXES, _in_thread, _wait_for

DIGEST = {"model": "approve-stage", "version": 2, "onnx_sha256": "ef" * 32,
          "canary_report_id": "canary-1"}


@flow(name="approve-stage")
def approve_flow(key: str, timeout_s: int) -> dict[str, Any]:
    box = BOXES[key]
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None
    box["id"] = str(context.flow_run.id)
    record = ReleaseRecord.start("promote", "approve-stage", requester="U0CAROL")
    record.holder["flow_run_id"] = box["id"]
    record.candidate = {**DIGEST, "manifest_sha256": "00" * 32}
    notifier = box.get("notifier") or NullNotifier()
    journal = ReleaseJournal(record, None, notifier)
    journal.open()  # the release thread, when Slack is there
    box["record"], box["thread_ts"] = record, journal.thread.ts
    request = ApprovalRequest(required=True, approvers=("U0ALICE",), requester="U0CAROL",
                              timeout_s=timeout_s)
    channels = ApprovalChannels(notifier=box.get("notifier"), resume=box["runs"].resume,
                                watch=box.get("watch"), watch_interval_s=0.5,
                                cleanup=lambda: "nothing loaded on the canary")
    try:
        return approve(request, journal, channels, model="approve-stage", version=2)
    except ModelshipError as exc:
        return {"denied": exc.message, "exit_code": exc.exit_code}


def _paused_again(runs: PrefectRuns, run_id: str, record: ReleaseRecord, refusals: int
                  ) -> bool:
    pending = record.approvals[0] if record.approvals else {}
    return len(pending.get("refusals", [])) == refusals and runs.state(run_id) == "PAUSED"


def test_the_prefect_ui_channel_gets_the_same_checks(stack_settings: Settings) -> None:
    runs = PrefectRuns(stack_settings.prefect_api_url)
    box: dict[str, Any] = {"runs": runs}
    thread = _in_thread(approve_flow, box, str(stack_settings.prefect_api_url), 120)
    try:
        _wait_for(lambda: "id" in box and runs.state(box["id"]) == "PAUSED", 60, "the pause")
        base = {"release_id": box["record"].id, "digest": DIGEST, "channel": "prefect-ui"}
        runs.resume(box["id"], {**base, "decision": "approve", "user": "U0CAROL"})
        _wait_for(lambda: _paused_again(runs, box["id"], box["record"], 1), 30, "refusal 1")
        runs.resume(box["id"], {**base, "decision": "approve", "user": "U0ALICE",
                                "digest": {**DIGEST, "canary_report_id": "canary-0"}})
        _wait_for(lambda: _paused_again(runs, box["id"], box["record"], 2), 30, "refusal 2")
        runs.resume(box["id"], {**base, "decision": "approve", "user": "U0ALICE"})
        thread.join(30)
    finally:
        if thread.is_alive():
            runs.resume(box["id"], {"decision": "reject", "user": "cleanup",
                                    "release_id": "x", "digest": {}})
            thread.join(10)
    assert "error" not in box, box.get("error")
    assert box["result"]["decision"] == "approved" and box["result"]["by"] == "U0ALICE"
    assert box["result"]["channel"] == "prefect-ui"
    pending = box["record"].approvals[0]
    assert [r["code"] for r in pending["refusals"]] == ["requester_cannot_approve",
                                                        "stale_digest"]
    assert pending["status"] == "approved"
    assert any("not posted" in note for note in box["record"].notes)  # no Slack here


def _decided_after_s(pending: dict[str, Any]) -> float:
    """Seconds from the approval request to its decision, as the record says."""
    decided = datetime.fromisoformat(pending["decided_at"])
    return (decided - datetime.fromisoformat(pending["requested_at"])).total_seconds()


def test_a_breach_while_waiting_rejects_the_release(stack_settings: Settings) -> None:
    runs = PrefectRuns(stack_settings.prefect_api_url)
    calls: list[float] = []

    def watch() -> str | None:
        calls.append(time.monotonic())
        return "error rate of approve-stage/2 rose to 3% (> 1%)" if len(calls) >= 2 else None

    box: dict[str, Any] = {"runs": runs, "watch": watch}
    thread = _in_thread(approve_flow, box, str(stack_settings.prefect_api_url), 120)
    thread.join(60)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert box["result"]["exit_code"] == 5
    assert "the watcher rejected" in box["result"]["denied"] and "3%" in box["result"]["denied"]
    pending = box["record"].approvals[0]
    assert (pending["status"], pending["decided_by"]) == ("rejected", "modelship-watcher")
    # long before the 120 s expiry, by the record's own clock (from the request on: the
    # flow run's start-up on a busy machine is not the watcher's doing)
    assert _decided_after_s(pending) < 120 / 3, pending


def test_an_unanswered_request_expires_fails_closed_and_says_so_in_slack(
        stack_settings: Settings) -> None:
    assert stack_settings.slack_token is not None
    slack = SlackClient(str(stack_settings.slack_api_url),
                        stack_settings.slack_token.get_secret_value(), timeout_s=10)
    runs = PrefectRuns(stack_settings.prefect_api_url)
    box: dict[str, Any] = {"runs": runs, "notifier": SlackNotifier(slack, "#approve-stage")}
    thread = _in_thread(approve_flow, box, str(stack_settings.prefect_api_url), 3)
    thread.join(60)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert box["result"]["exit_code"] == 5 and "expired after 3 s" in box["result"]["denied"]
    pending = box["record"].approvals[0]
    # it waited for the expiry (the record's requested_at is taken a moment after the
    # expiry's clock starts), and ended, not hung: the record's clock, from the request
    assert 2.5 <= _decided_after_s(pending) < 3 * 10, pending
    assert pending["status"] == "expired" and pending["cleanup"]
    with urllib.request.urlopen(f"{stack_settings.slack_api_url}_emulator/messages?channel="
                                f"%23approve-stage", timeout=10) as response:
        messages = json.loads(response.read())["messages"]
    request = next(m for m in messages if m["ts"] == pending["slack"]["ts"])
    assert request["thread_ts"] == box["thread_ts"] and request["updated"]
    assert not [b for b in request["blocks"] if b["type"] == "actions"]  # no more buttons
    assert "Expired at" in json.dumps(request["blocks"])
    notice = [m for m in messages if m["thread_ts"] == box["thread_ts"]
              and "expired" in (m["text"] or "") and m["ts"] != request["ts"]]
    assert notice and "WARNING" in json.dumps(notice[-1]["blocks"])


class _Metrics(BaseHTTPRequestHandler):
    """A Triton metrics endpoint whose counters the test moves."""

    counts = {"success": 0, "failure": 0}

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def do_GET(self) -> None:
        labels = 'model="m",version="1"'
        body = (f"nv_inference_request_success{{{labels}}} {self.counts['success']}\n"
                f'nv_inference_request_failure{{{labels},reason="BACKEND"}} '
                f"{self.counts['failure']}\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Replica:
    def __init__(self, metrics: str) -> None:
        self.name, self.serves = "triton-0", True
        self.endpoint = type("Endpoint", (), {"metrics": metrics})()

    def is_model_ready(self, model: str, version: str = "") -> bool:
        return self.serves


class _Clients:
    def __init__(self, metrics: str) -> None:
        self.replicas = [_Replica(metrics)]
        self.storage = None
        self.canary = None


def _bare_release(model: str, version: int) -> ReleaseCandidate:
    """A candidate with no rows and no digest (this watch has no canary and no S3)."""
    resolved = ResolvedVersion(name=model, version=version, flavor="onnx", flavors=("onnx",),
                               source="", run_id=None, signature=None, metrics={},
                               aliases=(), tags={}, local_dir=Path("/nowhere"))
    return ReleaseCandidate(resolved=resolved, feed={}, feed_source="synthetic",
                            config_pbtxt="", digest={})


def test_the_evidence_watch_judges_production_with_an_e_process_and_evidence_twice(
        stack_settings: Settings) -> None:
    """A real metrics endpoint the test moves: production within its budget never breaches,
    a certain excess breaches at the look that shows it, and a replica that stops serving
    the baseline is an evidence finding only on the second look in a row."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        clients = _Clients(f"http://127.0.0.1:{server.server_address[1]}/metrics")
        check = evidence_watch(stack_settings, clients, release=_bare_release("m", 2),
                               baseline=1, judge=EvidenceJudge(max_error_rate=0.01,
                                                               alpha=0.01))
        replica, counts = clients.replicas[0], _Metrics.counts
        assert check() is None
        replica.serves = False
        assert check() is None  # once is a blip
        replica.serves = True
        assert check() is None
        replica.serves = False
        assert check() is None
        found = check()
        assert found is not None and found.kind == "evidence"
        assert "no longer serves m v1" in found.reason
        replica.serves = True
        assert check() is None
        for _ in range(5):  # exactly at the budget, look after look
            counts["success"] += 990
            counts["failure"] += 10
            assert check() is None
        counts["success"] += 60
        counts["failure"] += 40  # production starts failing while the release waits
        found = check()
        assert found is not None and found.kind == "breach"
        assert "production m v1 failed 90 of 5100 requests" in found.reason
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------------------
# the candidate stays loaded on the canary while the release waits, and is probed

WATCHED = "approve_watch"
WATCH_POLICY: dict[str, Any] = {
    "canary": {"warmup_s": 0.5, "window_s": 1.0, "max_duration_s": 2.0, "min_samples": 20},
    "gates": [{"name": "error_rate", "metric": "error_rate", "test": "exact_rate",
               "max_rate": 0.05}],
}


@pytest.fixture(scope="module")
def watched(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Clients, int, ReleaseCandidate]]:
    """Two staged versions of one model (the same sklearn artifact registered twice): the
    clients, the baseline and the candidate as its check and stage hand it over. The
    approval is the subject, not the check: the second check (and the first, when this
    process registered the artifact before) finds a passed check of the same bytes in the
    stack's check cache (``register_sklearn(reuse=True)``)."""
    clients = build_clients(stack_settings)
    uri = str(stack_settings.mlflow_tracking_uri)
    staged = []
    for _ in range(2):
        version = models.register_sklearn(uri, WATCHED, seed=0, reuse=True)
        report = run_check(stack_settings, clients, Policy(), model=WATCHED, version=version,
                           workdir=tmp_path_factory.mktemp(f"watch{version}"), stage=True)
        assert report.verdict == "passed", report
        staged.append(release_candidate(report))
    yield clients, staged[0].version, staged[1]
    canary_cleanup(clients, WATCHED)
    clients.close()


def _loaded(clients: Clients) -> list[str]:
    assert clients.canary is not None
    return sorted(str(m.get("version")) for m in clients.canary.repository_index()
                  if m.get("name") == WATCHED and m.get("state") in ("READY", "LOADING",
                                                                      "UNLOADING"))


def _inferences(clients: Clients, version: int) -> int:
    """Triton's successful inference count of ``version`` on the canary."""
    assert clients.canary is not None
    stats = clients.canary.grpc.get_inference_statistics(
        model_name=WATCHED, model_version=str(version), as_json=True)
    found = stats.get("model_stats") or [{}]
    return int(found[0].get("inference_stats", {}).get("success", {}).get("count", 0))


@pytest.fixture(scope="module")
def kept(stack_settings: Settings, watched: tuple[Clients, int, ReleaseCandidate],
         tmp_path_factory: pytest.TempPathFactory) -> CanaryResult:
    """The canary a release that waits for an approval runs, once for the module:
    ``run_canary(keep_loaded=True)`` measures and judges the candidate against the baseline
    and leaves both versions loaded on the canary Triton for the wait. The tests below take
    them over from there (:func:`_held_loaded`); measuring the same canary again for each
    would prove nothing more."""
    clients, baseline, release = watched
    result = run_canary(stack_settings, clients, Policy.model_validate(WATCH_POLICY),
                        model=WATCHED, candidate=release.version, baseline=baseline,
                        report_dir=tmp_path_factory.mktemp("kept") / "report",
                        keep_loaded=True, release=release)
    assert result.cleanup == KEPT_LOADED
    assert _loaded(clients) == sorted([str(baseline), str(release.version)])
    return result


def _held_loaded(settings: Settings, clients: Clients, baseline: int,
                 release: ReleaseCandidate) -> None:
    """Both versions loaded on the canary as :func:`kept`'s canary left them. After an
    earlier test's decision unloaded them, they are loaded again as the canary loads them
    (one config naming both versions, staged in S3) and answer once, as after the canary's
    load."""
    versions = [baseline, release.version]
    if _loaded(clients) != sorted(str(v) for v in versions):
        canary_cleanup(clients, WATCHED)
        assert clients.canary is not None
        config = with_versions(from_pbtxt(release.config_pbtxt), versions)
        clients.canary.load_model(WATCHED, config_json=to_json(config))
        wait_ready(clients.canary, WATCHED, versions, settings.control_timeout_s)
        inference = TritonInference(clients.canary.endpoint.http, timeout_s=30)
        try:
            for version in versions:
                inference.infer(WATCHED, release.rows(1), outputs=["label"],
                                version=str(version))
        finally:
            inference.close()
    assert _loaded(clients) == sorted(str(v) for v in versions)


@flow(name="approve-watched")
def watched_flow(key: str, timeout_s: int) -> dict[str, Any]:
    box = BOXES[key]
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None
    box["id"] = str(context.flow_run.id)
    record = ReleaseRecord.start("promote", WATCHED, requester="U0CAROL")
    record.holder["flow_run_id"] = box["id"]
    record.candidate = {**box["digest"], "canary_report_id": "canary-w"}
    journal = ReleaseJournal(record, None, NullNotifier())
    journal.open()
    box["record"] = record
    request = ApprovalRequest(required=True, approvers=("U0ALICE",), requester="U0CAROL",
                              timeout_s=timeout_s)
    channels = ApprovalChannels(notifier=None, resume=box["runs"].resume,
                                watch=box["watch"], watch_interval_s=0.5,
                                cleanup=box["cleanup"])
    try:
        return approve(request, journal, channels, model=WATCHED, version=box["version"])
    except ModelshipError as exc:
        return {"denied": exc.message, "exit_code": exc.exit_code}


@pytest.mark.parametrize("outcome", ["approve", "reject", "expire", "canary_lost"])
def test_the_candidate_stays_loaded_and_probed_while_waiting_then_is_unloaded(
        stack_settings: Settings, watched: tuple[Clients, int, ReleaseCandidate],
        kept: CanaryResult, outcome: str) -> None:
    clients, baseline, release = watched
    candidate = release.version
    policy = Policy.model_validate(WATCH_POLICY)
    _held_loaded(stack_settings, clients, baseline, release)  # as the kept canary left them
    digest = release.digest
    # The replicas do not serve this model: the watch looks at the canary only.
    canary_only = dataclasses.replace(clients, replicas=[])
    runs = PrefectRuns(stack_settings.prefect_api_url)
    box: dict[str, Any] = {
        "runs": runs, "digest": digest, "version": candidate,
        "watch": evidence_watch(stack_settings, canary_only, release=release,
                                baseline=baseline, rows=16, probe_s=0.5,
                                judge=EvidenceJudge(sequential_config(policy.gates))),
        "cleanup": lambda: canary_cleanup(clients, WATCHED)}
    before = _inferences(clients, candidate)
    thread = _in_thread(watched_flow, box, str(stack_settings.prefect_api_url),
                        8 if outcome == "expire" else 120)
    try:
        _wait_for(lambda: "id" in box and runs.state(box["id"]) == "PAUSED", 60, "the pause")
        _wait_for(lambda: _inferences(clients, candidate) >= before + 10, 30,
                  "probe traffic to the candidate on the canary")
        assert _loaded(clients) == sorted([str(baseline), str(candidate)])
        if outcome == "canary_lost":  # the canary stops serving it: nothing answers
            assert canary_cleanup(clients, WATCHED) == "unloaded from the canary"
        elif outcome != "expire":
            runs.resume(box["id"], {"release_id": box["record"].id, "channel": "prefect-ui",
                                    "digest": {k: box["record"].candidate[k] for k in (
                                        "model", "version", "onnx_sha256",
                                        "canary_report_id")},
                                    "decision": outcome, "user": "U0ALICE"})
        thread.join(60)
    finally:
        if thread.is_alive():
            runs.resume(box["id"], {"decision": "reject", "user": "cleanup",
                                    "release_id": "x", "digest": {}})
            thread.join(10)
    assert "error" not in box, box.get("error")
    pending = box["record"].approvals[0]
    expected = {"approve": "approved", "reject": "rejected", "expire": "expired",
                "canary_lost": "rejected"}[outcome]
    assert pending["status"] == expected, box["result"]
    assert _loaded(clients) == []
    if outcome == "canary_lost":
        # An unanswering canary is infrastructure (exit 1), never a gate breach (exit 5).
        assert box["result"]["exit_code"] == 1, box["result"]
        assert pending["decided_by"] == WATCHER
        assert pending["reason"].startswith("infrastructure: none of the")
        assert pending["cleanup"] == "nothing loaded on the canary"
        return
    assert pending["cleanup"] == "unloaded from the canary"
    assert pending.get("decided_by") in ("U0ALICE", None)
    assert box["result"].get("exit_code", 0) == (0 if outcome == "approve" else 5)


def test_an_infrastructure_finding_fails_the_release_not_the_candidate(
        stack_settings: Settings) -> None:
    runs = PrefectRuns(stack_settings.prefect_api_url)

    def watch() -> Finding:
        return Finding("infrastructure", "the canary server stopped answering: refused")

    box: dict[str, Any] = {"runs": runs, "watch": watch}
    thread = _in_thread(approve_flow, box, str(stack_settings.prefect_api_url), 120)
    thread.join(60)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert box["result"]["exit_code"] == 1 and "stopped answering" in box["result"]["denied"]
    pending = box["record"].approvals[0]
    assert (pending["status"], pending["decided_by"]) == ("rejected", "modelship-watcher")
    assert pending["cleanup"] == "nothing loaded on the canary"


def test_the_bake_probe_records_per_request_latencies_on_a_real_triton(
        stack_settings: Settings, watched: tuple[Clients, int, ReleaseCandidate],
        kept: CanaryResult) -> None:
    """The bake's window (tasks/bake.py measure_window) keeps each answered probe
    request's client latency, the samples of the always-valid latency rules, next to
    Triton's server-side mean; two windows of the same version judge as passed."""
    from modelship.policy import BakePolicy
    from tasks.bake import judge_windows, measure_window

    clients, baseline, release = watched
    candidate = release.version
    _held_loaded(stack_settings, clients, baseline, release)  # as the kept canary left them
    try:
        assert clients.canary is not None
        payload = release.rows(16)
        bake = BakePolicy(probe_rps=40, alpha=0.01, max_latency_increase_pct=200)  # busy box
        windows = [measure_window([clients.canary], index=i, model=WATCHED,
                                  version=candidate, payload=payload, policy=bake,
                                  seconds=1.0, timeout_s=stack_settings.http_timeout_s)
                   for i in (-1, 0)]
    finally:
        assert canary_cleanup(clients, WATCHED) == "unloaded from the canary"
    for window in windows:
        assert len(window.latencies_ms) >= 20 and min(window.latencies_ms) > 0
        assert window.server_us is not None and window.server_us > 0
        assert window.to_dict()["probe_ms"]["answered"] == len(window.latencies_ms)
    verdict = judge_windows(windows[1:], windows[0], bake)
    assert verdict.outcome == "passed", verdict.reason
