"""What `modelship status` and `modelship reconcile` say about the traffic router."""

from __future__ import annotations

from typing import Any

import pytest

from modelship.cli.fleet import _render_reconcile, _render_status, _traffic_line

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
])
def test_status_shows_the_live_weights(traffic: dict[str, Any], line: str) -> None:
    assert _traffic_line(traffic) == line
    assert line in _render_status({**STATUS, "traffic": traffic}).splitlines()


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
