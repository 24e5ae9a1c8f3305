"""`modelship demo --json`: the main job end to end on the session's stack."""

from __future__ import annotations

import json

import pytest

from modelship.settings import Settings
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def test_demo_releases_v1_then_takes_v2_through_canary_and_swap(
        stack_settings: Settings) -> None:
    done = run_cli("demo", "--json", home=stack_settings.home, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)  # exactly one JSON document, nothing else on stdout
    steps = [s["step"] for s in doc["steps"]]
    v1 = doc.get("previous") or doc["released"]
    assert steps[:2] == [f"check+stage v{v1}", f"release v{v1}"]
    assert all(s.get("verdict", "passed") in {"passed", "failed", "inconclusive"}
               for s in doc["steps"])
    canary = doc["canary"]
    assert {r["rule"] for r in canary["gates"]["results"]} == {"latency_p99", "error_rate",
                                                              "agreement"}
    status = json.loads(run_cli("status", "demo-fraud", "--json",
                                home=stack_settings.home).stdout)
    assert status["consistent"]
    if canary["verdict"] == "passed":
        assert steps[-1].startswith("swap")
        assert status["production_version"] == doc["released"] == status["aliases"]["production"]
    else:  # the gates stopped v2: production still serves v1
        assert status["production_version"] == v1
