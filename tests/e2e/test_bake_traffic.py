"""The bake on the real stack, with load as evidence (issue 17): a traffic surge during the
bake of an identical version does not roll it back; a version that is really slower at the
same load does. Both through ``modelship promote`` on the session's stack, with short bakes,
run in the test process (:func:`tests.inprocess.run_inprocess`); the organic clients send
through the gateway from a thread of the test process (:class:`tests.e2e.organic.Organic`,
``modelship load``'s engine), so the surge starts the moment the swap is done.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelship.settings import Settings
from tests import models
from tests.e2e import live_clients
from tests.e2e.organic import in_production, release_under_surge
from tests.integration.test_canary import slow_onnx_graph

pytestmark = pytest.mark.e2e

MODEL = "bake-traffic"
PROBE_RPS = 40.0
POLICY: dict[str, Any] = {
    # No latency gate at the canary, and agreement reported only (the slower graph has its
    # own weights): the slower version must reach the bake. The bake is the subject, so the
    # canary stops as soon as its error rule has its samples: the rule sized to catch 4%
    # errors (179 requests, so min_samples decides) rather than 2% (982), and 1-s windows
    # that count as stable at once (the default 10% held the first round to its cap).
    "canary": {"warmup_s": 0.5, "window_s": 1.0, "stability_pct": 100.0,
               "max_duration_s": 30.0, "min_samples": 200},
    "gates": [
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01,
         "effect": 0.03},
        {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.98,
         "dry_run": True},
    ],
    # 8 reference windows and 15 bake windows: on this stack a window's spread is ~3x the
    # simulation's, and a shorter bake caught a x1.6 version only at its last look.
    "bake": {"duration_s": 30.0, "window_s": 2.0, "baseline_s": 16.0, "probe_rps": PROBE_RPS,
             "max_latency_increase_pct": 25.0, "load_tolerance_pct": 50.0},
}
SURGE_BAKE: dict[str, Any] = {**POLICY["bake"], "duration_s": 12.0, "baseline_s": 8.0}
"""The surge's bake: 4 reference windows and 6 bake windows, every one of them under the
surge (it starts in-process the moment every replica serves the new version, and ends
with the release). A window is held at a rate outside ×0.5-1.5 of the reference's: the
surge brings ×4.3 (260 against 60 req/s), so the hold has a ×2.9 margin and the
``max > 3 × reference`` assertion ×1.44, as before; the judged rules (errors) only have
fewer windows to false-alarm in."""
SLOW_LAYERS = 256
"""The really slower version's MatMul chain (512 wide)."""
ORGANIC_RPS = 20.0
"""Organic traffic before the swap (open-loop, through the gateway like a client's)."""


def _promote(settings: Settings, policy: Path, version: int) -> tuple[int, Any]:
    return live_clients.promote(settings, MODEL, policy, version)


def _status(settings: Settings) -> dict[str, Any]:
    return live_clients.status(settings, MODEL)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_policy(tmp_path_factory.mktemp("bake-traffic") / "policy.yaml", POLICY)


@pytest.fixture(scope="module")
def first(stack_settings: Settings) -> int:
    """v1 in production, staged and swapped (no check, no canary: a first release has no
    bake either, and the releases under test are the later ones)."""
    return in_production(stack_settings, MODEL)


def test_a_surge_during_the_bake_of_an_identical_version_does_not_roll_it_back(
        stack_settings: Settings, tmp_path: Path, first: int) -> None:
    """Organic traffic ×10 right after the swap (20 → 200 req/s, the probe's 40 on top):
    the latency rules hold, the errors are judged, the release completes and v2 serves."""
    uri = str(stack_settings.mlflow_tracking_uri)
    same = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))
    surge_policy = models.write_policy(tmp_path / "surge.yaml", {**POLICY, "bake": SURGE_BAKE})
    code, record = release_under_surge(stack_settings, MODEL, surge_policy, same,
                                       rate=ORGANIC_RPS)
    assert code == 0, record.get("bake", record)
    bake = record["bake"]
    print(json.dumps({"outcome": bake["outcome"], "reason": bake["reason"],
                      "rates": [w["load"]["rate_rps"] for w in bake["windows"]],
                      "reference_rate": bake["baseline"]["rate_rps"]}))
    assert record["status"] == "released" and bake["outcome"] in ("held", "passed"), bake
    assert "rolled_back" not in bake
    reference_rate = bake["baseline"]["rate_rps"]
    rates = [w["load"]["rate_rps"] for w in bake["windows"]]
    assert max(rates) > 3 * reference_rate, (reference_rate, rates)
    held = bake["latency"]["held"]
    assert len(held) >= len(bake["windows"]) // 2, bake["latency"]
    assert all("outside ±50%" in why for why in held.values())
    if bake["outcome"] == "held":
        assert any("latency not judged" in note for note in record["notes"])
    assert bake["errors"]["e_value"] < 100  # errors judged in every window, none of note
    status = _status(stack_settings)
    assert status["consistent"] and status["production_version"] == same
    assert status["aliases"]["production"] == same


def test_a_really_slower_version_at_the_same_load_rolls_back(
        stack_settings: Settings, policy: Path, first: int) -> None:
    """The same outputs through a MatMul chain (several times slower on this CPU), the
    same probe load: the latency rule breaches at matched load and the bake rolls back.

    256 layers: with 64 the probe's p50 was only ×1.6-2 of production's (2.7-4.1 ms
    against 5-9.6 ms at load 13), and the 30-s bake ended without a breach; ×4 the chain
    makes the breach come at an early look, which also ends the bake early."""
    uri = str(stack_settings.mlflow_tracking_uri)
    serving = _status(stack_settings)["production_version"]
    slower = models.register_onnx(uri, MODEL, slow_onnx_graph(width=512, layers=SLOW_LAYERS))
    code, record = _promote(stack_settings, policy, slower)
    assert code == 4, record.get("bake", record)
    bake = record["bake"]
    print(json.dumps({"outcome": bake.get("outcome"), "reason": bake.get("reason")}))
    assert record["status"] == "rolled_back" and bake["outcome"] == "breach", bake
    assert "latency_p" in bake["reason"] and "matched load" in bake["reason"]
    assert not bake["latency"]["held"]  # the load did not move: every window was judged
    rule = bake["latency"]["rules"][0]
    assert rule["ratio"] > 1.25, rule
    status = _status(stack_settings)
    assert status["consistent"] and status["production_version"] == serving
