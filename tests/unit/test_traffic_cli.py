"""What `modelship status` and `modelship reconcile` say about the traffic router."""

from __future__ import annotations

from typing import Any

import pytest

from modelship.cli.fleet import _render_reconcile, _render_status, _traffic_line
from modelship.split_scope import SplitScope, scope_report
from modelship.traffic.port import TrafficSplit
from tasks.traffic_state import live_traffic

STATUS: dict[str, Any] = {
    "model": "m", "pin": None, "replicas": [], "unread": ["s3", "mlflow"], "aliases": {},
    "record": None, "summary": "m: nothing; never released", "in_progress": None,
    "disagreements": [], "notes": [], "next": None}


@pytest.mark.parametrize(("traffic", "line"), [
    ({"router": "local-gateway", "live": {"production_pct": 95.0, "canary_pct": 5.0,
                                           "mirror_pct": 0.0}},
     "traffic (local-gateway): 95 % production, 5 % canary"),
    ({"router": "gateway-api", "live": {"production_pct": 100.0, "canary_pct": 0.0,
                                         "mirror_pct": 10.0}},
     "traffic (gateway-api): 100 % production, 0 % canary, 10 % mirrored to the canary"),
    ({"router": "local-gateway", "live": None, "error": "no answer within 4 s"},
     "traffic (local-gateway): not read: no answer within 4 s"),
    ({"router": "local-gateway", "live": {"production_pct": 95.0, "canary_pct": 5.0,
                                           "mirror_pct": 0.0},
      "scope": scope_report(SplitScope("fraud"))},
     "traffic (local-gateway): 95 % production, 5 % canary; applies to fraud's HTTP "
     "requests (/v2/models/fraud/...); gRPC requests stay on production (gRPC names the "
     "model inside the body, which the gateway does not read)"),
    ({"router": "local-gateway", "live": {"production_pct": 50.0, "canary_pct": 50.0,
                                           "mirror_pct": 0.0},
      "scope": scope_report(SplitScope("fraud", grpc=True))},
     "traffic (local-gateway): 50 % production, 50 % canary; applies to fraud's HTTP "
     "requests (/v2/models/fraud/...); its gRPC requests too (the fleet serves no other "
     "model)"),
    ({"router": "local-gateway", "live": {"production_pct": 90.0, "canary_pct": 10.0,
                                           "mirror_pct": 0.0}, "scope": scope_report(None)},
     "traffic (local-gateway): 90 % production, 10 % canary; applies to every request "
     "through the gateway, HTTP and gRPC, of every model (unscoped)"),
])
def test_status_shows_the_live_weights(traffic: dict[str, Any], line: str) -> None:
    assert _traffic_line(traffic) == line
    assert line in _render_status({**STATUS, "traffic": traffic}).splitlines()


@pytest.mark.parametrize(("canary_pct", "replicas", "says"), [
    (50.0, 2, "50 % canary; canary server at 2.00× a replica's load (above equal load)"),
    (25.0, 2, "25 % canary; canary server at 0.67× a replica's load"),
    (50.0, 1, "50 % canary; canary server at 1.00× a replica's load"),
])
def test_status_says_the_canary_servers_load_relative_to_a_replica(
        canary_pct: float, replicas: int, says: str) -> None:
    traffic = {"router": "local-gateway", "live": {"production_pct": 100.0 - canary_pct,
                                                   "canary_pct": canary_pct,
                                                   "mirror_pct": 0.0}}
    assert _traffic_line(traffic, replicas=replicas).endswith(says)
    assert ("above equal load" in _traffic_line(traffic, replicas=replicas)) \
        is ("above" in says)
    shown = _render_status({**STATUS, "replicas": [{"name": f"r{i}"} for i in range(replicas)],
                            "traffic": traffic})
    assert says in shown, shown


def test_status_without_a_router_says_nothing_about_traffic() -> None:
    assert "traffic" not in _render_status({**STATUS, "traffic": None})


@pytest.mark.parametrize(("traffic", "says"), [
    ({"router": "local-gateway", "action": "restore", "reason": "an orphaned split"},
     "traffic (local-gateway): an orphaned split"),
    ({"router": "local-gateway", "action": "restore", "reason": "an orphaned split",
      "error": "stuck"}, "traffic (local-gateway): an orphaned split; FAILED: stuck"),
    ({"router": "local-gateway", "action": "unknown", "reason": "did not answer"},
     "traffic (local-gateway): did not answer"),
    ({"router": "local-gateway", "action": "none", "reason": "at rest"}, None),
    ({"router": "local-gateway", "action": "leave", "reason": "owned"}, None),
])
def test_reconcile_says_what_it_did_to_the_router(traffic: dict[str, Any],
                                                  says: str | None) -> None:
    text = _render_reconcile({"ok": True, "models": [], "changed": 0, "traffic": traffic})
    if says is None:
        assert "traffic" not in text
    else:
        assert says in text.splitlines()


class _Plain:
    name = "plain"

    def live(self) -> TrafficSplit:
        return TrafficSplit(canary_pct=5.0)


class _Scoped(_Plain):
    name = "scoped"

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails

    def live_scoped(self) -> tuple[TrafficSplit, dict[str, Any]]:
        if self.fails:
            raise OSError("connection refused")
        return self.live(), scope_report(SplitScope("fraud"))


def test_status_json_carries_the_scope_from_the_same_read() -> None:
    """``status --json``'s ``traffic``: ``scope`` when the router reports it (the local
    gateway, the Gateway API), none from a router that does not; a failed read says why."""
    scoped = live_traffic(_Scoped())  # type: ignore[arg-type]
    assert scoped is not None and scoped["live"]["canary_pct"] == 5.0
    assert scoped["scope"] == {"model": "fraud", "grpc": False,
                               "applies_to": SplitScope("fraud").described}
    plain = live_traffic(_Plain())  # type: ignore[arg-type]
    assert plain is not None and "scope" not in plain and plain["live"]["canary_pct"] == 5.0
    failed = live_traffic(_Scoped(fails=True))  # type: ignore[arg-type]
    assert failed is not None and failed["live"] is None
    assert "connection refused" in failed["error"]
