"""MLflow's process-wide URIs move together (the fault matrix registered its model on the
session stack's MLflow: an earlier in-process client had set the registry URI there, and
``mlflow.set_tracking_uri`` alone left it)."""

from __future__ import annotations

import mlflow

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
