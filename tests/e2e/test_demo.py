"""`modelship demo --json`: the main job end to end on the session's stack; the Prefect UI
pages it links to, in a real headless Chromium; then `stack down && stack up`, twice, with
everything the demo left still there, and the demo run a second time in between.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from modelship.clients import build_clients
from modelship.jsonable import jsonable
from modelship.settings import Settings
from modelship.stack import manager
from tests.conftest import run_cli, stack_settings_at
from tests.e2e.test_approvals_browser import browser  # noqa: F401 - the Chromium fixture

pytestmark = pytest.mark.e2e

MODEL = "demo-fraud"


def _demo(home: Path) -> dict[str, Any]:
    done = run_cli("demo", "--json", home=home, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout))  # exactly one JSON document, nothing else on stdout


@pytest.fixture(scope="module")
def first_demo(stack_settings: Settings) -> dict[str, Any]:
    return _demo(stack_settings.home)


def test_demo_releases_v1_then_v2_through_the_promote_flow(stack_settings: Settings,
                                                           first_demo: dict[str, Any]) -> None:
    doc = first_demo
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
    status = json.loads(run_cli("status", MODEL, "--json", home=stack_settings.home).stdout)
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


def _task_run_names(settings: Settings, flow_run_id: str) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}), \
            get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[UUID(flow_run_id)])))
    return {run.name for run in runs}


def test_the_demo_links_open_flow_run_pages_that_show_their_task_runs(
        stack_settings: Settings, first_demo: dict[str, Any],
        browser: webdriver.Chrome) -> None:  # noqa: F811 - the imported fixture
    look = first_demo["look"]
    links = look["flow_runs"]
    assert set(links) == {r["id"] for r in first_demo["releases"]}
    browser.get(look["prefect_ui"])  # the runs list: the UI is on, not a 404
    _wait_for_text(browser, "Runs")
    for record in first_demo["releases"]:
        link = links[record["id"]]
        flow_run_id = record["holder"]["flow_run_id"]
        assert link.endswith(f"/runs/flow-run/{flow_run_id}")
        names = _task_run_names(stack_settings, flow_run_id)  # "check demo-fraud v2", ...
        stages = {name.split(" ", 1)[0] for name in names}
        assert {"check", "stage"} <= stages, names
        assert "canary" in stages or record["from_version"] is None, names
        browser.get(link)
        _wait_for_text(browser, "Task Runs")
        tab = next(e for e in browser.find_elements(By.XPATH, "//*[normalize-space()="
                                                     "'Task Runs']") if e.is_displayed())
        tab.click()
        shown = sorted(n for n in names if n.split(" ", 1)[0] in {"check", "stage", "canary"})
        text = _wait_for_text(browser, *shown)  # the task runs, listed by name
        assert "404" not in text.split("\n")[:3]


def _wait_for_text(driver: webdriver.Chrome, *texts: str, timeout_s: float = 60) -> str:
    """The page's text once it shows every one of ``texts`` (the UI renders from API
    calls after the page loads)."""
    deadline = time.monotonic() + timeout_s
    body = ""
    while time.monotonic() < deadline:
        body = driver.find_element(By.TAG_NAME, "body").text
        if all(t in body for t in texts):
            return body
        time.sleep(0.5)
    missing = [t for t in texts if t not in body]
    raise AssertionError(f"{driver.current_url} never showed {missing}; it shows:\n"
                         f"{body[:2000]}")


def _snapshot(settings: Settings) -> dict[str, Any]:
    """What a restart must keep: the endpoints, what serves, the ledger, the registered and
    the staged versions. Read in this process through the functions ``stack status``,
    ``status`` and ``history`` call (each CLI start costs seconds), with the settings a
    command would load from the stack's stack.json now."""
    import mlflow

    from tasks.fleet import history
    from tasks.status import status_report

    settings = stack_settings_at(settings.home)
    stack = manager.status(settings)
    clients = build_clients(settings)
    try:
        assert clients.storage is not None
        status = jsonable(status_report(settings, clients, model=MODEL))
        ledger = jsonable(history(clients, model=MODEL))
        prefix = f"{settings.repository_prefix}/{MODEL}/"
        staged = sorted({key[len(prefix):].split("/")[0]
                         for key in clients.storage.list_keys(prefix)})
    finally:
        clients.close()
    uri = str(settings.mlflow_tracking_uri)
    registered = sorted(int(v.version) for v in mlflow.MlflowClient(
        uri, registry_uri=uri).search_model_versions(f"name='{MODEL}'"))
    return {"endpoints": {k: stack[k] for k in ("mlflow_uri", "s3_endpoint", "prefect_api_url",
                                                 "slack_api_url", "approvals_url", "triton")},
            "production": status.get("production_version"),
            "aliases": status.get("aliases"), "consistent": status.get("consistent"),
            "serving": [sorted(r.get("ready_versions", [])) for r in status["replicas"]],
            "ledger": [(r["id"], r["status"]) for r in ledger],
            "registered": registered, "staged": staged}


def _restart(settings: Settings) -> float:
    home = settings.home
    down = run_cli("stack", "down", home=home, timeout=120)
    assert down.returncode == 0, down.stderr[-2000:]
    started = time.monotonic()
    up = run_cli("stack", "up", "--replicas", "2", home=home, timeout=400)
    assert up.returncode == 0, up.stderr[-3000:]
    return time.monotonic() - started


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
        return int(response.status)


def test_the_stack_restarts_with_its_data_and_the_demo_runs_again(
        stack_settings: Settings, first_demo: dict[str, Any]) -> None:
    before = _snapshot(stack_settings)
    assert before["production"] is not None and before["registered"] and before["staged"]
    ups = [_restart(stack_settings)]
    after = _snapshot(stack_settings)
    assert after == before  # same ports, same data, the same version serving everywhere
    # The webhook receiver registered its webhook again (MLflow can read its secret) ...
    state = json.loads((stack_settings.home / "stack.json").read_text())
    assert _get(str(state["webhooks_url"]).removesuffix("/mlflow/webhook") + "/health") == 200
    assert _get(f"{state['mlflow_uri']}/api/2.0/mlflow/webhooks?max_results=10") == 200
    # ... and the demo runs a second time on the restarted stack.
    again = _demo(stack_settings.home)
    assert again["releases"][0]["status"] == "released"
    assert again["releases"][0]["from_version"] == before["production"]
    grown = _snapshot(stack_settings)
    assert len(grown["ledger"]) >= len(before["ledger"]) + 2
    ups.append(_restart(stack_settings))
    assert _snapshot(stack_settings) == grown
    print(f"stack up after down: {', '.join(f'{s:.0f} s' for s in ups)}")
