"""Shared test configuration: telemetry off, the repository root, the CLI runner."""

from __future__ import annotations

import json
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
    # no Prefect server but the stacks' own (modelship.prefect_api.BOUNDED_CLIENT)
    "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
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


# --- how `make test` shares the files out between its two xdist workers (--dist loadfile) ---
#
# xdist's own --dist loadgroup cannot be used: it names a test's group by rewriting
# item._nodeid, which pytest 9 no longer reads (Node.nodeid is str(self._id)), so every test
# silently becomes a unit of its own. The scheduler below works from the node ids alone.

#: Worker seconds of the heaviest files (per-file runs and the last full run, setup included):
#: groups go out heaviest first, so the two workers end together (longest job first).
#: A file missing here is estimated from its number of tests (:data:`SECONDS_PER_TEST`).
#: Refresh from a run's ``--durations=0`` when a file's weight changes a lot.
FILE_SECONDS = {
    "tests/e2e/test_crash.py": 300, "tests/e2e/test_promote.py": 130,
    "tests/e2e/test_fleet_cli.py": 125, "tests/e2e/test_demo.py": 130,
    "tests/integration/test_prefect_deployments.py": 50, "tests/e2e/test_bake_traffic.py": 110,
    "tests/e2e/test_progressive.py": 85, "tests/e2e/test_nightly.py": 70,
    "tests/integration/test_artifact_gate.py": 50, "tests/integration/test_stack_heal.py": 70,
    "tests/integration/test_approvals_flow.py": 58, "tests/e2e/test_shadow.py": 55,
    "tests/e2e/test_approvals_promote.py": 30, "tests/integration/test_swap.py": 40,
    "tests/e2e/test_pytorch_promote.py": 60, "tests/integration/test_release_transaction.py": 15,
    "tests/integration/test_swap_faults.py": 15, "tests/integration/test_canary_slot.py": 12,
    "tests/integration/test_gpu_evidence.py": 12, "tests/integration/test_exits.py": 20,
    "tests/integration/test_local_gateway.py": 30,
    "tests/integration/test_standalone_journal.py": 15,
    "tests/integration/test_canary_outcomes.py": 45,
    "tests/unit/test_gates_calibration.py": 12, "tests/integration/test_loadgen.py": 25,
    "tests/e2e/test_stack_cli.py": 22, "tests/unit/test_sequential.py": 16,
    "tests/unit/test_live_judge_traffic.py": 22, "tests/unit/test_export.py": 18,
    "tests/integration/test_locks.py": 30, "tests/integration/test_wheel.py": 11,
    "tests/unit/test_bake_traffic.py": 16,
}
SECONDS_PER_TEST = {"tests/e2e": 60.0, "tests/integration": 8.0}
#: Files of independent cells (each starts from whatever the one before left, and sets up
#: what it needs) cut into this many parts of consecutive tests, in collection order: the
#: first ceil(n/2) cells are one part, maybe on the other worker. None today: the fault
#: matrix (tests/e2e/test_crash.py), the one file that was, runs its cells in lanes side
#: by side on one worker's stack with one CLI zygote, cheaper than two halves that each
#: import the CLI and spend a setup release.
SPLIT: dict[str, int] = {}


def _path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def xdist_groups(nodeids: list[str]) -> list[tuple[str, list[int]]]:
    """The groups of a collection, heaviest first: (name, indices of its tests in
    collection order). One group per file; a file of :data:`SPLIT` is cut into parts of
    consecutive tests, each weighing its share of the file's :data:`FILE_SECONDS`. Pure.
    Ordering the tests by these groups and grouping again gives the same groups."""
    count: dict[str, int] = {}
    for nodeid in nodeids:
        count[_path(nodeid)] = count.get(_path(nodeid), 0) + 1
    groups: dict[str, list[int]] = {}
    nth: dict[str, int] = {}
    for index, nodeid in enumerate(nodeids):
        path = _path(nodeid)
        parts, i = SPLIT.get(path, 1), nth.get(path, 0)
        nth[path] = i + 1
        name = path if parts == 1 else f"{path}-part{i * parts // count[path] + 1}of{parts}"
        groups.setdefault(name, []).append(index)

    def weight(item: tuple[str, list[int]]) -> float:
        path = _path(nodeids[item[1][0]])
        if path in FILE_SECONDS:
            return FILE_SECONDS[path] * len(item[1]) / count[path]
        per_test = next((s for d, s in SECONDS_PER_TEST.items() if path.startswith(d)), 0.1)
        return per_test * len(item[1])

    return sorted(groups.items(), key=weight, reverse=True)  # stable: ties keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: the tests in :func:`xdist_groups` order, heaviest group first
    (xdist hands the units out in collection order with ``--no-loadscope-reorder``; every
    worker orders the same way, as xdist requires)."""
    if not hasattr(config, "workerinput"):
        return
    order = [i for _, indices in xdist_groups([item.nodeid for item in items]) for i in indices]
    items[:] = [items[i] for i in order]


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile``: xdist's scheduler, with :func:`xdist_groups` for units (one per
    file, the :data:`SPLIT` files in parts); any other mode is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling  # lazy: only the xdist controller

    class FileGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                assert self.collection is not None  # set before the first unit is formed
                self._groups = {self.collection[i]: name
                                for name, indices in xdist_groups(self.collection)
                                for i in indices}
            return self._groups[nodeid]

    return FileGroupScheduling(config, log)


# --- a crashed xdist worker's stacks ---

def leftover_stack_homes(basetemp: Path) -> list[Path]:
    """The stack homes (a ``stack.json`` there) that the workers' fixtures and tests made:
    ``<basetemp>/popen-gwN/<tmp dir>/.modelship``, where ``mktemp`` and ``tmp_path`` put
    them (a stack.json deeper down is a test's own fixture data, not a stack; so is one that
    is not a JSON object: the product writes its stack.json whole, tests corrupt theirs)."""
    return sorted(path.parent for path in basetemp.glob("popen-gw*/*/.modelship/stack.json")
                  if _json_object(path))


def _json_object(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (OSError, ValueError):
        return False


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On the xdist controller, after every worker ended: bring down the stacks a worker
    left. A worker that crashes (final run A: a segfault in grpc) never runs its session
    fixtures' teardown, and its stack's servers would outlive the run. ``down`` is
    idempotent: a stack its worker already brought down costs a read of its stack.json."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    from modelship.stack import manager  # lazy: only an xdist controller at its end

    for home in leftover_stack_homes(config._tmp_path_factory.getbasetemp()):
        try:
            manager.down(base_settings(home))
        except Exception as exc:  # noqa: BLE001 - one stack's failure must not hide others
            print(f"\nleft a stack in {home}: `modelship stack down` failed: {exc}")
