"""The ``modelship`` command (DESIGN §6): the composition root, above the flows.

One module per command group registers its commands on the shared app:
``stack`` (the embedded stack, ``doctor``), ``artifact`` (``check``, ``stage``),
``fleet`` (``swap``, ``rollback``, ``status``, ``load``, ``canary``), ``release``
(``promote``, ``history``), ``locks`` (``locks``, ``unlock``) and ``demo``.

Every command that reports something takes ``--json`` and prints exactly one JSON document
on stdout; without it, the result (a table or a summary) goes to stdout too. Progress and
logs go to stderr. The exit code is the outcome (0 done, 1 infrastructure, 2 usage,
3 validation, 4 gates, 5 approval, 6 inconclusive). Heavy libraries are imported inside the
commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

import modelship.cli.approvals  # noqa: F401 - register approvals serve, click
import modelship.cli.nightly  # noqa: F401 - register nightly, deploy, worker
from modelship.cli import artifact, demo, fleet, locks, release, stack  # noqa: F401 - register
from modelship.cli._common import app
from modelship.output import report_failure
from modelship.signals import stop_on_signals


def _version(value: bool) -> None:
    if value:
        # lazy: importlib.metadata pulls zipfile and csv (~12 ms); only --version needs it
        from importlib.metadata import version

        typer.echo(f"modelship {version('modelship')}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")]
          = False) -> None:
    """Release pipeline that promotes MLflow-registered models to NVIDIA Triton."""


def _without_traceback(record: logging.LogRecord) -> bool:
    """A log filter that keeps the line and drops the traceback."""
    record.exc_info = None
    record.exc_text = None
    return True


_EXIT_STATUS: list[int] = []  # the console script's exit status, once main() knows it


def exit_status(code: object) -> int:
    """The process exit status of ``SystemExit(code)``, as Python maps it (pure)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _exit_without_teardown() -> None:
    """The console script's last step at exit, after Prefect's senders, the threads and
    every other exit handler: close the log handlers, flush stdout and stderr, and leave.

    The interpreter's own teardown (clearing the ~8,000 modules a promote imports: MLflow,
    GX, scikit-learn, Prefect) costs seconds and does nothing a finished command needs.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say there
            pass
    os._exit(_EXIT_STATUS[-1] if _EXIT_STATUS else 1)


def _is_console_script() -> bool:
    """True when this process is ``modelship ...`` itself (not a test calling main())."""
    return Path(getattr(sys.modules.get("__main__"), "__file__", None) or "").name == "modelship"


def main() -> None:
    """Console-script entry point.

    Every way out of a command ends in one stderr line (plus a JSON error document with
    ``--json``) and its exit code, never a traceback: the commands report their own errors
    (:func:`modelship.output.run_reporting`); what escapes them, and a SIGINT or SIGTERM
    outside one, is reported here the same way. Prefect's client gets bounded retries and
    a request timeout (:data:`modelship.prefect_api.BOUNDED_CLIENT`), so an API that is
    down costs seconds, not minutes. The console script skips the interpreter's teardown
    at exit (:func:`_exit_without_teardown`).
    """
    # lazy: keeps ssl and http.client (~35 ms) out of `import modelship.cli`; main pays it once
    from modelship.prefect_api import set_client_defaults

    # No network but loopback here, and progress bars would garble stderr progress lines.
    for key, value in {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "GX_ANALYTICS_ENABLED": "false",
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
                       "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3"}.items():
        os.environ.setdefault(key, value)
    set_client_defaults(os.environ)
    # Prefect's background senders warn "Still processing items: N items remaining..." while
    # they flush at exit: noise for a CLI user, whose result is already printed.
    for service in ("APILogWorker", "EventsWorker"):
        logging.getLogger(service).setLevel(logging.ERROR)
    # Prefect logs a failed flow or task run with its traceback; the command says the error
    # in one line instead (an unexpected one keeps its traceback in a log file).
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).addFilter(_without_traceback)
    if _is_console_script():  # registered before the command's: runs after theirs
        atexit.register(_exit_without_teardown)
    try:
        try:
            with stop_on_signals():
                app()
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - the last resort: one line, an exit code
            sys.exit(report_failure(exc, as_json="--json" in sys.argv[1:]))
    except SystemExit as exc:
        _EXIT_STATUS.append(exit_status(exc.code))
        raise


__all__ = ["app", "main"]
