"""The console script leaves without the interpreter's teardown: same status, same output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from modelship.cli import exit_status
from modelship.cli.nightly import _require_server
from modelship.errors import InfrastructureError
from modelship.stack.process import free_ports

SCRIPT = Path(sys.executable).parent / "modelship"


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (2, 2), (6, 6),
                                              ("a message", 1), (True, True)])
def test_exit_status_maps_systemexit_codes_as_python_does(code: object, status: int) -> None:
    assert exit_status(code) == status


@pytest.mark.parametrize(("args", "status", "out", "err"), [
    (["--version"], 0, "modelship ", ""),
    (["promote", "m"], 2, "", "error: pass exactly one of --version and --alias"),
    (["promote", "m", "--json"], 2, '"exit_code": 2', ""),
])
def test_the_console_script_keeps_its_status_and_flushes_its_output(
        args: list[str], status: int, out: str, err: str) -> None:
    done = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert out in done.stdout and err in done.stderr
    assert done.stdout.endswith("\n") or not done.stdout


def test_deploy_refuses_at_once_a_prefect_server_that_does_not_answer() -> None:
    """`modelship deploy` checks the server's health before it runs `prefect deploy` (whose
    retries ride out a busy server, and would wait on a dead one)."""
    dead = f"http://127.0.0.1:{free_ports(1)[0]}/api"
    with pytest.raises(InfrastructureError, match="does not answer.*nothing was deployed"):
        _require_server(dead, timeout_s=2)
