"""The webhook receiver's MLflow client fails fast while MLflow boots (its own loop retries)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from modelship.stack.components import webhooks_env
from modelship.webhooks.server import ensure_mlflow_webhook


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_registering_against_an_mlflow_not_up_yet_fails_in_seconds(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = webhooks_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7"}, home=tmp_path)
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(key, env[key])
    began = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017, PT011 - MLflow's own connection error
        ensure_mlflow_webhook(f"http://127.0.0.1:{_closed_port()}", "http://127.0.0.1:1/x", "s")
    assert time.monotonic() - began < 15

