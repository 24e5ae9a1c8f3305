"""`modelship stage | swap | status | rollback | load` through the console script, on the
session's stack."""

from __future__ import annotations

import json
from typing import Any

import pytest

from modelship.clients import build_clients
from modelship.locks import release_lock
from modelship.settings import Settings
from tests import models
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e

MODEL = "cli-fleet"


def _json(*args: str, settings: Settings, code: int = 0) -> Any:
    done = run_cli(*args, "--json", home=settings.home)
    assert done.returncode == code, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def versions(stack_settings: Settings) -> tuple[int, int]:
    uri = str(stack_settings.mlflow_tracking_uri)
    v1 = models.register_sklearn(uri, MODEL, seed=0)
    v2 = models.register_sklearn(uri, MODEL, seed=1)
    for version in (v1, v2):
        staged = _json("stage", MODEL, "--version", str(version), settings=stack_settings)
        assert staged["staged"]["manifest_key"].endswith(f"{MODEL}/{version}/release.json")
    return v1, v2


def test_swap_status_noop_lock_and_rollback(stack_settings: Settings,
                                            versions: tuple[int, int]) -> None:
    v1, v2 = versions
    first = _json("swap", MODEL, "--to", str(v1), settings=stack_settings)
    assert first["kind"] == "first_deploy" and not first["aborted"]
    status = _json("status", MODEL, settings=stack_settings)
    assert status["consistent"] and status["production_version"] == v1
    assert [r["ready_versions"] for r in status["replicas"]] == [[v1], [v1]]

    plan = _json("swap", MODEL, "--to", str(v2), "--dry-run", settings=stack_settings)
    assert plan["dry_run"] and plan["kind"] == "swap" and plan["plan"]
    assert _json("status", MODEL, settings=stack_settings)["production_version"] == v1

    swapped = _json("swap", MODEL, "--to", str(v2), settings=stack_settings)
    assert swapped["kind"] == "swap" and swapped["from_version"] == v1
    assert [p["name"] for p in swapped["phases"]] == ["pause_batching", "switch",
                                                      "resume_batching"]
    assert set(swapped["timeline"]) == {"triton-0", "triton-1"}
    assert swapped["skew_ms"] is not None
    status = _json("status", MODEL, settings=stack_settings)
    assert status["consistent"] and status["production_version"] == v2
    assert len({r["config_digest"] for r in status["replicas"]}) == 1

    again = _json("swap", MODEL, "--to", str(v2), settings=stack_settings)
    assert again["kind"] == "noop"

    with release_lock(MODEL, prefect_api_url=stack_settings.prefect_api_url,
                      home=stack_settings.home):
        locked = _json("swap", MODEL, "--to", str(v1), settings=stack_settings, code=1)
    assert locked["error"] == "ReleaseLocked" and "another release" in locked["message"]
    assert _json("status", MODEL, settings=stack_settings)["production_version"] == v2

    clients = build_clients(stack_settings)
    assert clients.registry is not None
    clients.registry.set_alias(MODEL, "production", v2)
    rolled = _json("rollback", MODEL, settings=stack_settings)
    assert rolled["from_version"] == v2 and rolled["to_version"] == v1
    assert rolled["aliases"]["production"] == v1 and rolled["aliases"]["previous"] == v2
    status = _json("status", MODEL, settings=stack_settings)
    assert status["production_version"] == v1 and status["aliases"]["production"] == v1


def test_swap_to_an_unstaged_version_says_how_to_stage_it(stack_settings: Settings,
                                                         versions: tuple[int, int]) -> None:
    error = _json("swap", MODEL, "--to", "99", settings=stack_settings, code=2)
    assert "not staged" in error["message"] and "modelship stage" in error["hint"]


def test_load_reports_the_design_schema(stack_settings: Settings,
                                        versions: tuple[int, int]) -> None:
    v1, _ = versions
    report = _json("load", MODEL, "--version", str(v1), "--concurrency", "4", "--duration", "2",
                   "--canary", settings=stack_settings, code=1)  # not loaded on the canary
    assert report["requests"] > 0 and report["errors"] == report["requests"]
    assert report["error_texts"]
    _json("swap", MODEL, "--to", str(v1), settings=stack_settings)
    report = _json("load", MODEL, "--concurrency", "4", "--duration", "2",
                   settings=stack_settings)
    assert set(report) >= {"requests", "errors", "throughput_rps", "latency_ms"}
    assert set(report["latency_ms"]) == {"p50", "p90", "p95", "p99"}
    assert report["requests"] > 0 and report["errors"] == 0
    assert report["by_version"].keys() == {str(v1)}
