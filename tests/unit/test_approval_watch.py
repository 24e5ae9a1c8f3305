"""The approval wait's watcher (tasks/approve.py): the same always-valid tests as the
sequential canary on a paired probe of the candidate, production's errors through the
bake's e-process, and infrastructure that is never a gate breach.

Seeded fake measurements; the margins are one-sided binomial bounds for the number of
waits (tests/unit/rates.py).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from modelship.candidate import ReleaseCandidate, ResolvedVersion
from modelship.repository import SHA256_METADATA, manifest_key
from tasks import approve as approve_module
from tasks.approve import (
    BASELINE,
    CANDIDATE,
    ApprovalChannels,
    EvidenceJudge,
    Finding,
    ProbeBatch,
    _Watcher,
    canary_cleanup,
    evidence_watch,
    probe_batch,
    production_change,
)
from tasks.sequential import SequentialConfig
from tests.unit.rates import most_rejections

CONFIG = SequentialConfig(alpha=0.05, max_increase_pct=10.0, max_error_rate=0.01)


def _pairs(rng: np.random.Generator, n: int, *, slower: float = 1.0,
           candidate_error_rate: float = 0.0) -> ProbeBatch:
    """One look: n paired requests; the candidate ``slower`` times the baseline's latency
    distribution (lognormal around 2 ms, σ = 0.3), failing at ``candidate_error_rate``."""
    base = 2.0 * rng.lognormal(0.0, 0.3, size=n)
    cand = slower * 2.0 * rng.lognormal(0.0, 0.3, size=n)
    fails = int(rng.binomial(n, candidate_error_rate)) if candidate_error_rate else 0
    return ProbeBatch(base, cand[: n - fails], 0, fails)


def _wait(judge: EvidenceJudge, rng: np.random.Generator, looks: int, **kwargs: Any
          ) -> tuple[int, Finding] | None:
    for look in range(looks):
        found = judge.conclude([judge.probe(_pairs(rng, 20, **kwargs))])
        if found is not None:
            return look + 1, found
    return None


def test_a_a_wait_watched_for_many_looks_rarely_rejects() -> None:
    """60 waits of 50 looks (20 pairs each, 1 000 pairs): false rejections no more than a
    rule at exactly α shows (one-sided binomial bound for 60 runs: 7, 12%)."""
    rng = np.random.default_rng(21)
    runs = 60
    found = [_wait(EvidenceJudge(CONFIG), rng, 50) for _ in range(runs)]
    rejected = [f for f in found if f is not None]
    assert len(rejected) <= most_rejections(CONFIG.alpha, runs)
    assert all(f[1].kind == "breach" for f in rejected)


def test_a_latency_regression_on_the_candidate_is_caught() -> None:
    rng = np.random.default_rng(22)
    found = [_wait(EvidenceJudge(CONFIG), rng, 40, slower=1.5) for _ in range(40)]
    caught = [f for f in found if f is not None]
    assert len(caught) >= 38
    assert all(f[1].kind == "breach" and "latency_p" in f[1].reason for f in caught)
    assert float(np.median([f[0] for f in caught])) <= 10
    assert "the candidate on the canary" in caught[0][1].reason


def test_candidate_errors_over_the_budget_are_caught() -> None:
    rng = np.random.default_rng(23)
    found = _wait(EvidenceJudge(CONFIG), rng, 40, candidate_error_rate=0.1)
    assert found is not None and found[1].kind == "breach"
    assert "error_rate" in found[1].reason


def test_nothing_answered_or_both_arms_failing_is_infrastructure_never_a_breach() -> None:
    judge = EvidenceJudge(CONFIG)
    dead = ProbeBatch(np.empty(0), np.empty(0), 20, 20, "connection refused")
    assert judge.conclude([judge.probe(dead)]) is None  # once is a blip
    found = judge.conclude([judge.probe(dead)])
    assert found is not None and found.kind == "infrastructure"
    assert "none of the 40 probe requests" in found.reason and "refused" in found.reason
    assert "two looks in a row" in found.reason
    shared = EvidenceJudge(CONFIG)
    rng = np.random.default_rng(24)
    kinds = []
    for _ in range(10):
        half = ProbeBatch(2.0 * rng.lognormal(0, 0.3, 10), 2.0 * rng.lognormal(0, 0.3, 10),
                          10, 10)
        reason = shared.probe(half)
        kinds.append(reason[0] if reason else None)
    assert "infrastructure" in kinds and "breach" not in kinds


def test_evidence_and_infrastructure_need_two_looks_in_a_row_a_breach_does_not() -> None:
    judge = EvidenceJudge(CONFIG)
    gone = ("evidence", "triton-0 no longer serves m v1")
    assert judge.conclude([None, gone]) is None
    assert judge.conclude([None]) is None  # a clean look clears it
    assert judge.conclude([gone]) is None
    found = judge.conclude([gone])
    assert found == Finding("evidence", "triton-0 no longer serves m v1 (two looks in a row)")
    breach = ("breach", "production m v1 failed")
    assert EvidenceJudge(CONFIG).conclude([gone, breach]) == Finding("breach",
                                                                      "production m v1 failed")


def test_production_errors_at_the_budget_rarely_reject_however_long_the_wait() -> None:
    rng = np.random.default_rng(25)
    runs, budget, alpha = 200, 0.01, 0.05
    rejected = 0
    for _ in range(runs):
        judge = EvidenceJudge(CONFIG, max_error_rate=budget, alpha=alpha)
        for _ in range(60):
            failures = float(rng.binomial(200, budget))
            if judge.production(failures, 200 - failures, model="m", version=1):
                rejected += 1
                break
    assert rejected <= most_rejections(alpha, runs)


def test_production_errors_well_over_the_budget_reject_quickly() -> None:
    judge = EvidenceJudge(CONFIG, max_error_rate=0.01, alpha=0.01)
    assert judge.production(2, 198, model="m", version=1) is None
    found = judge.production(12, 188, model="m", version=1)
    assert found is not None and found[0] == "breach"
    assert "production m v1 failed 14 of 400 requests" in found[1] and "1/α = 100" in found[1]


def _scrape(success: int, failure: int) -> Any:
    from modelship.triton.metrics import parse_metrics

    labels = 'model="m",version="1"'
    return parse_metrics(f"nv_inference_request_success{{{labels}}} {success}\n"
                         f'nv_inference_request_failure{{{labels},reason="X"}} {failure}\n')


def test_production_change_adds_replicas_and_skips_new_ones() -> None:
    before = {"a": _scrape(100, 1), "b": _scrape(50, 0)}
    after = {"a": _scrape(190, 3), "b": _scrape(80, 1), "c": _scrape(999, 99)}
    assert production_change(before, after, model="m", version=1) == (3.0, 120.0)
    assert production_change({}, after, model="m", version=1) == (0.0, 0.0)


class _Record:
    def __init__(self, tag: str | None, ok: bool, latency_ms: float) -> None:
        self.tag, self.ok, self.latency_ms = tag, ok, latency_ms
        self.error = None if ok else "StatusCode.UNAVAILABLE"


def test_probe_batch_splits_the_arms_and_counts_errors() -> None:
    batch = probe_batch([_Record("baseline", True, 1.0), _Record("candidate", True, 2.0),
                         _Record("candidate", False, 9.0), _Record(None, True, 3.0)])
    assert batch.baseline_ms.tolist() == [1.0] and batch.candidate_ms.tolist() == [2.0, 3.0]
    assert (batch.baseline_errors, batch.candidate_errors) == (0, 1)
    assert batch.first_error == "StatusCode.UNAVAILABLE"
    assert (batch.sent, batch.answered) == (4, 3)


def _watcher(watch: Any) -> _Watcher:
    channels = ApprovalChannels(notifier=None, watch=watch, watch_interval_s=0.01)
    pending = {"flow_run_id": "r", "release_id": "R", "digest": {}, "expires_at": 0}
    return _Watcher(channels, pending, journal=None)


def _run_until_found(watcher: _Watcher) -> None:
    watcher.start()
    deadline = time.monotonic() + 5
    while watcher.finding is None and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.stop()


def test_the_watcher_takes_plain_reasons_as_breaches_and_two_failed_looks_as_infrastructure(
        ) -> None:
    plain = _watcher(lambda: "error rate rose")
    _run_until_found(plain)
    assert plain.finding == Finding("breach", "error rate rose")
    assert plain.breach == "error rate rose"
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise ConnectionError("refused")

    failing = _watcher(broken)
    _run_until_found(failing)
    assert failing.finding is not None and failing.finding.kind == "infrastructure"
    assert "twice in a row: ConnectionError: refused" in failing.finding.reason
    assert len(calls) == 2


class _Canary:
    """A canary whose repository index follows loads and unloads (Triton's answer shape)."""

    def __init__(self, loaded: bool, unload_works: bool = True) -> None:
        self.state = "READY" if loaded else "UNAVAILABLE"
        self.unload_works = unload_works
        self.unloads = 0
        self.lock = threading.Lock()

    def repository_index(self) -> list[dict[str, Any]]:
        return [{"name": "m", "version": "2", "state": self.state}]

    def unload_model(self, name: str) -> None:
        self.unloads += 1
        if self.unload_works:
            self.state = "UNAVAILABLE"


class _Clients:
    def __init__(self, canary: _Canary | None) -> None:
        self.canary = canary


@pytest.mark.parametrize(("canary", "says", "unloads"), [
    (_Canary(loaded=True), "unloaded from the canary", 1),
    (_Canary(loaded=False), "nothing loaded on the canary", 0),
    (None, "no canary server", 0),
    (_Canary(loaded=True, unload_works=False), "canary cleanup failed: m still loaded", 1),
])
def test_canary_cleanup(canary: _Canary | None, says: str, unloads: int) -> None:
    assert canary_cleanup(_Clients(canary), "m", wait_s=0.2).startswith(says)
    assert (canary.unloads if canary else 0) == unloads


class _Journal:
    def __init__(self) -> None:
        self.record = type("Record", (), {"model": "m"})()
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


@pytest.mark.parametrize(("keep", "unloads"), [(True, 1), (False, 0)])
def test_promote_unloads_a_kept_canary_when_anything_fails_before_the_wait(
        keep: bool, unloads: int) -> None:
    """flows/promote.py: failed gates (or any error) after a canary that kept the
    candidate loaded for the approval wait still unload it; nothing is touched otherwise."""
    from flows.promote import _unload_kept_canary

    canary, journal = _Canary(loaded=True), _Journal()
    with pytest.raises(RuntimeError), \
            _unload_kept_canary(_Clients(canary), journal, keep=keep):  # type: ignore[arg-type]
        raise RuntimeError("the gates stopped m v2")
    assert canary.unloads == unloads
    assert journal.notes == (["canary kept for the approval wait: unloaded from the canary"]
                             if keep else [])


# --------------------------------------------------------------------------------------
# the watch takes the release candidate: nothing about the candidate is loaded again

SHA = "ab" * 32


class _Storage:
    """The staged manifest's HEAD; any other call fails the test."""

    def __init__(self, sha256: str | None) -> None:
        self.sha256 = sha256
        self.heads: list[str] = []

    def head(self, key: str) -> dict[str, Any] | None:
        self.heads.append(key)
        if self.sha256 is None:
            return None
        return {"size": 10, "metadata": {SHA256_METADATA: self.sha256}}

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the watch called storage.{name}")


class _NoRegistry:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the watch called registry.{name}")


class _Pinging:
    endpoint = SimpleNamespace(grpc="127.0.0.1:1")

    def ping(self) -> None:
        return None


def _release() -> ReleaseCandidate:
    resolved = ResolvedVersion(name="m", version=2, flavor="onnx", flavors=("onnx",),
                               source="models:/m-1", run_id="r", signature=None,
                               metrics={}, aliases=(), tags={}, local_dir=Path("/nowhere"))
    return ReleaseCandidate(resolved=resolved, feed={"x": np.arange(200.0).reshape(100, 2)},
                            feed_source="artifact", config_pbtxt='name: "m"',
                            digest={"model": "m", "version": 2, "manifest_sha256": SHA})


def _answered(n: int) -> SimpleNamespace:
    records = [SimpleNamespace(tag=tag, ok=True, latency_ms=2.0, error=None)
               for _ in range(n) for tag in (BASELINE, CANDIDATE)]
    return SimpleNamespace(measured_records=lambda: records)


def _watch(monkeypatch: pytest.MonkeyPatch, storage: _Storage
           ) -> tuple[Any, list[Any]]:
    sent: list[Any] = []

    def probe(url: str, model: str, version: int, baseline: int | None, payload: Any,
              **_: Any) -> SimpleNamespace:
        sent.append((model, version, baseline, payload))
        return _answered(20)

    monkeypatch.setattr(approve_module, "_probe", probe)
    monkeypatch.setattr(approve_module, "canary_slot", lambda *a, **k: nullcontext())
    clients = SimpleNamespace(replicas=[], canary=_Pinging(), storage=storage,
                              registry=_NoRegistry())
    settings = SimpleNamespace(repository_prefix="P", http_timeout_s=1.0)
    watch = evidence_watch(settings, clients, release=_release(), baseline=1, rows=16,
                           judge=EvidenceJudge(CONFIG))
    return watch, sent


def test_the_watch_probes_with_the_release_rows_and_loads_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    storage = _Storage(SHA)
    watch, sent = _watch(monkeypatch, storage)
    for _ in range(3):
        assert watch() is None
    assert len(sent) == 3
    for model, version, baseline, payload in sent:
        assert (model, version, baseline) == ("m", 2, 1)
        np.testing.assert_array_equal(payload["x"], _release().feed["x"][:16])
    # one HEAD of the staged manifest per look; no GET, no MLflow
    assert storage.heads == [manifest_key("P", "m", 2)] * 3


@pytest.mark.parametrize(("staged", "says"), [("cd" * 32, "manifest cdcdcdcdcdcd"),
                                              (None, "manifest absent"),
                                              ("", "manifest unmarked")])
def test_a_staged_manifest_that_changed_or_went_is_evidence_on_the_second_look(
        monkeypatch: pytest.MonkeyPatch, staged: str | None, says: str) -> None:
    watch, _ = _watch(monkeypatch, _Storage(staged))
    assert watch() is None  # once is a blip
    found = watch()
    assert found is not None and found.kind == "evidence"
    assert "the staged m v2 changed after its canary" in found.reason
    assert says in found.reason and f"canary saw {SHA[:12]}" in found.reason
