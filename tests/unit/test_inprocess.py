"""tests/inprocess.py: a command run in the test process answers as the console script
does, sees only its own stack, and leaves the process exactly as it found it (a test worker
runs many files in one process)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import modelship.clients as clients_module
from model_registry.client import mlflow_client, point_mlflow_at
from modelship.stack.process import free_port
from tests.conftest import ROOT, run_cli
from tests.inprocess import (
    CLI_LOGGERS,
    ProcessState,
    _mlflow_uris,
    _set_mlflow_uris,
    beside,
    process_state,
    run_inprocess,
)


def _changed(before: ProcessState, after: ProcessState) -> dict[str, Any]:
    """Every field that differs; loggers created by the run's first imports are new objects
    nobody held before, so only the loggers that existed before are compared."""
    changed = {name: (getattr(before, name), getattr(after, name))
               for name in ProcessState.__dataclass_fields__ if name != "loggers"
               and getattr(before, name) != getattr(after, name)}
    loggers = {name: (state, after.loggers.get(name)) for name, state in before.loggers.items()
               if after.loggers.get(name) != state}
    if loggers:
        changed["loggers"] = loggers
    return changed


def test_a_command_answers_as_the_console_script_does(tmp_path: Path) -> None:
    for args in (["promote", "--json"], ["doctor", "--json"]):  # a usage error; a report
        env = {"MODELSHIP_MLFLOW_TRACKING_URI": "http://127.0.0.1:9",
               "MODELSHIP_S3_ENDPOINT": "http://127.0.0.1:9"}
        inside = run_inprocess(*args, home=tmp_path, env=env)
        console = run_cli(*args, home=tmp_path, env=env)
        assert (inside.returncode, inside.stdout) == (console.returncode, console.stdout), args
        assert inside.args == ["modelship", *args]
    assert console.returncode == 1 and not json.loads(console.stdout)["ok"]  # doctor: down


@pytest.fixture
def sentinel_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                   ) -> Iterator[dict[str, Any]]:
    """A test process pointed everywhere else: MLflow's URIs (and the variables MLflow
    writes), settings variables, Prefect's API, a cwd, argv and a SIGTERM handler."""
    elsewhere = "http://127.0.0.1:1"
    uris = _mlflow_uris()
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):  # point_mlflow_at writes them
        monkeypatch.setenv(key, elsewhere)
    point_mlflow_at(elsewhere)
    for key, value in {"MODELSHIP_HOME": str(tmp_path / "elsewhere"),
                       "MODELSHIP_S3_ENDPOINT": elsewhere, "AWS_ACCESS_KEY_ID": "sentinel",
                       "PREFECT_API_URL": f"{elsewhere}/api"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["pytest", "sentinel"])

    def on_term(_signum: int, _frame: Any) -> None:
        raise AssertionError("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_term)
    yield {"elsewhere": elsewhere, "on_term": on_term}
    signal.signal(signal.SIGTERM, previous)
    _set_mlflow_uris(uris)


def test_runs_against_two_homes_see_only_their_own_stack_and_leak_nothing(
        tmp_path: Path, sentinel_state: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``doctor`` on the main thread, with its endpoint checks wrapped to first change the
    process the way a promotion does: MLflow pointed at the stack (URIs and the variables
    it writes), a cwd, a root log handler, a warnings filter, a signal handler."""
    inside: list[dict[str, Any]] = []
    original = clients_module.check_endpoints

    def changing(clients: Any, settings: Any) -> Any:
        inside.append({"environ": dict(os.environ), "cwd": os.getcwd(),
                       "sigterm": signal.getsignal(signal.SIGTERM),
                       "api_log_level": logging.getLogger("APILogWorker").level})
        mlflow_client(str(settings.mlflow_tracking_uri), timeout_s=3)
        inside[-1]["mlflow"] = (os.environ["MLFLOW_TRACKING_URI"], _mlflow_uris())
        os.chdir("/")
        logging.getLogger().addHandler(logging.NullHandler())
        warnings.simplefilter("error")
        signal.signal(signal.SIGUSR1, lambda _signum, _frame: None)
        return original(clients, settings)

    monkeypatch.setattr(clients_module, "check_endpoints", changing)
    for name in CLI_LOGGERS:
        logging.getLogger(name)
    before = process_state()
    assert before.mlflow_uris == (sentinel_state["elsewhere"],) * 2
    answers = []
    for home in ("a", "b"):
        dead = f"http://127.0.0.1:{free_port()}"
        done = run_inprocess("doctor", "--json", home=tmp_path / home,
                             env={"MODELSHIP_MLFLOW_TRACKING_URI": dead})
        assert done.returncode == 1, done.stderr
        answers.append((dead, json.loads(done.stdout)))
        assert _changed(before, process_state()) == {}

    assert len(inside) == 2
    for (dead, doc), (other, _), seen, home in zip(answers, reversed(answers), inside, "ab",
                                                   strict=True):
        mlflow = next(c for c in doc["checks"] if c["component"] == "mlflow")
        assert mlflow["endpoint"] == dead and other not in json.dumps(doc)
        assert sentinel_state["elsewhere"] not in json.dumps(doc)
        # the command ran in the console script's view of the process, and changed it
        assert seen["environ"]["MODELSHIP_HOME"] == str(tmp_path / home)
        assert not {"AWS_ACCESS_KEY_ID", "PREFECT_API_URL", "MODELSHIP_S3_ENDPOINT",
                    "MLFLOW_TRACKING_URI"} & set(seen["environ"])
        assert seen["cwd"] == str(ROOT)
        assert seen["sigterm"] is not sentinel_state["on_term"]  # main()'s stop handler
        assert seen["api_log_level"] == logging.ERROR  # main() quiets Prefect's senders
        assert seen["mlflow"] == (dead, (dead, dead))
    assert signal.getsignal(signal.SIGTERM) is sentinel_state["on_term"]
    assert signal.getsignal(signal.SIGUSR1) is before.signals[signal.SIGUSR1]
    assert os.environ["MLFLOW_TRACKING_URI"] == sentinel_state["elsewhere"]
    assert os.getcwd() == str(tmp_path) and sys.argv == ["pytest", "sentinel"]


def test_only_the_main_thread_runs_a_command(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_inprocess("--version", home=tmp_path)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_beside_hands_back_the_threads_result_and_its_failure(tmp_path: Path) -> None:
    def wait_for_the_command(done: threading.Event) -> str:
        assert done.wait(30)
        return "after"

    with beside(wait_for_the_command) as helper:
        version = run_inprocess("--version", home=tmp_path)
    assert version.returncode == 0 and helper.result() == "after"

    def fails(_done: threading.Event) -> None:
        raise ValueError("no approval message was posted")

    with beside(fails) as broken:
        pass
    with pytest.raises(ValueError, match="no approval message"):
        broken.result()
