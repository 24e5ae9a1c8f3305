"""The holdback bake (issue 20 item 4) without servers: the bake's watch with a concurrent
control judges the fleet against the holdback's windows of the same time (a surge on both
is not blamed on the new version, a slower fleet is); the probe's records split per
target; and when a holdback applies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from modelship.errors import InfrastructureError
from modelship.loadgen import RequestRecord
from modelship.policy import BakePolicy, Policy
from modelship.traffic.port import TrafficSplit
from tasks import bake as baking
from tasks.holdback import holdback_applies, holdback_look, share_keeper

POLICY = BakePolicy(duration_s=30.0, window_s=2.0, probe_rps=40.0, holdback_pct=33.0,
                    max_latency_increase_pct=25.0)


def _window(index: int, rng: np.random.Generator, *, level_ms: float, rate: float
            ) -> baking.Window:
    lat = tuple(float(x) for x in level_ms * np.exp(rng.normal(0, 0.3, 40)))
    return baking.Window(index=index, seconds=2.0, requests=int(rate * 2), errors=0,
                         server_us=None, latencies_ms=lat, rate_rps=rate)


def _watch(monkeypatch: pytest.MonkeyPatch, seed: int, *, fleet_x: float,
           surge_x: float) -> baking.BakeReport:
    """A watch whose windows come from a seeded source: from window 3 on a surge
    multiplies both arms' latency by ``surge_x``; the fleet is ``fleet_x`` × the
    holdback throughout."""
    rng = np.random.default_rng(seed)
    calls: list[dict[str, Any]] = []

    def windows(replicas: Any, **kw: Any) -> tuple[baking.Window, baking.Window | None]:
        calls.append(kw)
        i = kw["index"]
        surge = surge_x if i >= 3 else 1.0
        rate = 20.0 * (10 if i >= 3 else 1)
        return (_window(i, rng, level_ms=2.0 * fleet_x * surge, rate=rate),
                _window(i, rng, level_ms=2.0 * surge, rate=rate / 2))

    monkeypatch.setattr(baking, "measure_windows", windows)
    report = baking.watch([], model="m", version=2, payload={}, policy=POLICY,
                          baseline=None, timeout_s=1.0,
                          holdback=baking.Holdback(server=None, version=1))  # type: ignore[arg-type]
    assert all(c["holdback"].version == 1 for c in calls)
    return report


def test_a_surge_that_reaches_the_holdback_too_is_not_a_breach(
        monkeypatch: pytest.MonkeyPatch) -> None:
    breaches = 0
    for seed in range(20):
        report = _watch(monkeypatch, seed, fleet_x=1.0, surge_x=2.5)
        assert report.baseline is not None and report.baseline.kind == "holdback"
        assert len(report.baseline.windows) == len(report.windows)
        assert not report.verdict.latency["held"]  # a concurrent control holds nothing
        breaches += report.verdict.outcome == "breach"
    assert breaches <= 1


def test_the_same_surge_against_the_pre_swap_reference_would_have_been_held() -> None:
    """What the control changes: against a pre-swap reference at 20 req/s, the surged
    windows are outside the load band and held (never judged)."""
    rng = np.random.default_rng(0)
    reference = baking.Reference(tuple(_window(-i, rng, level_ms=2.0, rate=20.0)
                                       for i in range(1, 9)))
    surged = [_window(i, rng, level_ms=5.0, rate=200.0) for i in range(15)]
    assert all(baking.load_departure(w, reference, POLICY) for w in surged)


def test_a_slower_fleet_is_a_breach_against_its_holdback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in range(5):
        report = _watch(monkeypatch, seed, fleet_x=1.8, surge_x=2.5)
        assert report.verdict.outcome == "breach", report.verdict.reason
        assert "latency_p" in report.verdict.reason


@dataclass
class _Endpoint:
    grpc: str
    metrics: str = ""


@dataclass
class _Server:
    name: str
    endpoint: _Endpoint


@dataclass
class _Report:
    records: list[RequestRecord]
    by_server: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: int = 0
    errors: int = 0
    error_texts: dict[str, int] = field(default_factory=dict)

    def measured_records(self) -> list[RequestRecord]:
        return self.records


def test_the_probe_splits_per_target_fleet_and_holdback() -> None:
    """One probe run over the replicas and the holdback: each window keeps its own
    targets' records (latencies, failures), never the other's."""
    replicas = [_Server("r0", _Endpoint("g0")), _Server("r1", _Endpoint("g1"))]
    canary = _Server("c", _Endpoint("gc"))
    recs = [RequestRecord(0.0, 1.0, True, None, 0, "2", 0),
            RequestRecord(0.0, 2.0, True, None, 1, "2", 0),
            RequestRecord(0.0, 9.0, True, None, 2, "1", 0),
            RequestRecord(0.0, 5.0, False, "UNAVAILABLE", 2, "", 0)]
    report = _Report(recs, by_server={"g0": {"requests": 1}, "g1": {"requests": 1},
                                      "gc": {"requests": 2, "errors": 1}},
                     requests=4, errors=1, error_texts={"UNAVAILABLE": 1})
    fleet = baking._window_of(replicas, [0, 1], report, {}, {}, {}, {}, index=0,  # type: ignore[arg-type]
                              key=("m", "2"), seconds=2.0, whole=False)
    held = baking._window_of([canary], [2], report, {}, {}, {}, {}, index=0,  # type: ignore[list-item]
                             key=("m", "1"), seconds=2.0, whole=False)
    assert (fleet.latencies_ms, fleet.errors, fleet.probe_requests) == ((1.0, 2.0), 0, 2)
    assert (held.latencies_ms, held.errors, held.probe_requests) == ((9.0,), 1, 2)
    assert held.error_texts == {"UNAVAILABLE": 1} and fleet.error_texts == {}


@pytest.mark.parametrize(("holdback", "duration", "previous", "applies"), [
    (33.0, 20.0, 1, True),
    (0.0, 20.0, 1, False),     # not asked for
    (33.0, 20.0, None, False),  # a first release: nothing to hold back
])
def test_when_a_holdback_applies(holdback: float, duration: float, previous: int | None,
                                 applies: bool) -> None:
    policy = Policy(bake=BakePolicy(holdback_pct=holdback, duration_s=duration))
    assert holdback_applies(policy, previous) is applies


def test_the_dry_run_plan_names_the_control() -> None:
    held = baking.plan(BakePolicy(duration_s=30, holdback_pct=33))
    assert held["holdback_pct"] == 33 and held["control"].startswith("holdback: ")
    assert baking.plan(BakePolicy(duration_s=30))["control"].startswith("pre-swap reference")


# --------------------------------------------------------------------------------------
# holdback_pct at 5 % (the example)

FIVE = BakePolicy(duration_s=30.0, window_s=2.0, probe_rps=40.0, holdback_pct=5.0,
                  max_latency_increase_pct=25.0)


def test_five_percent_is_rendered_as_five_percent_of_live_requests(tmp_path: Any) -> None:
    """The holdback's share as the gateway holds it: 5 % of requests to the canary
    (previous version), the rest to the replicas, nothing mirrored."""
    from modelship import nginx
    from modelship.traffic.local_gateway import as_live
    from modelship.traffic.port import TrafficSplit

    share = TrafficSplit(canary_pct=FIVE.holdback_pct)
    assert as_live(share) == share and share.production_pct == 95.0
    layout = nginx.GatewayLayout(1, 2, 3, (("a:1", "b:2"), ("e:5", "f:6")), ("c:3", "d:4"),
                                 str(tmp_path), str(tmp_path / "e.log"))
    text = nginx.render_config(layout, share.canary_pct, share.mirror_pct, "g")
    assert 'split_clients "${request_id}" $modelship_route {\n        5% canary;\n' \
           '        * production;\n    }' in text
    assert "proxy_pass http://${modelship_route}_http;" in text
    assert "grpc_pass grpc://${modelship_route}_grpc;" in text
    assert "mirror /_modelship_mirror" not in text


def _thin(index: int, rng: np.random.Generator, probes: int) -> baking.Window:
    lat = tuple(float(x) for x in 2.0 * np.exp(rng.normal(0, 0.3, probes)))
    return baking.Window(index=index, seconds=2.0, requests=probes + 5, errors=0,
                         server_us=None, latencies_ms=lat, rate_rps=3.0)


def test_a_holdback_window_with_too_few_probes_is_held_not_judged_and_said() -> None:
    """At 5 % the holdback's live share is small; its probe share is not (the probe goes
    to every target alike), but a holdback that answers fewer than MIN_BLOCK_PROBES in a
    window (slow, failing) leaves that window without a control: held, with the reason,
    never silently dropped while counted as judged, never a breach."""
    rng = np.random.default_rng(1)
    n = baking.total_windows(FIVE)
    fleet = [_window(i, rng, level_ms=4.0, rate=100.0) for i in range(n)]  # x2 slower
    thin = {2, 5, 7}
    control = baking.Reference(tuple(
        _thin(i, rng, baking.MIN_BLOCK_PROBES - 1) if i in thin
        else _window(i, rng, level_ms=2.0, rate=5.0) for i in range(n)), kind="holdback")
    state = baking.latency_state(fleet, control, FIVE)
    assert set(state["held"]) == thin, state["held"]
    assert state["judged"] == n - len(thin) and state["status"] == "partly held"
    assert f"fewer than {baking.MIN_BLOCK_PROBES}" in state["held"][2]
    assert "answered 9 probe requests" in state["held"][2]
    assert state["breach"]  # the windows with a control still judge a slower fleet


def test_a_holdback_too_thin_in_every_window_holds_the_bake_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bake's verdict when the holdback never had enough probes: ``held`` (latency
    not judged), not ``passed`` as if judged, not a breach; the record says why."""
    rng = np.random.default_rng(2)

    def windows(replicas: Any, **kw: Any) -> tuple[baking.Window, baking.Window | None]:
        i = kw["index"]
        return (_window(i, rng, level_ms=6.0, rate=100.0),
                _thin(i, rng, baking.MIN_BLOCK_PROBES - 4))

    monkeypatch.setattr(baking, "measure_windows", windows)
    report = baking.watch([], model="m", version=2, payload={}, policy=FIVE,
                          baseline=None, timeout_s=1.0,
                          holdback=baking.Holdback(server=None, version=1))  # type: ignore[arg-type]
    verdict = report.verdict
    assert verdict.outcome == "held", verdict.reason
    assert "no holdback to compare with" in verdict.reason
    assert "the holdback answered 6 probe requests" in verdict.reason
    assert len(verdict.latency["held"]) == len(report.windows) > 0


# --------------------------------------------------------------------------------------
# the share read back after every window (a gateway restarted, a hand changed it)

HOLD = TrafficSplit(canary_pct=5.0)


@pytest.mark.parametrize(("live", "problem", "restores", "kind", "said"), [
    (TrafficSplit(canary_pct=5.0), None, 0, "ok", None),
    (TrafficSplit(canary_pct=5.0), None, 1, "ok", None),            # held after a restore
    (TrafficSplit(canary_pct=5.004), None, 0, "ok", None),          # the routers' precision
    (TrafficSplit(), None, 0, "restore", "held 0 % to the canary, not the holdback's 5 %"),
    (TrafficSplit(canary_pct=50.0), None, 0, "restore", "held 50 % to the canary"),
    (TrafficSplit(5.0, 10.0), None, 0, "restore", "10 % mirrored"),  # a mirror added
    (TrafficSplit(), None, 1, "fail", "after 1 restore already: something else steers"),
    (None, "connection refused", 0, "fail", "did not answer (connection refused)"),
    (None, "connection refused", 1, "fail", "a dead or stuck gateway"),
])
def test_the_holdback_share_read_back_after_a_window(
        live: TrafficSplit | None, problem: str | None, restores: int, kind: str,
        said: str | None) -> None:
    look = holdback_look(HOLD, live, problem, window=3, restores=restores)
    assert look.kind == kind, look
    if said is None:
        assert look.reason is None
    else:
        assert look.reason is not None and said in look.reason and "window 3" in look.reason
    if kind == "restore":
        assert "held (not judged" in (look.reason or "")


class _Router:
    """A router whose live split a test changes between windows ("another hand")."""

    name = "fake-gateway"

    def __init__(self, *, dead: bool = False, sticky: bool = False) -> None:
        self.split = HOLD
        self.dead, self.sticky = dead, sticky
        self.sets: list[float] = []

    def set_weights(self, pct: float) -> None:
        self.sets.append(pct)
        if not self.sticky:
            self.split = TrafficSplit(pct, self.split.mirror_pct)

    def mirror(self, pct: float) -> None:
        if not self.sticky:
            self.split = TrafficSplit(self.split.canary_pct, pct)

    def live(self) -> TrafficSplit:
        if self.dead:
            raise InfrastructureError("the local gateway did not answer")
        return self.split


class _Canary:
    name = "canary"

    def __init__(self, serves: bool = True) -> None:
        self.serves = serves

    def is_model_ready(self, model: str, version: str) -> bool:
        return self.serves and (model, version) == ("m", "1")


def _keeping_watch(monkeypatch: pytest.MonkeyPatch, router: _Router, canary: _Canary,
                   changes: dict[int, TrafficSplit]) -> baking.BakeReport:
    """A holdback watch of an identical fleet whose router a test changes after the
    windows in ``changes`` (as a restarted gateway or a hand would)."""
    rng = np.random.default_rng(4)

    def windows(replicas: Any, **kw: Any) -> tuple[baking.Window, baking.Window | None]:
        i = kw["index"]
        if i in changes:
            router.split = changes[i]
        return (_window(i, rng, level_ms=2.0, rate=100.0),
                _window(i, rng, level_ms=2.0, rate=5.0))

    monkeypatch.setattr(baking, "measure_windows", windows)
    check = share_keeper(router, HOLD, canary, model="m", previous=1,  # type: ignore[arg-type]
                    progress=lambda _: None)
    return baking.watch([], model="m", version=2, payload={}, policy=FIVE, baseline=None,
                        timeout_s=1.0, holdback=baking.Holdback(
                            server=canary, version=1, check=check))  # type: ignore[arg-type]


def test_a_share_lost_mid_bake_is_restored_once_and_its_window_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway restarted at production only after window 4: the bake restores the
    share (the canary still serves v1), holds window 4 with the reason, judges the rest."""
    router = _Router()
    report = _keeping_watch(monkeypatch, router, _Canary(), {4: TrafficSplit()})
    assert router.sets == [5.0] and router.split == HOLD
    held = report.verdict.latency["held"]
    assert list(held) == ["4"], held
    assert "held 0 % to the canary" in held["4"] and "restored" in held["4"]
    assert report.verdict.outcome == "passed", report.verdict.reason
    assert report.windows and report.baseline is not None
    assert report.baseline.windows[4].to_dict()["held_for"] == held["4"]


@pytest.mark.parametrize(("router", "canary", "changes", "said"), [
    (_Router(), _Canary(), {2: TrafficSplit(), 6: TrafficSplit(canary_pct=50.0)},
     "something else steers the router"),
    (_Router(dead=True), _Canary(), {}, "did not answer"),
    (_Router(), _Canary(serves=False), {3: TrafficSplit()}, "no longer serves m v1"),
    (_Router(sticky=True), _Canary(), {3: TrafficSplit()}, "the restore did not take"),
])
def test_a_share_that_cannot_be_kept_fails_the_bake_as_infrastructure(
        monkeypatch: pytest.MonkeyPatch, router: _Router, canary: _Canary,
        changes: dict[int, TrafficSplit], said: str) -> None:
    """Changed twice, a dead gateway, a canary that lost v1 (restoring would fail live
    requests), a restore that does not take: exit 1, and the message says the weights go
    back to production (``holding`` around the bake does it on the way out)."""
    with pytest.raises(InfrastructureError) as caught:
        _keeping_watch(monkeypatch, router, canary, changes)
    assert said in caught.value.message and caught.value.exit_code == 1
    assert "the weights return to 100 % production" in caught.value.message
