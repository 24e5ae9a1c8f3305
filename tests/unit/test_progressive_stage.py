"""Promote's progressive canary stage (tasks.progressive.live_canary) with its I/O
replaced: an in-memory router, scripted Triton counters per look, no canary load. A slow
candidate is stepped back at the first step (exit 4), the record holds each step, the
router ends at production; a dead router is an infrastructure failure (exit 1)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from modelship.errors import GateFailed, InfrastructureError
from modelship.ledger import ReleaseRecord
from modelship.policy import CanaryPolicy, Policy
from modelship.slack.notifier import NullNotifier
from modelship.split_scope import SplitScope
from modelship.traffic.port import PRODUCTION_ONLY
from modelship.triton.metrics import COMPUTE_INFER_US, SUCCESS, VersionMetrics
from tasks import live_traffic, progressive
from tasks.record import ReleaseJournal
from tests.fake_router import FakeRouter

MODEL = "m"


@dataclass
class _Server:
    name: str


@dataclass
class _Clients:
    canary: _Server = field(default_factory=lambda: _Server("canary"))
    replicas: list[_Server] = field(default_factory=lambda: [_Server("r0"), _Server("r1")])
    storage: None = None


@dataclass
class _Release:
    config_pbtxt: str = ""


class _Counters:
    """Cumulative counters per server: at each scrape the candidate (v2, on the canary)
    and production (v1, on the replicas) each served ``per_look`` more requests, at
    ``c_us`` and ``p_us`` per request."""

    def __init__(self, c_us: float, p_us: float, per_look: int = 10) -> None:
        self.c_us, self.p_us, self.per_look = c_us, p_us, per_look
        self.looks = 0

    def scrape(self, servers: Any, timeout_s: float) -> tuple[dict[str, Any], dict[str, str]]:
        n = self.looks * self.per_look
        self.looks += 1
        out: dict[str, Any] = {"canary": {(MODEL, "2"): VersionMetrics(counters={
            SUCCESS: n, COMPUTE_INFER_US: n * self.c_us})}}
        for name in ("r0", "r1"):
            out[name] = {(MODEL, "1"): VersionMetrics(counters={
                SUCCESS: 10 * n, COMPUTE_INFER_US: 10 * n * self.p_us})}
        return out, {}


def _run(monkeypatch: pytest.MonkeyPatch, router: FakeRouter, counters: _Counters
         ) -> tuple[ReleaseRecord, Any]:
    @contextmanager
    def loaded(*args: Any, **kwargs: Any) -> Iterator[None]:
        yield

    monkeypatch.setattr(live_traffic, "configured_router",
                        lambda settings, progress, scope=None: router)
    monkeypatch.setattr(live_traffic, "split_scope",
                        lambda clients, model, progress: SplitScope(model))
    monkeypatch.setattr(progressive, "serving_on_canary", loaded)
    monkeypatch.setattr(progressive, "scrape_servers", counters.scrape)
    monkeypatch.setattr(progressive, "LOOK_S", 0.0)
    policy = Policy(canary=CanaryPolicy(traffic="progressive", steps=[5, 25, 50],
                                        step_min_s=0.0001, step_max_s=60.0))
    record = ReleaseRecord.start("promote", MODEL, to_version=2, from_version=1)
    journal = ReleaseJournal(record, None, NullNotifier())
    settings: Any = type("S", (), {"http_timeout_s": 1.0})()
    try:
        progressive.live_canary(settings, _Clients(), policy, journal,  # type: ignore[arg-type]
                                serving=1, release=_Release())  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return record, exc
    return record, None


def test_a_slow_candidate_is_stepped_back_at_the_first_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    router = FakeRouter()
    record, exc = _run(monkeypatch, router, _Counters(c_us=6000.0, p_us=1500.0))
    assert isinstance(exc, GateFailed) and exc.exit_code == 4, exc
    events = record.traffic["events"]
    assert [(e["action"], e["from_weight_pct"], e["weight_pct"]) for e in events] == [
        ("advance", 0.0, 5.0), ("step_back", 5.0, 0.0)]
    assert record.traffic["split"]["canary_pct"] == 0.0
    assert router.split == PRODUCTION_ONLY
    assert ("set_weights", 25.0) not in router.calls  # never went past the first step
    stages = {s.name: s for s in record.stages}
    assert stages["canary"].outcome == "ok" and stages["gates"].outcome == "failed"
    judge = stages["canary"].details["judge"]
    assert judge["status"] == "failed" and judge["latency"]["looks_above"] >= 8
    assert stages["canary"].details["to_production_s"] >= 0.0
    assert record.gates["mode"] == "progressive"


def test_a_candidate_as_fast_as_production_is_handed_to_the_swap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    router = FakeRouter()
    record, exc = _run(monkeypatch, router, _Counters(c_us=1000.0, p_us=1500.0,
                                                      per_look=2000))
    assert exc is None
    assert [e["weight_pct"] for e in record.traffic["events"]] == [5.0, 25.0, 50.0, 0.0]
    assert record.traffic["events"][-1]["action"] == "swap"
    assert router.split == PRODUCTION_ONLY
    assert record.gates["verdict"] == "passed"


def test_a_dead_router_is_an_infrastructure_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    router = FakeRouter(dead=True)
    record, exc = _run(monkeypatch, router, _Counters(c_us=1000.0, p_us=1500.0))
    assert isinstance(exc, InfrastructureError) and exc.exit_code == 1, exc
    assert record.traffic["events"][-1]["outcome"] == "infrastructure"
    assert [s.name for s in record.stages] == ["canary"]  # no verdict on the candidate


def test_the_release_error_names_the_judges_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    _, exc = _run(monkeypatch, FakeRouter(), _Counters(c_us=6000.0, p_us=1500.0))
    assert isinstance(exc, GateFailed)
    assert "breach at step 1/3 (5 %)" in exc.message
    assert "latency_p50: slower on live traffic" in exc.message


class _BusierCanary(_Counters):
    """An identical model whose server answers slower as its per-server load grows past a
    replica's: at each scrape the candidate's µs per request is production's × the
    canary server's load (from the router's live weight, 2 replicas) when above 1."""

    def __init__(self, router: FakeRouter, p_us: float, per_look: int) -> None:
        super().__init__(c_us=p_us, p_us=p_us, per_look=per_look)
        self.router, self.c_total = router, 0.0

    def scrape(self, servers: Any, timeout_s: float) -> tuple[dict[str, Any], dict[str, str]]:
        out, failed = super().scrape(servers, timeout_s)
        w = self.router.split.canary_pct / 100.0
        load = w * 2 / (1 - w)
        n = out["canary"][(MODEL, "2")].counters[SUCCESS]
        self.c_total += self.per_look * self.p_us * max(1.0, load) if n else 0.0
        out["canary"] = {(MODEL, "2"): VersionMetrics(counters={
            SUCCESS: n, COMPUTE_INFER_US: self.c_total})}
        return out, failed


def test_the_plan_and_each_step_say_the_canary_servers_load_and_latency_is_judged_at_fair_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 5 -> 25 -> 50 % with 2 replicas: 0.11×, 0.67×, 2× a replica's load. The plan
    is on the canary stage before the first step; each event says its step's load and
    whether latency is judged there; at 50 % the candidate's 2×-slower looks (its server
    is twice as busy) count for errors only, and it is handed to the swap."""
    router = FakeRouter()
    record, exc = _run(monkeypatch, router, _BusierCanary(router, 1500.0, per_look=2000))
    assert exc is None, exc
    events = record.traffic["events"]
    assert [(e["weight_pct"], e["load_ratio"], e["latency_judged"]) for e in events] == [
        (5.0, 0.1053, True), (25.0, 0.6667, True), (50.0, 2.0, False), (0.0, 0.0, True)]
    canary = next(s for s in record.stages if s.name == "canary")
    loads = canary.details["step_loads"]
    assert loads["replicas"] == 2 and loads["warning"] is None
    assert [s["above_equal_load"] for s in loads["steps"]] == [False, False, True]
    latency = canary.details["judge"]["latency"]
    assert latency["looks_not_judged_for_load"] >= 1   # the 50 % step's looks
    assert latency["looks_above"] == 0                 # none of them counted as slower
    assert record.gates["verdict"] == "passed"
