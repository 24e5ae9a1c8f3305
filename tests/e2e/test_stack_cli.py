"""`modelship stack up | status | down`, each a real ``modelship`` process.

The processes are forked from one pre-imported ``modelship`` (:class:`tests.zygote.Zygote`,
as tests/integration/test_exits.py and the fault matrix run their CLIs): each runs the
console script's ``main`` to its exit status, with its own home (and runtime) in its
environment, its stdout and stderr, and the servers it starts are its own children. What
differs from the console script is only that the interpreter and the CLI's imports are
paid once for the module, not once per command (about 0.5-1 CPU-s each).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from modelship.stack.process import ProcessRecord, process_start_ticks
from tests.conftest import ROOT, cli_env
from tests.zygote import Completed, Zygote

pytestmark = pytest.mark.e2e

#: What the stack commands import before they run (the rest each imports itself).
PRELOAD = ("modelship.cli", "modelship.stack.manager", "tasks.reconcile")
#: What a run sets in its environment: its home, and the runtime where a test fakes one
#: (both read when the command runs, never at import).
LATE_ENV = ("MODELSHIP_HOME", "MODELSHIP_TRITON_RUNTIME")


#: ``run_cli(*args, home=..., env=...)``, as :func:`tests.conftest.run_cli`.
Cli = Callable[..., Completed]


@pytest.fixture(scope="module")
def run_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    """``modelship *args`` with ``home`` (and ``env``) as :func:`tests.conftest.run_cli`
    gives them, each run a process forked from one zygote."""
    base = tmp_path_factory.mktemp("stack-cli") / ".modelship"
    with Zygote(target="modelship.cli:main", preload=PRELOAD, env=cli_env(base), cwd=ROOT,
                late_env=LATE_ENV, prepare="tests.faults:cli_defaults") as zygote:
        zygote.wait_ready()

        def run(*args: str, home: Path, env: Mapping[str, str] | None = None) -> Completed:
            return zygote.run(["modelship", *args],
                              env={"MODELSHIP_HOME": str(home), **(env or {})}, timeout=300)

        yield run


def processes_mentioning(text: str) -> list[int]:
    """The live processes whose command line holds ``text`` (e.g. a stack's home)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


# `stack up` of a real stack, `status`, the idempotent `up`, a refused replica count and
# `down` leaving nothing behind: tests/integration/test_stack_heal.py, on the stack that
# module brings up with the console script (one stack start for both).


def test_down_with_nothing_running_says_so(tmp_path: Path, run_cli: Cli) -> None:
    done = run_cli("stack", "down", home=tmp_path / "empty")
    assert done.returncode == 0
    assert "nothing to stop" in done.stdout


def test_status_without_a_stack_says_what_to_do(tmp_path: Path, run_cli: Cli) -> None:
    done = run_cli("stack", "status", "--json", home=tmp_path / "empty")
    assert done.returncode == 1
    error = json.loads(done.stdout)
    assert error["error"] == "StackError"
    assert "modelship stack up" in error["hint"]


def test_missing_triton_runtime_names_the_fix_and_starts_nothing(
        tmp_path: Path, run_cli: Cli) -> None:
    home = tmp_path / ".modelship"
    done = run_cli("stack", "up", home=home,
                   env={"MODELSHIP_TRITON_RUNTIME": str(tmp_path / "no-such-venv")})
    assert done.returncode == 1
    assert "does not exist" in done.stderr and "make install" in done.stderr
    assert not (home / "stack.json").exists()
    assert not processes_mentioning(str(home))


def test_port_already_in_use_is_named(tmp_path: Path, run_cli: Cli) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_cli("stack", "up", "--base-port", str(port), home=tmp_path / ".modelship")
    assert done.returncode == 1
    assert f"port(s) {port}" in done.stderr and "--base-port" in done.stderr


def _fake_runtime(root: Path, server_script: str) -> Path:
    """A runtime venv whose tritonserver is ``server_script`` (everything else looks right)."""
    site = root / "lib" / "python3.11" / "site-packages"
    server = site / "pytriton" / "tritonserver"
    (server / "bin").mkdir(parents=True)
    (server / "backends" / "python").mkdir(parents=True)
    (server / "python_backend_stubs" / "3.11").mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (server / "backends" / "python" / name).write_text("")
    (server / "python_backend_stubs" / "3.11" / "triton_python_backend_stub").write_text("")
    for folder in ("nvidia_pytriton.libs", "onnxruntime", "numpy", "numpy-1.26.4.dist-info"):
        (site / folder).mkdir()
    binary = server / "bin" / "tritonserver"
    binary.write_text(server_script)
    binary.chmod(0o755)
    return root


def test_component_dying_during_startup_is_named_and_everything_stops(
        tmp_path: Path, run_cli: Cli) -> None:
    home = tmp_path / ".modelship"
    runtime = _fake_runtime(tmp_path / "fake-venv",
                            "#!/bin/sh\necho 'simulated: cannot open model repository' >&2\n"
                            "exit 3\n")
    done = run_cli("stack", "up", "--replicas", "1", home=home,
                   env={"MODELSHIP_TRITON_RUNTIME": str(runtime)})
    assert done.returncode == 1
    assert "exited with code 3 during startup" in done.stderr
    assert "simulated: cannot open model repository" in done.stderr
    assert str(home / "logs") in done.stderr
    assert not (home / "stack.json").exists()
    assert not processes_mentioning(str(home))


def test_broken_binary_is_named(tmp_path: Path, run_cli: Cli) -> None:
    runtime = _fake_runtime(tmp_path / "fake-venv", "not a program")
    (runtime / "lib/python3.11/site-packages/pytriton/tritonserver/bin/tritonserver").chmod(0o644)
    done = run_cli("stack", "up", home=tmp_path / ".modelship",
                   env={"MODELSHIP_TRITON_RUNTIME": str(runtime)})
    assert done.returncode == 1
    assert "not executable" in done.stderr and "make install" in done.stderr


def _write_state(home: Path, processes: list[ProcessRecord]) -> None:
    home.mkdir(parents=True, exist_ok=True)
    state = {"version": 1, "triton": {"replicas": [], "canary": None},
             "processes": [p.to_dict() for p in processes]}
    (home / "stack.json").write_text(json.dumps(state))


def test_half_up_stack_is_refused_and_down_cleans_it(tmp_path: Path, run_cli: Cli) -> None:
    home = tmp_path / ".modelship"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                               start_new_session=True)
    try:
        alive = ProcessRecord("mlflow", sleeper.pid, process_start_ticks(sleeper.pid), (), "")
        dead = ProcessRecord("seaweedfs", 999_999_999, 1, (), "")
        _write_state(home, [dead, alive])
        up = run_cli("stack", "up", home=home)
        assert up.returncode == 1
        assert "half up" in up.stderr and "seaweedfs" in up.stderr
        assert "modelship stack down" in up.stderr
        down = run_cli("stack", "down", "--json", home=home)
        assert down.returncode == 0
        assert json.loads(down.stdout) == {"stopped": ["mlflow"],
                                           "already_stopped": ["seaweedfs"], "open_ports": []}
        assert sleeper.wait(timeout=10) is not None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_recycled_pid_is_never_signalled(tmp_path: Path, run_cli: Cli) -> None:
    home = tmp_path / ".modelship"
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ticks = process_start_ticks(stranger.pid)
        assert ticks is not None
        # Same PID, different start time: what a recycled PID looks like.
        _write_state(home, [ProcessRecord("prefect", stranger.pid, ticks - 1, (), "")])
        down = run_cli("stack", "down", "--json", home=home)
        assert down.returncode == 0
        assert json.loads(down.stdout)["already_stopped"] == ["prefect"]
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_corrupt_state_file_says_what_to_do(tmp_path: Path, run_cli: Cli) -> None:
    home = tmp_path / ".modelship"
    home.mkdir()
    (home / "stack.json").write_text("{not json")
    done = run_cli("stack", "status", home=home)
    assert done.returncode in (1, 2)
    assert "stack.json" in done.stderr and "stack up" in done.stderr


def test_zero_replicas_is_a_usage_error_and_starts_nothing(tmp_path: Path, run_cli: Cli) -> None:
    home = tmp_path / ".modelship"
    up = run_cli("stack", "up", "--replicas", "0", home=home)
    assert up.returncode == 2, up.stderr[-2000:]
    assert "--replicas must be at least 1" in up.stderr
    assert not (home / "stack.json").exists()
