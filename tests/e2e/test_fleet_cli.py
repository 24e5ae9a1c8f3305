"""`modelship stage | swap | status | rollback | load` through the console script, on the
session's stack."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from typing import Any

import pytest

from modelship.clients import build_clients
from modelship.jsonable import jsonable
from modelship.ledger import Ledger, ReleaseRecord, StageEntry, now_iso
from modelship.locks import release_lock
from modelship.settings import Settings
from modelship.triton.model_config import (
    from_live_json,
    from_pbtxt,
    to_json,
    with_versions,
    without_dynamic_batching,
)
from tasks.status import status_report
from tests import models
from tests.conftest import run_cli, start_cli

pytestmark = pytest.mark.e2e

MODEL = "cli-fleet"


def _json(*args: str, settings: Settings, code: int = 0) -> Any:
    done = run_cli(*args, "--json", home=settings.home)
    assert done.returncode == code, done.stderr[-3000:]
    return json.loads(done.stdout)


def _status_now(settings: Settings, code: int) -> Any:
    """What ``modelship status MODEL --json`` answers, and its exit code (0 when consistent,
    else 1), read in this process through the function the CLI calls: for the checks
    between steps (a CLI start costs seconds). The CLI's own status answers, exit codes
    and table are tested below (``_status``, ``test_status_*``)."""
    clients = build_clients(settings)
    try:
        doc = jsonable(status_report(settings, clients, model=MODEL))
    finally:
        clients.close()
    assert (0 if doc["consistent"] else 1) == code, doc
    return doc


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
    refused = _json("swap", MODEL, "--to", str(v1), settings=stack_settings, code=3)
    assert refused["error"] == "EvidenceMissing" and "promote" in refused["hint"]
    first = _json("swap", MODEL, "--to", str(v1), "--force", settings=stack_settings)
    assert first["kind"] == "first_deploy" and not first["aborted"]
    assert first["evidence"]["basis"] == "forced"
    status = _json("status", MODEL, settings=stack_settings)
    assert status["consistent"] and status["production_version"] == v1
    assert [r["ready_versions"] for r in status["replicas"]] == [[v1], [v1]]

    plan = _json("swap", MODEL, "--to", str(v2), "--dry-run", "--force", settings=stack_settings)
    assert plan["dry_run"] and plan["kind"] == "swap" and plan["plan"]
    assert _status_now(stack_settings, 0)["production_version"] == v1

    swapped = _json("swap", MODEL, "--to", str(v2), "--force", settings=stack_settings)
    assert swapped["kind"] == "swap" and swapped["from_version"] == v1
    assert [p["name"] for p in swapped["phases"]] == ["pause_batching", "switch",
                                                      "resume_batching"]
    assert set(swapped["timeline"]) == {"triton-0", "triton-1"}
    assert swapped["skew_ms"] is not None
    status = _status_now(stack_settings, 0)
    assert status["consistent"] and status["production_version"] == v2
    assert len({r["config_digest"] for r in status["replicas"]}) == 1

    again = _json("swap", MODEL, "--to", str(v2), settings=stack_settings)
    assert again["kind"] == "noop"

    with release_lock(MODEL, storage=build_clients(stack_settings).storage,
                      home=stack_settings.home):
        locked = _json("swap", MODEL, "--to", str(v1), settings=stack_settings, code=1)
    assert locked["error"] == "ReleaseLocked" and "another release" in locked["message"]
    assert "modelship locks" in locked["hint"]
    assert _status_now(stack_settings, 0)["production_version"] == v2

    clients = build_clients(stack_settings)
    assert clients.registry is not None
    clients.registry.set_alias(MODEL, "production", v2)
    rolled = _json("rollback", MODEL, settings=stack_settings)
    assert rolled["from_version"] == v2 and rolled["to_version"] == v1
    assert rolled["aliases"]["production"] == v1 and rolled["aliases"]["previous"] == v2
    status = _status_now(stack_settings, 0)
    assert status["production_version"] == v1 and status["aliases"]["production"] == v1
    history = _json("history", MODEL, settings=stack_settings)["releases"]
    assert history[0]["kind"] == "rollback" and history[0]["status"] == "released"
    assert [r["status"] for r in history[1:4]] == ["noop", "released", "released"]
    forced_swap = history[2]
    assert forced_swap["kind"] == "swap" and forced_swap["to_version"] == v2
    assert forced_swap["forced"] and not history[1]["forced"]
    assert status["last_release"]["id"] == history[0]["id"]


def _mix(settings: Settings, version: int) -> str:
    """What a coordinator killed mid-swap leaves: the last replica on another version."""
    clients = build_clients(settings)
    try:
        odd = clients.replicas[-1]
        config = from_pbtxt(clients.storage.get_bytes(  # type: ignore[union-attr]
            f"{settings.repository_prefix}/{MODEL}/{version}/config.pbtxt").decode())
        odd.load_model(MODEL, config_json=to_json(with_versions(config, [version])))
        return odd.name
    finally:
        clients.close()


def test_a_mixed_fleet_is_repaired_by_reconcile_and_by_swap(
        stack_settings: Settings, versions: tuple[int, int]) -> None:
    v1, v2 = versions
    _json("swap", MODEL, "--to", str(v1), "--force", settings=stack_settings)
    odd = _mix(stack_settings, v2)
    mixed = _json("status", MODEL, settings=stack_settings, code=1)
    assert not mixed["consistent"] and mixed["production_version"] is None
    assert [r["ready_versions"] for r in mixed["replicas"]] == [[v1], [v2]]

    plan = _json("reconcile", MODEL, "--dry-run", settings=stack_settings)
    assert plan["dry_run"] and plan["changed"] == 0
    assert [r["replica"] for r in plan["models"][0]["replicas"] if r["action"] == "load"] \
        == [odd]
    assert _status_now(stack_settings, 1)["replicas"][1][
        "ready_versions"] == [v2]  # a dry run changes nothing
    repaired = _json("reconcile", MODEL, settings=stack_settings)
    assert repaired["ok"] and repaired["changed"] == 1
    loaded = [r for r in repaired["models"][0]["replicas"] if r["action"] == "load"]
    assert [r["replica"] for r in loaded] == [odd]
    status = _status_now(stack_settings, 0)
    assert status["consistent"] and status["production_version"] == v1

    # --watch: one JSON document per round until interrupted; a converged fleet is left alone.
    watching = start_cli("reconcile", MODEL, "--watch", "--interval", "1", "--json",
                         home=stack_settings.home)
    try:
        assert watching.stdout is not None
        rounds = [json.loads(watching.stdout.readline()) for _ in range(2)]
        watching.send_signal(signal.SIGINT)
        watching.communicate(timeout=60)
    finally:
        if watching.poll() is None:
            watching.kill()
    assert watching.returncode == 0
    assert [(r["ok"], r["changed"]) for r in rounds] == [(True, 0), (True, 0)]

    # The same damage, repaired by a swap: the plan says it converges the fleet.
    _mix(stack_settings, v2)
    planned = _json("swap", MODEL, "--to", str(v2), "--dry-run", "--force",
                    settings=stack_settings)
    assert any("mixed" in line for line in planned["plan"])
    converged = _json("swap", MODEL, "--to", str(v2), "--force", settings=stack_settings)
    assert converged["kind"] == "converge" and not converged["aborted"]
    status = _status_now(stack_settings, 0)
    assert status["consistent"] and status["production_version"] == v2
    assert status["aliases"]["production"] == v2


def test_swap_to_an_unstaged_version_says_how_to_stage_it(stack_settings: Settings,
                                                         versions: tuple[int, int]) -> None:
    error = _json("swap", MODEL, "--to", "99", settings=stack_settings, code=2)
    assert "not staged" in error["message"] and "modelship promote" in error["hint"]


def test_load_reports_the_design_schema(stack_settings: Settings,
                                        versions: tuple[int, int]) -> None:
    v1, _ = versions
    report = _json("load", MODEL, "--version", str(v1), "--concurrency", "4", "--duration", "2",
                   "--canary", settings=stack_settings, code=1)  # not loaded on the canary
    assert report["requests"] > 0 and report["errors"] == report["requests"]
    assert report["error_texts"]
    _json("swap", MODEL, "--to", str(v1), "--force", settings=stack_settings)
    report = _json("load", MODEL, "--concurrency", "4", "--duration", "2",
                   settings=stack_settings)
    assert set(report) >= {"requests", "errors", "throughput_rps", "latency_ms"}
    assert set(report["latency_ms"]) == {"p50", "p90", "p95", "p99"}
    assert report["requests"] > 0 and report["errors"] == 0
    assert report["by_version"].keys() == {str(v1)}


def test_canary_cli_judges_against_production_and_writes_the_report(
        stack_settings: Settings, versions: tuple[int, int], tmp_path: Any) -> None:
    from pathlib import Path

    v1, v2 = versions
    _json("swap", MODEL, "--to", str(v1), "--force", settings=stack_settings)
    policy = models.write_policy(Path(tmp_path) / "canary.yaml", {
        "canary": {"warmup_s": 1.0, "window_s": 2.0, "max_duration_s": 12.0,
                   "min_samples": 300},
        "gates": [
            {"name": "errors", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01},
            {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.999},
            {"name": "p99", "metric": "latency_p99_ms", "test": "quantile",
             "max_increase_pct": 50.0, "min_effect_ms": 2.0, "dry_run": True},
        ]})
    done = run_cli("canary", MODEL, "--version", str(v2), "--policy", str(policy), "--json",
                   home=stack_settings.home)
    report = json.loads(done.stdout)
    assert report["baseline"] == v1 and report["candidate"] == v2
    codes = {"passed": 0, "failed": 4, "inconclusive": 6}
    assert done.returncode == codes[report["verdict"]], done.stderr[-2000:]
    rules = {r["rule"]: r for r in report["gates"]["results"]}
    assert set(rules) == {"errors", "agreement", "p99"}
    assert rules["p99"]["dry_run"]
    for rule in rules.values():
        assert rule["message"] and rule["threshold"]
    assert Path(report["report"]["markdown"]).read_text().count("|") > 10
    assert Path(report["report"]["png"]).read_bytes().startswith(b"\x89PNG")
    # Another seed's model: top-1 agreement below 99.9% fails the release.
    if rules["agreement"]["value"] < 0.999:
        assert report["verdict"] == "failed" and done.returncode == 4

    same = run_cli("canary", MODEL, "--version", str(v1), "--json", home=stack_settings.home)
    assert same.returncode == 0 and json.loads(same.stdout)["verdict"] == "noop"


def test_status_of_a_model_never_deployed_is_not_an_error(stack_settings: Settings) -> None:
    """Every replica answers and none serves it: nothing to converge, exit 0, and the next
    step is a promotion (not a rollback)."""
    doc = _json("status", "cli-never-deployed", settings=stack_settings, code=0)
    assert (doc["served"], doc["production_version"]) == (False, None)
    assert doc["replicas"] and all(not r["ready_versions"] for r in doc["replicas"])
    shown = run_cli("status", "cli-never-deployed", home=stack_settings.home)
    assert shown.returncode == 0 and "modelship promote cli-never-deployed" in shown.stdout


def _status(settings: Settings, code: int, env: dict[str, str] | None = None) -> Any:
    done = run_cli("status", MODEL, "--json", home=settings.home, env=env)
    assert done.returncode == code, (done.stdout[-3000:], done.stderr[-3000:])
    return json.loads(done.stdout)


def _pause_batching_everywhere(settings: Settings) -> None:
    """What a swap stopped while batching was paused leaves: the right version, batching
    off, on every replica."""
    clients = build_clients(settings)
    try:
        for replica in clients.replicas:
            live = from_live_json(replica.model_config(MODEL))
            replica.load_model(MODEL, config_json=to_json(without_dynamic_batching(live)))
    finally:
        clients.close()


def test_status_compares_the_fleet_with_the_pin_the_alias_and_the_ledger(
        stack_settings: Settings, versions: tuple[int, int]) -> None:
    """Each disagreement is exit 1 with its repair; after the repair, exit 0."""
    v1, _ = versions
    _json("swap", MODEL, "--to", str(v1), "--force", settings=stack_settings)
    good = _status(stack_settings, 0)
    assert good["consistent"] and good["disagreements"] == [] and good["next"] is None
    assert good["pin"]["version"] == v1 and good["pin"]["dynamic_batching"]
    assert good["expected"]["version"] == v1 and good["record"]["kind"] == "swap"
    assert all(r["matches_pin"] and r["dynamic_batching"] for r in good["replicas"])

    _pause_batching_everywhere(stack_settings)
    paused = _status(stack_settings, 1)
    assert paused["production_version"] == v1  # every replica on the right version ...
    assert [d["kind"] for d in paused["disagreements"]] == ["config_drift"]  # ... unlike this
    assert "dynamic batching off" in paused["disagreements"][0]["detail"]
    assert paused["next"].startswith(f"`modelship reconcile {MODEL}`")
    shown = run_cli("status", MODEL, home=stack_settings.home)
    assert shown.returncode == 1 and f"next: `modelship reconcile {MODEL}`" in shown.stdout
    assert _json("reconcile", MODEL, settings=stack_settings)["changed"] == 2
    assert _status_now(stack_settings, 0)["consistent"]

    clients = build_clients(stack_settings)
    assert clients.registry is not None and clients.storage is not None
    try:
        clients.registry.set_alias(MODEL, "production", versions[1])
        moved = _status_now(stack_settings, 1)
        assert [d["kind"] for d in moved["disagreements"]] == ["alias"]
        assert moved["next"].startswith(f"`modelship swap {MODEL} --to {v1}`")
        assert _json("swap", MODEL, "--to", str(v1), settings=stack_settings)["repaired"]
        assert _status_now(stack_settings, 0)["aliases"]["production"] == v1

        # A release whose process is gone, still `running` in the ledger.
        gone = subprocess.Popen(["true"])
        gone.wait()
        dead = ReleaseRecord.start("promote", MODEL, from_version=v1, to_version=versions[1])
        dead.holder["pid"] = gone.pid
        dead.stages.append(StageEntry("check", now_iso()))
        Ledger(clients.storage).write(dead)
        found = _status_now(stack_settings, 1)
        assert [d["kind"] for d in found["disagreements"]] == ["dead_release"]
        assert found["record"]["id"] == dead.id and found["record"]["process"] == "dead"
        assert found["next"].startswith(f"`modelship reconcile {MODEL}`")
        _json("reconcile", MODEL, settings=stack_settings)
        assert _status_now(stack_settings, 0)["record"]["status"] == "interrupted"
    finally:
        clients.registry.set_alias(MODEL, "production", v1)
        clients.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


DEPENDENCIES = [
    ("mlflow", "MLFLOW_TRACKING_URI", "http://127.0.0.1:{port}"),
    ("s3", "MODELSHIP_S3_ENDPOINT", "http://127.0.0.1:{port}"),
    ("prefect", "PREFECT_API_URL", "http://127.0.0.1:{port}/api"),
]


@pytest.mark.parametrize(("source", "variable", "url"), DEPENDENCIES)
def test_status_answers_with_one_dependency_down_and_says_which(
        stack_settings: Settings, versions: tuple[int, int], source: str, variable: str,
        url: str) -> None:
    """A stopped server refuses connections: the replicas are still compared with what
    did answer, the note names the one that did not, and nothing else is wrong (exit 0)."""
    v1, _ = versions
    _json("swap", MODEL, "--to", str(v1), "--force", settings=stack_settings)
    doc = _status(stack_settings, 0, env={variable: url.format(port=_closed_port())})
    assert [u["source"] for u in doc["unreachable"]] == [source]
    assert doc["consistent"] and doc["production_version"] == v1
    assert [r["ready_versions"] for r in doc["replicas"]] == [[v1], [v1]]
    assert any(n.startswith({"mlflow": "MLflow", "s3": "S3", "prefect": "Prefect"}[source])
               for n in doc["notes"])


@pytest.mark.parametrize(("source", "variable", "url"), DEPENDENCIES)
def test_status_ends_within_its_deadline_when_a_dependency_hangs(
        stack_settings: Settings, versions: tuple[int, int], source: str, variable: str,
        url: str) -> None:
    """A server that accepts connections and never answers is reported unreachable once
    the read's deadline (2 x MODELSHIP_HTTP_TIMEOUT_S) has passed; the rest is compared."""
    v1, _ = versions
    _json("swap", MODEL, "--to", str(v1), "--force", settings=stack_settings)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # connections complete in the backlog; nothing ever answers
        env = {variable: url.format(port=hung.getsockname()[1]),
               "MODELSHIP_HTTP_TIMEOUT_S": "3"}
        began = time.monotonic()
        doc = _status(stack_settings, 0, env=env)
        elapsed = time.monotonic() - began
    assert [u["source"] for u in doc["unreachable"]] == [source]
    assert doc["production_version"] == v1
    # The deadline (6 s here), started once the clients are built, plus the CLI's start-up
    # and imports (10-20 s on a loaded machine); far below what retrying clients took
    # against a hung server (minutes, in issue 18).
    assert elapsed < 60, elapsed
