"""Shared test configuration: telemetry off, the repository root, the CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

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


def run_cli(
    *args: str, home: Path, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run the real ``modelship`` console script against the stack in ``home``."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MODELSHIP_", "MLFLOW_TRACKING", "AWS_", "PREFECT_API"))}
    full_env = {**clean, "MODELSHIP_HOME": str(home),
                "MODELSHIP_TRITON_RUNTIME": str(RUNTIME_VENV), **(env or {})}
    return subprocess.run([str(MODELSHIP), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT)


# The session's embedded stack (tests/stack_fixtures.py), shared by integration and e2e tests.
pytest_plugins = ["tests.stack_fixtures"]
