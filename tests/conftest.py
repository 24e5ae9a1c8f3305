"""Shared test configuration: telemetry off, the repository root, the CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

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


# --- how `make test` shares the files out between its two xdist workers (--dist loadgroup) ---

#: Worker seconds of the heaviest files (the last full run's durations, setup included):
#: groups go out heaviest first, so the two workers end together (longest job first).
#: A file missing here is estimated from its number of tests (:data:`SECONDS_PER_TEST`).
#: Refresh from a run's ``--durations=0`` when a file's weight changes a lot.
FILE_SECONDS = {
    "tests/e2e/test_crash.py": 1500, "tests/e2e/test_promote.py": 610,
    "tests/e2e/test_demo.py": 420, "tests/e2e/test_fleet_cli.py": 280,
    "tests/e2e/test_stack_cli.py": 260, "tests/integration/test_prefect_deployments.py": 240,
    "tests/integration/test_swap.py": 220, "tests/e2e/test_bake_traffic.py": 200,
    "tests/integration/test_stack_heal.py": 200, "tests/e2e/test_nightly.py": 155,
    "tests/integration/test_artifact_gate.py": 150, "tests/e2e/test_approvals_promote.py": 130,
    "tests/integration/test_release_transaction.py": 130,
    "tests/e2e/test_gpu_policy_on_cpu.py": 120,
    "tests/integration/test_standalone_journal.py": 110, "tests/e2e/test_pytorch_promote.py": 110,
    "tests/integration/test_swap_faults.py": 100, "tests/integration/test_exits.py": 100,
    "tests/integration/test_wheel.py": 90, "tests/unit/test_sequential.py": 90,
    "tests/unit/test_bake_traffic.py": 80, "tests/unit/test_gates_calibration.py": 80,
}
SECONDS_PER_TEST = {"tests/e2e": 60.0, "tests/integration": 8.0}
#: Files of independent cells (each starts from whatever the one before left, and sets up
#: what it needs: see test_crash's ``_start``) split into this many groups, one per worker,
#: where their tests carry no ``xdist_group`` mark of their own (a file's own marks say
#: better where to cut). The 16-cell fault matrix alone is a third of the suite's worker
#: time. Each group brings up the file's own stack (about a minute), maybe on another worker.
SPLIT = {"tests/e2e/test_crash.py": 2}


def xdist_groups(tests: list[tuple[str, str | None]]) -> list[tuple[str, list[int]]]:
    """The groups of a collection, heaviest first: (name, indices of its tests in
    collection order). ``tests`` holds each test's file and the xdist group it is marked
    with (None: unmarked). A marked test stays in its group; the unmarked ones of a file
    form one group, except in the files of :data:`SPLIT`, which deal them round-robin
    into their parts. A group weighs its share of its file's :data:`FILE_SECONDS`. Pure;
    the hook below applies it."""
    groups: dict[str, list[int]] = {}
    per_file: dict[str, int] = {}
    unmarked: dict[str, int] = {}
    for index, (path, marked) in enumerate(tests):
        per_file[path] = per_file.get(path, 0) + 1
        if marked is None:
            parts, nth = SPLIT.get(path, 1), unmarked.get(path, 0)
            unmarked[path] = nth + 1
            marked = path if parts == 1 else f"{path}-part{nth % parts + 1}of{parts}"
        groups.setdefault(marked, []).append(index)

    def weight(item: tuple[str, list[int]]) -> float:
        _, indices = item
        seconds = 0.0
        for index in indices:
            path = tests[index][0]
            per_test = next((s for d, s in SECONDS_PER_TEST.items() if path.startswith(d)), 0.1)
            seconds += FILE_SECONDS[path] / per_file[path] if path in FILE_SECONDS else per_test
        return seconds

    return sorted(groups.items(), key=weight, reverse=True)  # stable: ties keep their order


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook appends the group to each nodeid
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (make test): every file is one xdist group (its module
    fixtures stay in one process, as with loadfile), tests keep an ``xdist_group`` mark of
    their own, the files of :data:`SPLIT` are cut in parts, and the groups are ordered
    heaviest first (xdist hands them out in collection order with
    ``--no-loadscope-reorder``)."""
    if config.getoption("dist", default="no") != "loadgroup":
        return
    tests = [(item.nodeid.split("::", 1)[0], _marked_group(item)) for item in items]
    ordered: list[pytest.Item] = []
    for name, indices in xdist_groups(tests):
        for index in indices:
            if tests[index][1] is None:
                items[index].add_marker(pytest.mark.xdist_group(name))
            ordered.append(items[index])
    items[:] = ordered


def _marked_group(item: pytest.Item) -> str | None:
    """The group of a test's own ``xdist_group`` marks, named as xdist names it."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
             for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) if names else None
