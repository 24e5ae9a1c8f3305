"""prefect.yaml deploys against the stack's real Prefect server, and a flow runs there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from modelship.settings import Settings
from tests import models
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def _prefect_env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("PREFECT_", "MODELSHIP_", "MLFLOW_", "AWS_"))}
    return {**keep, "PREFECT_API_URL": str(settings.prefect_api_url),
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "MODELSHIP_HOME": str(settings.home), "MODELSHIP_REPO_DIR": str(ROOT),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true"}


def _api(settings: Settings, path: str, body: dict[str, object]) -> list[dict[str, object]]:
    request = urllib.request.Request(f"{settings.prefect_api_url}{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return list(json.loads(response.read()))


def test_prefect_yaml_deploys_every_deployment(stack_settings: Settings, tmp_path: Path) -> None:
    env = _prefect_env(stack_settings, tmp_path)
    prefect = str(Path(sys.executable).parent / "prefect")
    pool = subprocess.run([prefect, "work-pool", "create", "modelship-process", "--type",
                           "process", "--overwrite"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert pool.returncode == 0, pool.stderr[-2000:]
    deploy = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert deploy.returncode == 0, (deploy.stdout + deploy.stderr)[-3000:]
    names = {d["name"] for d in _api(stack_settings, "/deployments/filter", {})}
    assert {"promote", "check", "swap", "rollback"} <= names


def test_check_flow_runs_on_the_prefect_server(stack_settings: Settings,
                                               tmp_path: Path) -> None:
    version = models.register_sklearn(str(stack_settings.mlflow_tracking_uri), "prefect-check")
    code = textwrap.dedent(f"""
        from flows.prefect_flows import CheckParams, check_flow
        report = check_flow(CheckParams(model="prefect-check", version={version},
                                        dry_run=True))
        assert report["verdict"] == "passed", report
        assert report["staged"] is None
    """)
    done = subprocess.run([sys.executable, "-c", code], env=_prefect_env(stack_settings, tmp_path),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = _api(stack_settings, "/flow_runs/filter",
                {"flows": {"name": {"any_": ["modelship-check"]}}})
    assert any(run["state_type"] == "COMPLETED" for run in runs), runs
