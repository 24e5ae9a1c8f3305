"""Two models' canaries started at the same moment share the one canary Triton: the canary
slot makes them run one after the other, so neither's evidence measures the other's load."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flows.check import run_check
from modelship.clients import Clients
from modelship.policy import Policy
from modelship.settings import Settings
from tasks.canary import CanaryResult, run_canary
from tests import models

pytestmark = pytest.mark.integration

MODELS = ("slot_a", "slot_b")
#: The cheapest canary (the slot is the subject, not the verdict): a deterministic error
#: gate, done once each arm has 50 answers (one 1-s window), not an exact-rate test that
#: measures up to its 6-s cap at full load.
SHORT = Policy.model_validate({
    "canary": {"warmup_s": 0.5, "window_s": 1.0, "max_duration_s": 6.0, "min_samples": 50},
    "gates": [{"name": "errors", "metric": "error_rate", "test": "threshold", "max": 0.01}],
})


@pytest.fixture(scope="module")
def staged(stack_settings: Settings, clients: Clients,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """One version of each model, checked and staged as `modelship stage` does (the same
    artifact for each: the slot is the subject, and its check is the cache's pass after the
    first, ``register_sklearn(reuse=True)``)."""
    versions = {}
    for name in MODELS:
        version = models.register_sklearn(str(stack_settings.mlflow_tracking_uri), name,
                                          reuse=True)
        report = run_check(stack_settings, clients, Policy(), model=name, version=version,
                           workdir=tmp_path_factory.mktemp(name), stage=True)
        assert report.verdict == "passed", report
        versions[name] = version
    return versions


def _span(lines: list[tuple[float, str]], model: str) -> tuple[float, float]:
    took = next(t for t, line in lines if line.startswith(f"took the canary slot for "
                                                         f"canary of {model} "))
    freed = next(t for t, line in lines if line.startswith(f"freed the canary slot of "
                                                          f"canary of {model} "))
    return took, freed


def test_two_canaries_at_once_take_turns_on_the_canary_triton(
        stack_settings: Settings, clients: Clients, staged: dict[str, int],
        tmp_path: Path) -> None:
    lines: list[tuple[float, str]] = []
    results: dict[str, CanaryResult] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(MODELS))

    def canary(model: str) -> None:
        def progress(line: str) -> None:
            lines.append((time.time(), line))

        start.wait()
        try:
            results[model] = run_canary(stack_settings, clients, SHORT, model=model,
                                        candidate=staged[model], baseline=None,
                                        progress=progress, report_dir=tmp_path / model)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=canary, args=(m,)) for m in MODELS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    spans = sorted(_span(lines, m) for m in MODELS)
    (_, first_freed), (second_took, _) = spans
    assert first_freed <= second_took, spans  # one after the other, never both at once
    waited = [line for _, line in lines if line.startswith("waiting for the canary Triton")]
    assert waited and "holds it" in waited[0]
    for model, result in results.items():
        assert result.cleanup == "unloaded", (model, result.cleanup)
        took, freed = _span(lines, model)
        # the whole canary (load, measure, unload) ran inside its slot
        assert result.seconds <= freed - took + 0.5, (model, result.seconds, took, freed)
    report: dict[str, Any] = {m: r.verdict for m, r in results.items()}
    assert set(report) == set(MODELS)
