"""prefect.yaml deploys against the stack's real Prefect server (`modelship deploy`), and a
real process worker (`modelship worker`) runs `nightly` and a webhook-started `promote` as
deployment runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelship.clients import build_clients
from modelship.settings import Settings
from tasks import train as training
from tests import models
from tests.conftest import MODELSHIP, ROOT, RUNTIME_VENV, run_cli

pytestmark = pytest.mark.integration

MODEL = "nightly-worker"
#: The runs' releases: every stage, in short windows. The canary's 1-s windows count as
#: stable at once (at the default 10 % a busy machine held the stability round to its
#: 12-s cap: the round is tested in test_canary, not here).
POLICY: dict[str, Any] = {
    "canary": {"warmup_s": 1.0, "window_s": 1.0, "max_duration_s": 12.0, "min_samples": 300,
               "stability_pct": 100.0},
    "gates": [
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01},
    ],
    "bake": {"duration_s": 2.0, "window_s": 1.0, "baseline_s": 1.0,
             "max_latency_increase_pct": 400.0},
}
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
#: The worker asks the server for runs every second, not Prefect's default 10 s (each run
#: waited 5 s on average, up to 13 s with its jitter, before the worker even saw it).
WORKER_POLL = {"PREFECT_WORKER_QUERY_SECONDS": "1"}
#: How often the test reads a run's state (each read is a query of the shared Prefect server).
POLL_S = 1.0


def _prefect_env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("PREFECT_", "MODELSHIP_", "MLFLOW_", "AWS_"))}
    return {**keep, "PREFECT_API_URL": str(settings.prefect_api_url),
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "MODELSHIP_HOME": str(settings.home), "MODELSHIP_REPO_DIR": str(ROOT),
            "MODELSHIP_TRITON_RUNTIME": str(RUNTIME_VENV),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true"}


def _api(settings: Settings, path: str, body: dict[str, Any] | None = None,
         method: str = "POST") -> Any:
    data = json.dumps(body or {}).encode() if method == "POST" else None
    request = urllib.request.Request(f"{settings.prefect_api_url}{path}", data=data,
                                     method=method, headers={"Content-Type": "application/json"})
    for attempt in range(5):  # a busy SQLite-backed server may answer 503 for a moment
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or attempt == 4:
                raise AssertionError(f"{method} {path}: {exc.code} {exc.read()[:2000]!r}") \
                    from exc
            time.sleep(2)


@pytest.fixture()
def worker(stack_settings: Settings, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`modelship worker` on the process pool; stopped (its process group) afterwards."""
    policies = tmp_path / "policies"
    policies.mkdir()
    models.write_policy(policies / f"{MODEL}.yaml", POLICY)  # for webhook-started releases
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen([str(MODELSHIP), "worker"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**_prefect_env(stack_settings, tmp_path), **WORKER_POLL,
                                 "MODELSHIP_POLICIES_DIR": str(policies)})
    try:
        yield proc
    finally:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


def _run_deployment(settings: Settings, deployment_id: str, params: dict[str, Any],
                    deadline_s: float = 480) -> dict[str, Any]:
    run = _api(settings, f"/deployments/{deployment_id}/create_flow_run",
               {"parameters": {"params": params}})
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        state = _api(settings, f"/flow_runs/{run['id']}", method="GET")
        if state["state_type"] in TERMINAL:
            return dict(state)
        time.sleep(POLL_S)
    raise AssertionError(f"flow run {run['id']} did not finish in {deadline_s} s: {state}")


def test_deploy_then_a_worker_runs_nightly_and_promote(
        stack_settings: Settings, tmp_path: Path, worker: subprocess.Popen[bytes]) -> None:
    env = _prefect_env(stack_settings, tmp_path)
    done = run_cli("deploy", "--json", home=stack_settings.home, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    deployments = {d["name"]: d for d in json.loads(done.stdout)["deployments"]}
    assert {"promote", "check", "swap", "rollback", "nightly"} <= set(deployments)
    nightly = deployments["nightly"]
    assert nightly["schedules"] == ["30 2 * * * Europe/Berlin"]
    assert nightly["concurrency_limit"] == 1 and nightly["collision_strategy"] == "CANCEL_NEW"
    assert nightly["pool"] == "modelship-process"
    assert {d["pool"] for d in deployments.values()} == {"modelship-process"}
    assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]

    # The schedule's own parameters release; a Quick Run with the defaults only compares.
    full = _api(stack_settings, f"/deployments/{nightly['id']}", method="GET")
    assert full["parameters"]["params"]["dry_run"] is True
    assert full["schedules"][0]["parameters"]["params"]["dry_run"] is False

    policy = models.write_policy(tmp_path / "policy.yaml", POLICY)
    run = _run_deployment(stack_settings, nightly["id"], {
        "model": MODEL, "seed": 11, "drift": 0.0, "policy_file": str(policy),
        "dry_run": False})
    assert run["state_type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
    history, status = _history_and_status(stack_settings)
    assert [(r["kind"], r["status"], r["trigger"]) for r in history] == [
        ("promote", "released", "schedule")]
    released = history[0]["to_version"]
    assert status["production_version"] == released == status["aliases"]["production"]

    # The registry trigger: alias `candidate` on a new version -> MLflow's signed webhook ->
    # the stack's receiver -> a promote deployment run, which the worker releases. The new
    # version is the nightly's artifact registered again: its check (with the same policy
    # sections) finds the nightly's passed check of the same bytes in the stack's check
    # cache (tasks/check_cache.py), so the export and trial load are not paid twice; what
    # the run proves is the trigger and the worker, not the check.
    from mlflow import MlflowClient

    tracking = str(stack_settings.mlflow_tracking_uri)
    registry = MlflowClient(tracking, registry_uri=tracking)
    source = registry.get_model_version(MODEL, str(released)).source
    candidate = training.register(tracking, source, MODEL)["version"]
    registry.set_registered_model_alias(MODEL, "candidate", str(candidate))
    promote = _wait_for_webhook_run(stack_settings, MODEL, candidate)
    assert promote["state_type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
    assert promote["deployment_id"] == deployments["promote"]["id"]
    history, status = _history_and_status(stack_settings)
    assert [(r["kind"], r["status"], r["trigger"], r["to_version"]) for r in history][0] == (
        "promote", "released", "webhook", candidate)
    assert status["production_version"] == candidate == status["aliases"]["production"]


def _history_and_status(settings: Settings) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What ``modelship history MODEL`` and ``modelship status MODEL`` answer, read in this
    process through the functions they call (each CLI start costs seconds)."""
    from tasks.fleet import history
    from tasks.status import status_report

    clients = build_clients(settings)
    try:
        return history(clients, model=MODEL), status_report(settings, clients, model=MODEL)
    finally:
        clients.close()


def _wait_for_webhook_run(settings: Settings, model: str, version: int,
                          deadline_s: float = 480) -> dict[str, Any]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        runs = [r for r in _api(settings, "/flow_runs/filter",
                                {"flow_runs": {"tags": {"all_": ["webhook"]}}})
                if r["parameters"].get("params", {}).get("model") == model
                and r["parameters"]["params"].get("version") == version]
        assert len(runs) <= 1, runs
        if runs and runs[0]["state_type"] in TERMINAL:
            return dict(runs[0])
        time.sleep(POLL_S)
    raise AssertionError(f"no finished webhook-started run of {model} v{version}")


def test_check_flow_runs_on_the_prefect_server(stack_settings: Settings,
                                               tmp_path: Path) -> None:
    version = models.register_sklearn(str(stack_settings.mlflow_tracking_uri), "prefect-check")
    code = textwrap.dedent(f"""
        from flows.prefect_flows import CheckParams, check_flow
        report = check_flow(CheckParams(model="prefect-check", version={version},
                                        dry_run=True))
        assert report["verdict"] == "passed", report
        assert report["staged"] is None
    """)
    done = subprocess.run([sys.executable, "-c", code], env=_prefect_env(stack_settings, tmp_path),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = _api(stack_settings, "/flow_runs/filter",
                {"flows": {"name": {"any_": ["modelship-check"]}}})
    assert any(run["state_type"] == "COMPLETED" for run in runs), runs
