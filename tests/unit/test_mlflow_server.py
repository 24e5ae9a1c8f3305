"""``modelship.stack.mlflow_server``: MLflow's own ``server`` command, with the uvicorn
command it builds run in the same process instead of a second Python process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from modelship.stack import components
from modelship.stack import mlflow_server as inline


@pytest.mark.parametrize(("cmd", "args"), [
    (["/venv/python", "-m", "uvicorn", "--host", "127.0.0.1", "app:app"],
     ["--host", "127.0.0.1", "app:app"]),
    (["/venv/python", "-m", "uvicorn"], []),
])
def test_uvicorn_args_are_what_follows_python_m_uvicorn(cmd: list[str], args: list[str]) -> None:
    assert inline.uvicorn_args(cmd) == args


@pytest.mark.parametrize("cmd", [
    ["/venv/python", "-m", "gunicorn", "app:app"],
    ["waitress-serve", "app:app"],
    ["/venv/python"],
])
def test_any_other_server_command_is_refused_by_name(cmd: list[str]) -> None:
    with pytest.raises(RuntimeError, match="not uvicorn"):
        inline.uvicorn_args(cmd)


def test_the_stack_runs_mlflow_through_it() -> None:
    argv = components.mlflow_command(Path("/venv/bin"), db_path=Path("/d/m.db"), port=5000,
                                     bucket="b")
    assert argv[:4] == ["/venv/bin/python", "-m", "modelship.stack.mlflow_server", "server"]
    assert argv[argv.index("--workers") + 1] == "1"


def test_mlflow_server_hands_its_uvicorn_command_and_environment_to_this_process(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """MLflow's real ``server`` command (its stores' preparation stubbed): the web server it
    starts is uvicorn, in this process, with the app, the port and the environment MLflow
    meant for it."""
    import mlflow.server
    import mlflow.server.handlers
    import uvicorn.main

    ran: dict[str, Any] = {}

    def serve(*, args: list[str], **_kwargs: Any) -> None:
        ran["args"], ran["pid"] = args, os.getpid()
        ran["store"] = os.environ.get("_MLFLOW_SERVER_FILE_STORE")
        ran["serve_artifacts"] = os.environ.get("_MLFLOW_SERVER_SERVE_ARTIFACTS")

    monkeypatch.setattr(uvicorn.main, "main", serve)
    monkeypatch.setattr(mlflow.server.handlers, "initialize_backend_stores",
                        lambda *a, **k: None)
    monkeypatch.setattr(mlflow.server.handlers, "initialize_workspace_store",
                        lambda *a, **k: None, raising=False)
    monkeypatch.setattr(mlflow.server, "_exec_cmd", mlflow.server._exec_cmd)  # restored after
    for key in list(os.environ):
        if key.startswith(("_MLFLOW_", "MLFLOW_SERVER_")):
            monkeypatch.delenv(key)
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = components.mlflow_command(Path("/venv/bin"), db_path=tmp_path / "mlflow.db",
                                     port=5123, bucket="b")
    with pytest.raises(SystemExit) as ended:
        inline.main(argv[3:])
    assert ended.value.code in (0, None)
    assert ran["pid"] == os.getpid()
    args = ran["args"]
    assert args[-1] == "mlflow.server.fastapi_app:app"
    assert args[args.index("--port") + 1] == "5123" and args[args.index("--workers") + 1] == "1"
    assert ran["store"] == db and ran["serve_artifacts"] == "true"
