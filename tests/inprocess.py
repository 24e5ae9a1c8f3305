"""Run a ``modelship`` command in the test process, through exactly the function the console
script runs (:func:`modelship.cli.main`), and leave the process as it found it.

A console-script run pays the interpreter, its imports (MLflow, GX, Prefect: 10-25 s under
load) and Prefect's start before any real work. In the test worker those are paid once.
:func:`run_inprocess` takes :func:`tests.conftest.run_cli`'s arguments and returns its
:class:`subprocess.CompletedProcess` (exit code, stdout with the ``--json`` document,
stderr), so a test switches with one line. The CLI subprocess stays for what only it can
show: the exit code and JSON contract of each command (tests/e2e/test_promote.py,
test_artifact_gate.py), signals and kills (tests/e2e/test_crash.py), and two processes
racing for one lock.

What differs from the console script, on purpose:

- the console script's exit skips the interpreter's teardown (``os._exit``); here
  :func:`modelship.cli.main` sees that it is not the console script and only raises
  ``SystemExit``, whose code is the return code;
- ``stderr`` holds what was written to ``sys.stderr`` (progress lines, the error line);
  log handlers that a library bound to the real stream earlier keep writing there;
- ``timeout`` is the test's own (pytest-timeout): a command is never killed half-way in
  the process that runs the test.

Process-wide state a command changes, restored exactly on the way out (a test worker runs
many files in one process: pytest-xdist ``--dist loadfile``):

- ``os.environ``: the command sees :func:`tests.conftest.cli_env`'s view (the stack in
  ``home``, nothing pointing elsewhere), and what it writes (MLflow's
  ``MLFLOW_TRACKING_URI``/``MLFLOW_REGISTRY_URI``, its HTTP timeouts, the CLI's Prefect
  client defaults) goes with it;
- MLflow's process-wide tracking and registry URIs
  (:func:`model_registry.client.point_mlflow_at`) and an active MLflow run left behind;
- Prefect's settings context and its events-client override (:mod:`modelship.prefect_api`);
- signal handlers, the working directory, ``sys.argv``, the warnings filters;
- the state of every logger (level, handlers, filters, propagation), including those that
  :func:`modelship.cli.main` configures;
- the CLI's exit-status list (``modelship.cli._EXIT_STATUS``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.conftest import ROOT, cli_env

__all__ = ["Beside", "ProcessState", "beside", "process_state", "run_inprocess"]

T = TypeVar("T")

#: Loggers :func:`modelship.cli.main` configures (levels, filters). Created before the
#: snapshot, so that what main() sets on them is restored even when Prefect is imported
#: for the first time inside the command.
CLI_LOGGERS = ("APILogWorker", "EventsWorker", "prefect.flow_runs", "prefect.task_runs")


def run_inprocess(*args: str, home: Path, env: Mapping[str, str] | None = None,
                  timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``modelship *args`` against the stack in ``home``, in this process.

    The same arguments and result as :func:`tests.conftest.run_cli`; ``timeout`` is left
    to pytest-timeout (see the module docstring). Must be called from the main thread, as
    the console script runs there (signal handlers, Prefect's engine).
    """
    del timeout  # the test's own timeout bounds an in-process command
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_inprocess runs a command as the console script does: from "
                           "the main thread (run the test's concurrent part in a thread: "
                           "tests.inprocess.beside)")
    from modelship import cli

    argv = [str(Path(sys.executable).parent / "modelship"), *args]
    out, err = io.StringIO(), io.StringIO()
    with _isolated(home, env, argv), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = cli.exit_status(exc.code)
    return subprocess.CompletedProcess(["modelship", *args], code, out.getvalue(),
                                       err.getvalue())


# --------------------------------------------------------------------------------------
# process-wide state


@dataclass(frozen=True)
class LoggerState:
    level: int
    propagate: bool
    disabled: bool
    handlers: tuple[logging.Handler, ...]
    filters: tuple[Any, ...]

    @classmethod
    def of(cls, logger: logging.Logger) -> LoggerState:
        return cls(logger.level, logger.propagate, logger.disabled, tuple(logger.handlers),
                   tuple(logger.filters))

    def restore(self, logger: logging.Logger) -> None:
        logger.setLevel(self.level)
        logger.propagate = self.propagate
        logger.disabled = self.disabled
        logger.handlers[:] = self.handlers
        logger.filters[:] = self.filters


@dataclass(frozen=True)
class ProcessState:
    """What a command may change in its process, as a comparable value (the unit tests
    compare the state before and after a run)."""

    environ: dict[str, str]
    cwd: str
    argv: tuple[str, ...]
    signals: dict[int, Any]
    loggers: dict[str, LoggerState]
    mlflow_uris: tuple[str | None, str | None]
    mlflow_active_run: str | None
    prefect_settings: Any
    prefect_events_override: Any
    cli_exit_statuses: int


def _loggers() -> dict[str, logging.Logger]:
    manager = logging.Logger.manager
    found = {name: logger for name, logger in manager.loggerDict.items()
             if isinstance(logger, logging.Logger)}
    return {"": logging.getLogger(), **found}


def _signals() -> dict[int, Any]:
    handlers = {}
    for signum in signal.valid_signals():
        try:
            handlers[int(signum)] = signal.getsignal(signum)
        except (OSError, ValueError):  # not catchable here (SIGKILL, SIGSTOP)
            continue
    return handlers


def _mlflow_uris() -> tuple[str | None, str | None]:
    """MLflow's process-wide tracking and registry URIs (None: never set, or MLflow not
    imported yet, which is the same)."""
    tracking = sys.modules.get("mlflow.tracking._tracking_service.utils")
    registry = sys.modules.get("mlflow.tracking._model_registry.utils")
    return (getattr(tracking, "_tracking_uri", None), getattr(registry, "_registry_uri", None))


def _set_mlflow_uris(uris: tuple[str | None, str | None]) -> None:
    tracking = sys.modules.get("mlflow.tracking._tracking_service.utils")
    registry = sys.modules.get("mlflow.tracking._model_registry.utils")
    if tracking is not None:
        tracking._tracking_uri = uris[0]
    if registry is not None:
        registry._registry_uri = uris[1]


def _mlflow_active_run() -> str | None:
    fluent = sys.modules.get("mlflow.tracking.fluent")
    run = fluent.active_run() if fluent is not None else None
    return None if run is None else str(run.info.run_id)


def _prefect_state() -> tuple[Any, Any]:
    context = sys.modules.get("prefect.context")
    worker = sys.modules.get("prefect.events.worker")
    settings = context.SettingsContext.get() if context is not None else None
    override = getattr(getattr(worker, "EventsWorker", None), "_client_override", None)
    return settings, override


def process_state() -> ProcessState:
    """The process-wide state :func:`run_inprocess` restores, now."""
    from modelship import cli

    settings, override = _prefect_state()
    return ProcessState(
        environ=dict(os.environ), cwd=os.getcwd(), argv=tuple(sys.argv), signals=_signals(),
        loggers={name: LoggerState.of(logger) for name, logger in _loggers().items()},
        mlflow_uris=_mlflow_uris(), mlflow_active_run=_mlflow_active_run(),
        prefect_settings=settings, prefect_events_override=override,
        cli_exit_statuses=len(cli._EXIT_STATUS))


def _restore(saved: ProcessState) -> None:
    from modelship import cli

    # an MLflow run the command left open (training in-process) is ended, not inherited
    if _mlflow_active_run() not in (None, saved.mlflow_active_run):
        sys.modules["mlflow.tracking.fluent"].end_run()
    _set_mlflow_uris(saved.mlflow_uris)
    worker = sys.modules.get("prefect.events.worker")
    if worker is not None:
        worker.EventsWorker._client_override = saved.prefect_events_override
    for signum, handler in saved.signals.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
    loggers = _loggers()
    for name, state in saved.loggers.items():
        state.restore(loggers[name])
    del cli._EXIT_STATUS[saved.cli_exit_statuses:]
    sys.argv[:] = saved.argv
    os.chdir(saved.cwd)
    os.environ.clear()
    os.environ.update(saved.environ)


@contextlib.contextmanager
def _isolated(home: Path, env: Mapping[str, str] | None, argv: list[str]) -> Iterator[None]:
    """Inside: the console script's environment, cwd and argv; outside: as before."""
    for name in CLI_LOGGERS:
        logging.getLogger(name)
    saved = process_state()
    view = cli_env(home, env)
    with warnings.catch_warnings():
        try:
            os.environ.clear()
            os.environ.update(view)
            os.chdir(ROOT)
            sys.argv[:] = argv
            yield
        finally:
            _restore(saved)
    prefect_settings, _ = _prefect_state()
    if saved.prefect_settings is not None and prefect_settings is not saved.prefect_settings:
        raise AssertionError("a command left Prefect's settings context changed "
                             f"({saved.prefect_settings!r} -> {prefect_settings!r})")


# --------------------------------------------------------------------------------------
# the test's concurrent part


class Beside:
    """A function running in a thread beside an in-process command (see :func:`beside`)."""

    def __init__(self, fn: Callable[[threading.Event], T]) -> None:
        self.done = threading.Event()  # set when the command has returned
        self._result: list[Any] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                        name="beside-inprocess")

    def _run(self, fn: Callable[[threading.Event], Any]) -> None:
        try:
            self._result.append(fn(self.done))
        except BaseException as exc:  # noqa: BLE001 - handed to the test in result()
            self._error.append(exc)

    def result(self, timeout: float = 120) -> Any:
        """What the function returned; its exception, re-raised, when it failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the thread beside the command still runs after {timeout} s")
        if self._error:
            raise self._error[0]
        return self._result[0]


@contextlib.contextmanager
def beside(fn: Callable[[threading.Event], T]) -> Iterator[Beside]:
    """Run ``fn(done)`` in a thread while the block runs an in-process command on the main
    thread (where the console script runs it); ``done`` is set when the block ends.

    The test's concurrent part (send traffic once the swap is done, click an approval)
    goes here, where a console-script test had the command in a child process.
    """
    runner = Beside(fn)
    runner._thread.start()
    try:
        yield runner
    finally:
        runner.done.set()
