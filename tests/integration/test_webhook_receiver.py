"""The stack's MLflow webhook receiver against the real MLflow and Prefect servers: a real
alias delivery starts exactly one promote run; forged, stale, replayed and malformed
deliveries start none."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest
from mlflow.webhooks.delivery import _generate_hmac_signature

from modelship.settings import Settings
from tasks import train as training
from tests.conftest import run_cli

pytestmark = pytest.mark.integration


def _prefect(settings: Settings, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"{settings.prefect_api_url}{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read()) if response.status != 204 else None


def _webhook_runs(settings: Settings) -> list[dict[str, Any]]:
    return list(_prefect(settings, "/flow_runs/filter",
                         {"flow_runs": {"tags": {"all_": ["webhook"]}}}))


def _cancel(settings: Settings, runs: list[dict[str, Any]]) -> None:
    """No worker runs these here; cancel them so no later worker picks them up."""
    for run in runs:
        _prefect(settings, f"/flow_runs/{run['id']}/set_state",
                 {"state": {"type": "CANCELLED", "message": "test"}, "force": True})


def _post(url: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _signed(secret: str, payload: dict[str, Any], *, sent: float | None = None,
            delivery_id: str | None = None) -> tuple[dict[str, str], bytes]:
    body = json.dumps(payload)
    delivery_id = delivery_id or str(uuid.uuid4())
    stamp = str(int(time.time() if sent is None else sent))
    return ({"Content-Type": "application/json", "X-MLflow-Delivery-Id": delivery_id,
             "X-MLflow-Timestamp": stamp,
             "X-MLflow-Signature": _generate_hmac_signature(secret, delivery_id, stamp, body)},
            body.encode())


@pytest.fixture(scope="module")
def deployed(stack_settings: Settings) -> None:
    done = run_cli("deploy", "--json", home=stack_settings.home, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_forged_stale_replayed_and_malformed_deliveries_start_nothing(
        stack_settings: Settings, deployed: None) -> None:
    url = str(stack_settings.webhooks_url)
    assert stack_settings.mlflow_webhook_secret is not None
    secret = stack_settings.mlflow_webhook_secret.get_secret_value()
    payload = {"entity": "model_version_alias", "action": "created",
               "data": {"name": "webhook-refused", "alias": "candidate", "version": "1"}}
    before = len(_webhook_runs(stack_settings))

    forged = _post(url, *_signed("not-the-secret", payload))
    unsigned_headers, body = _signed(secret, payload)
    del unsigned_headers["X-MLflow-Signature"]
    unsigned = _post(url, unsigned_headers, body)
    stale = _post(url, *_signed(secret, payload, sent=time.time() - 3600))
    tampered_headers, tampered_body = _signed(secret, payload)
    tampered = _post(url, tampered_headers, tampered_body.replace(b'"1"', b'"2"'))
    bad_version = _post(url, *_signed(secret, {**payload, "data": {
        **payload["data"], "version": "latest"}}))
    not_json_headers = _signed(secret, payload)[0]
    delivery, stamp = not_json_headers["X-MLflow-Delivery-Id"], \
        not_json_headers["X-MLflow-Timestamp"]
    not_json_headers["X-MLflow-Signature"] = _generate_hmac_signature(
        secret, delivery, stamp, "{nope")
    not_json = _post(url, not_json_headers, b"{nope")
    other_alias = _post(url, *_signed(secret, {**payload, "data": {
        **payload["data"], "alias": "champion"}}))
    assert [forged[0], unsigned[0], stale[0], tampered[0], bad_version[0], not_json[0],
            other_alias[0]] == [401, 401, 401, 401, 400, 400, 202], \
        [forged, unsigned, stale, tampered, bad_version, not_json, other_alias]
    assert "stale" in stale[1]["error"] and "signature" in forged[1]["error"]
    assert len(_webhook_runs(stack_settings)) == before  # 0 runs started

    headers, body = _signed(secret, payload)
    first = _post(url, headers, body)
    replay = _post(url, headers, body)
    assert first[0] == 201 and replay[0] == 409, (first, replay)
    runs = _webhook_runs(stack_settings)
    try:
        assert len(runs) == before + 1  # the replay started nothing
        started = [r for r in runs if r["id"] == first[1]["started"]["flow_run_id"]]
        assert started[0]["parameters"]["params"] == {
            "model": "webhook-refused", "version": 1, "trigger": "webhook",
            "requested_by": "mlflow-webhook", "dry_run": False}
    finally:
        _cancel(stack_settings, runs[before:])


def test_a_real_mlflow_alias_delivery_starts_one_promote_run(
        stack_settings: Settings, deployed: None) -> None:
    from mlflow import MlflowClient

    model = "webhook-mlflow"
    tracking = str(stack_settings.mlflow_tracking_uri)
    uri = training.train_builtin(training.TrainRequest(tracking, model, seed=21, rows=300))
    version = training.register(tracking, uri, model)["version"]
    before = {r["id"] for r in _webhook_runs(stack_settings)}
    client = MlflowClient(tracking, registry_uri=tracking)
    client.set_registered_model_alias(model, "champion", str(version))  # starts nothing
    client.set_registered_model_alias(model, "candidate", str(version))
    deadline = time.monotonic() + 30
    new: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        new = [r for r in _webhook_runs(stack_settings) if r["id"] not in before]
        if new:
            break
        time.sleep(0.5)
    time.sleep(2)  # a second (wrong) run would show up by now
    new = [r for r in _webhook_runs(stack_settings) if r["id"] not in before]
    try:
        assert len(new) == 1, new
        params = new[0]["parameters"]["params"]
        assert (params["model"], params["version"], params["trigger"]) == (
            model, version, "webhook")
        flow = _prefect(stack_settings, "/flows/filter", {"flows": {"id": {
            "any_": [new[0]["flow_id"]]}}})
        assert flow[0]["name"] == "modelship-promote"
    finally:
        _cancel(stack_settings, new)
