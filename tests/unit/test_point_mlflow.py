"""MLflow's process-wide URIs move together (the fault matrix registered its model on the
session stack's MLflow: an earlier in-process client had set the registry URI there, and
``mlflow.set_tracking_uri`` alone left it)."""

from __future__ import annotations

import os

import mlflow
import pytest
from mlflow.tracking import fluent

from model_registry.client import point_mlflow_at


def test_pointing_mlflow_moves_the_registry_uri_too() -> None:
    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    try:
        mlflow.set_registry_uri("http://127.0.0.1:1")  # another server, set earlier
        point_mlflow_at("http://127.0.0.1:2")
        assert mlflow.get_tracking_uri() == "http://127.0.0.1:2"
        assert mlflow.get_registry_uri() == "http://127.0.0.1:2"
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])


def test_pointing_mlflow_at_another_server_forgets_the_active_experiment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CI: test_stack_servers' ``set_experiment`` left experiment 1 active in the worker, and
    the next module's first run on its own fresh server asked for id 1 there."""
    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    try:
        point_mlflow_at("http://127.0.0.1:1")
        monkeypatch.setattr(fluent, "_active_experiment_id", "1")  # as set_experiment does
        monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "1")
        point_mlflow_at("http://127.0.0.1:1")  # the same server: it still holds
        assert fluent._active_experiment_id == "1"
        point_mlflow_at("http://127.0.0.1:2")
        assert fluent._active_experiment_id is None
        assert "MLFLOW_EXPERIMENT_ID" not in os.environ
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])
