"""The webhook receiver's MLflow client fails fast while MLflow boots (its own loop retries)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from modelship.stack.components import webhooks_env
from modelship.webhooks.server import ensure_mlflow_webhook
from tests.silent import closed_port


def test_registering_against_an_mlflow_not_up_yet_fails_in_seconds(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With the receiver's environment, one refused call is one attempt: it ends in well
    under 5 s, where MLflow's own retries (7 by default, backoff factor 2) take minutes.
    The first call pays the imports of MLflow's client (seconds of CPU on a loaded
    machine); the second, timed, pays only the refused connection."""
    env = webhooks_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7"}, home=tmp_path)
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(key, env[key])
    for timed in (False, True):
        began = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017, PT011 - MLflow's own connection error
            ensure_mlflow_webhook(f"http://127.0.0.1:{closed_port()}", "http://127.0.0.1:1/x",
                                  "s")
        if timed:
            assert time.monotonic() - began < 5
