"""The wheel the Dockerfile installs: built here, installed into a clean venv, and run.

No Docker daemon on these machines, so the image itself is not built in tests; this is
its first stage (``uv build --wheel`` + ``uv pip install``) without the container.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def uv() -> list[str]:
    found = shutil.which("uv")
    return [found] if found else [sys.executable, "-m", "uv"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([*uv(), "build", "--wheel", "--out-dir", str(out), str(ROOT)], check=True,
                   capture_output=True, timeout=300)
    (built,) = out.glob("modelship-*.whl")
    return built


def test_wheel_ships_the_runtime_and_no_tests(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("modelship-")}
    assert tops == {"modelship", "flows", "tasks", "model_registry"}
    assert not any(n.startswith("tests/") or "/tests/" in n for n in names)
    # The Slack emulator stays: `modelship stack up` runs it.
    assert "modelship/slack/emulator.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_wheel_installs_and_runs_in_a_clean_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([*uv(), "venv", "-q", "--python", sys.executable, str(venv)], check=True,
                   timeout=120)
    # Reuse the project venv's downloads: offline-safe and fast (uv's cache links them).
    subprocess.run([*uv(), "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                    str(wheel)], check=True, timeout=600)
    exe = venv / "bin" / "modelship"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}
    helped = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "doctor" in helped.stdout and "stack" in helped.stdout
    # No stack and no settings: doctor says what is missing and exits non-zero.
    doctor = subprocess.run([str(exe), "doctor"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "not configured" in doctor.stdout and "modelship stack up" in doctor.stdout
    assert not (tmp_path / ".modelship" / "stack.json").exists()
    assert os.access(exe, os.X_OK)
