"""prefect.yaml deploys against the stack's real Prefect server (`modelship deploy`), and a
real process worker (`modelship worker`) runs `nightly`, a webhook-started `promote` and a
`check` (the deployment's :func:`flows.prefect_flows.check_flow`) as deployment runs.

The deploy and the worker are started once for the file (module fixtures): each deployment
run is a flow-run process the worker starts, which imports the flows once per run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
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
from tests.conftest import MODELSHIP, ROOT, RUNTIME_VENV
from tests.inprocess import run_inprocess
from tests.policies import ONE_WINDOW_BAKE, short_policy

pytestmark = pytest.mark.integration

MODEL = "nightly-worker"
#: The runs' releases: what this file proves is the deploy, the worker and the triggers, not
#: the stages' measurements: the short release (tests/policies.py) with a one-window bake.
POLICY = short_policy(bake=ONE_WINDOW_BAKE)
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
#: The worker asks the server for runs every 2 s, not Prefect's default 10 s (each run
#: waited 5 s on average, up to 13 s with its jitter, before the worker even saw it), nor
#: every second: each poll is CPU work for the Prefect server on a CPU-bound machine (the
#: server was the largest CPU user of this file), and a second's wait is not.
WORKER_POLL = {"PREFECT_WORKER_QUERY_SECONDS": "2"}
#: How often the test reads a run's state (each read is a query of the shared Prefect server).
POLL_S = 2.0


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


@pytest.fixture(scope="module")
def worker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker's folder: its Prefect home, its policies, its log."""
    return tmp_path_factory.mktemp("deployments")


@pytest.fixture(scope="module")
def worker(stack_settings: Settings, worker_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`modelship worker` on the process pool; stopped (its process group) afterwards.
    Its policies folder holds :data:`POLICY` as the model's policy (webhook-started
    releases and checks read it)."""
    policies = worker_dir / "policies"
    policies.mkdir()
    models.write_policy(policies / f"{MODEL}.yaml", POLICY)
    log = (worker_dir / "worker.log").open("wb")
    proc = subprocess.Popen([str(MODELSHIP), "worker"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**_prefect_env(stack_settings, worker_dir), **WORKER_POLL,
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


def _worker_log(worker_dir: Path) -> str:
    return (worker_dir / "worker.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def deployments(stack_settings: Settings, worker_dir: Path) -> dict[str, dict[str, Any]]:
    """`modelship deploy --json`: prefect.yaml's deployments on the stack's server, by name."""
    env = _prefect_env(stack_settings, worker_dir)
    # through the console script's own function in this process: the same arguments, exit
    # code and JSON document; `prefect work-pool create` and `prefect deploy --all` are still
    # the real Prefect CLI processes it starts
    done = run_inprocess("deploy", "--json", home=stack_settings.home, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {d["name"]: d for d in json.loads(done.stdout)["deployments"]}


@pytest.fixture(scope="module")
def nightly_release(stack_settings: Settings, worker_dir: Path,
                    worker: subprocess.Popen[bytes],
                    deployments: dict[str, dict[str, Any]]) -> int:
    """The nightly deployment run with the schedule's own parameters (``dry_run: false``),
    run by the worker: it trains, registers and releases :data:`MODEL`. The version it
    released."""
    policy = models.write_policy(worker_dir / "policy.yaml", POLICY)
    run = _run_deployment(stack_settings, deployments["nightly"]["id"], {
        "model": MODEL, "seed": 11, "drift": 0.0, "policy_file": str(policy),
        "dry_run": False})
    assert run["state_type"] == "COMPLETED", _worker_log(worker_dir)
    history, status = _history_and_status(stack_settings)
    assert [(r["kind"], r["status"], r["trigger"]) for r in history] == [
        ("promote", "released", "schedule")]
    released = int(history[0]["to_version"])
    assert status["production_version"] == released == status["aliases"]["production"]
    return released


def _registered_again(settings: Settings, version: int) -> int:
    """A new version of :data:`MODEL` with ``version``'s artifact (the same bytes)."""
    from mlflow import MlflowClient

    tracking = str(settings.mlflow_tracking_uri)
    registry = MlflowClient(tracking, registry_uri=tracking)
    source = registry.get_model_version(MODEL, str(version)).source
    return int(training.register(tracking, source, MODEL)["version"])


def test_deploy_then_a_worker_runs_nightly_and_promote(
        stack_settings: Settings, worker_dir: Path, worker: subprocess.Popen[bytes],
        deployments: dict[str, dict[str, Any]], nightly_release: int) -> None:
    assert {"promote", "check", "swap", "rollback", "nightly"} <= set(deployments)
    nightly = deployments["nightly"]
    assert nightly["schedules"] == ["30 2 * * * Europe/Berlin"]
    assert nightly["concurrency_limit"] == 1 and nightly["collision_strategy"] == "CANCEL_NEW"
    assert nightly["pool"] == "modelship-process"
    assert {d["pool"] for d in deployments.values()} == {"modelship-process"}
    assert worker.poll() is None, _worker_log(worker_dir)

    # The schedule's own parameters release; a Quick Run with the defaults only compares.
    full = _api(stack_settings, f"/deployments/{nightly['id']}", method="GET")
    assert full["parameters"]["params"]["dry_run"] is True
    assert full["schedules"][0]["parameters"]["params"]["dry_run"] is False
    # (the run with the schedule's parameters: :func:`nightly_release`, released, trigger
    # `schedule`, production moved to it)
    released = nightly_release

    # The registry trigger: alias `candidate` on a new version -> MLflow's signed webhook ->
    # the stack's receiver -> a promote deployment run, which the worker releases. The new
    # version is the nightly's artifact registered again: its check (with the same policy
    # sections) finds the nightly's passed check of the same bytes in the stack's check
    # cache (tasks/check_cache.py), so the export and trial load are not paid twice; what
    # the run proves is the trigger and the worker, not the check.
    from mlflow import MlflowClient

    tracking = str(stack_settings.mlflow_tracking_uri)
    registry = MlflowClient(tracking, registry_uri=tracking)
    candidate = _registered_again(stack_settings, released)
    registry.set_registered_model_alias(MODEL, "candidate", str(candidate))
    promote = _wait_for_webhook_run(stack_settings, MODEL, candidate)
    assert promote["state_type"] == "COMPLETED", _worker_log(worker_dir)
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


def test_check_flow_runs_on_the_prefect_server(
        stack_settings: Settings, worker_dir: Path, worker: subprocess.Popen[bytes],
        deployments: dict[str, dict[str, Any]], nightly_release: int) -> None:
    """The `check` deployment (:func:`flows.prefect_flows.check_flow`) runs as a flow run
    of the stack's Prefect server, by the worker, and passes: a check that does not pass
    raises, so the run would end FAILED. ``dry_run`` stages nothing.

    The version checked is the nightly's artifact registered again: its check finds the
    nightly's passed check of the same bytes (same policy sections) in the stack's check
    cache, as the webhook's release does; a fresh check inside a flow run is the nightly's
    (its promote's check task, in the worker's flow run)."""
    version = _registered_again(stack_settings, nightly_release)
    run = _run_deployment(stack_settings, deployments["check"]["id"], {
        "model": MODEL, "version": version, "alias": None, "dry_run": True})
    assert run["state_type"] == "COMPLETED", _worker_log(worker_dir)
    assert run["deployment_id"] == deployments["check"]["id"]
    flow = _api(stack_settings, f"/flows/{run['flow_id']}", method="GET")
    assert flow["name"] == "modelship-check"
    assert run["parameters"]["params"]["version"] == version
    clients = build_clients(stack_settings)
    try:
        assert clients.storage is not None
        staged = {v: list(clients.storage.list_keys(
            f"{stack_settings.repository_prefix}/{MODEL}/{v}/"))
            for v in (nightly_release, version)}
    finally:
        clients.close()
    # dry_run: nothing staged (where the released version's staged files are)
    assert staged[nightly_release] and staged[version] == [], staged
    runs = _api(stack_settings, "/flow_runs/filter",
                {"flows": {"name": {"any_": ["modelship-check"]}}})
    assert any(r["id"] == run["id"] and r["state_type"] == "COMPLETED" for r in runs), runs
