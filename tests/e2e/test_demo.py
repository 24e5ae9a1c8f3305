"""`modelship demo --json`: the main job end to end on the session's stack."""

from __future__ import annotations

import json

import pytest

from modelship.settings import Settings
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def test_demo_releases_v1_then_v2_through_the_promote_flow(stack_settings: Settings) -> None:
    done = run_cli("demo", "--json", home=stack_settings.home, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)  # exactly one JSON document, nothing else on stdout
    first, second = doc["releases"]
    assert first["status"] == "released" and first["from_version"] is None
    assert second["from_version"] == first["to_version"]
    assert second["stages"][3]["name"] == "canary"
    assert second["gates"]["verdict"] in {"passed", "failed", "inconclusive"}
    # The demo's models are deterministic: v2 agrees with v1 on enough rows, always (only
    # the latency rule may still see a noisy machine).
    agreement = next(r for r in second["gates"]["results"] if r["rule"] == "agreement")
    assert agreement["verdict"] != "failed", agreement
    assert agreement["value"] is None or agreement["value"] >= 0.9, agreement
    status = json.loads(run_cli("status", "demo-fraud", "--json",
                                home=stack_settings.home).stdout)
    assert status["consistent"]
    if second["status"] == "released":
        assert status["production_version"] == second["to_version"] == \
            status["aliases"]["production"]
        # v2 went through an approval: carol asked, alice's signed click approved it
        request = second["approvals"][0]
        assert (request["requester"], request["decided_by"], request["channel"]) == (
            "U0CAROL", "U0ALICE", "slack")
        assert doc["approval_click"]["status"] == "approved"
    else:  # the gates stopped v2: production still serves v1
        assert status["production_version"] == first["to_version"]
    assert doc["look"]["slack_messages"].endswith("/_emulator/messages")
    assert doc["look"]["slack_web_view"].endswith("/") and "approvals click" in \
        doc["look"]["approve_by_hand"]
    assert "history demo-fraud" in doc["look"]["history"]
