"""Shared test configuration: telemetry off, the repository root, the CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from modelship.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_VENV = ROOT / ".venv-triton"
MODELSHIP = Path(sys.executable).parent / "modelship"

for key, value in {
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "GX_ANALYTICS_ENABLED": "false",
}.items():
    os.environ.setdefault(key, value)

#: The suite runs two stacks at once (pytest-xdist, one per worker) on a 2-core machine:
#: components get longer to become ready than a user's `stack up` does.
STACK_READY_TIMEOUT_S = os.environ.setdefault("MODELSHIP_STACK_READY_TIMEOUT_S", "300")


#: Variables MLflow writes into os.environ when a process points it at a server
#: (``set_tracking_uri``/``set_registry_uri``, for subprocesses to inherit): after any
#: in-process MLflow call in a test worker they name the stack that call used.
MLFLOW_POINTERS = ("MLFLOW_TRACKING", "MLFLOW_REGISTRY")


@contextmanager
def mlflow_pointers_hidden() -> Iterator[None]:
    hidden = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(MLFLOW_POINTERS)}
    try:
        yield
    finally:
        os.environ.update(hidden)


def base_settings(home: Path) -> Settings:
    """Settings to bring a stack up in ``home`` with, whatever an earlier test pointed MLflow
    at in this process."""
    with mlflow_pointers_hidden():
        return Settings(home=home, triton_runtime=RUNTIME_VENV)


def stack_settings_at(home: Path) -> Settings:
    """The settings of the stack in ``home`` as a command there sees them (its stack.json),
    never those of another stack that this process pointed MLflow at before."""
    with mlflow_pointers_hidden():
        return load_settings(home=home, triton_runtime=RUNTIME_VENV)


def run_cli(
    *args: str, home: Path, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run the real ``modelship`` console script against the stack in ``home``."""
    return subprocess.run([str(MODELSHIP), *args], capture_output=True, text=True,
                          env=cli_env(home, env), timeout=timeout, cwd=ROOT)


def start_cli(*args: str, home: Path) -> subprocess.Popen[str]:
    """Start the console script in the background (concurrent runs, kills mid-run)."""
    return subprocess.Popen([str(MODELSHIP), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(home), cwd=ROOT)


def cli_env(home: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a console-script run: this machine's, minus anything that
    would point it away from the stack in ``home``."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MODELSHIP_", *MLFLOW_POINTERS, "AWS_", "PREFECT_API"))}
    return {**clean, "MODELSHIP_HOME": str(home),
            "MODELSHIP_TRITON_RUNTIME": str(RUNTIME_VENV),
            "MODELSHIP_STACK_READY_TIMEOUT_S": STACK_READY_TIMEOUT_S, **(env or {})}


# The session's embedded stack (tests/stack_fixtures.py), shared by integration and e2e tests.
pytest_plugins = ["tests.stack_fixtures"]
