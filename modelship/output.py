"""Command output: the result on stdout (one JSON document with ``--json``, else a table or a
summary); progress and errors on stderr."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from modelship.errors import ModelshipError
from modelship.faults import describe_traceback, translate
from modelship.signals import exit_code_for, stop_signal

T = TypeVar("T")


def progress(message: str) -> None:
    """A progress line on stderr, with a timestamp, never on stdout."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def print_json(document: Any) -> None:
    """Exactly one JSON document on stdout."""
    sys.stdout.write(json.dumps(document, indent=2, default=str, sort_keys=False) + "\n")
    sys.stdout.flush()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_reporting(
    action: Callable[[], T],
    *,
    as_json: bool,
    render: Callable[[T], str],
    to_json: Callable[[T], Any],
    exit_code: Callable[[T], int] = lambda _: 0,
) -> int:
    """Run a command body; print its result or its error; return the process exit code.

    Every way out ends the same: an error (of any type, a stop signal included) becomes
    one line on stderr, and with ``--json`` also an error document on stdout, so scripts
    always get exactly one JSON document and never a traceback (:func:`report_failure`).
    """
    try:
        # Libraries print to stdout (MLflow's "View run ..."): keep stdout for the one
        # JSON document, everything else goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            result = action()
            document = to_json(result) if as_json else None
            text = "" if as_json else render(result)
            code = exit_code(result)
    except BaseException as exc:  # noqa: BLE001 - every way out is reported; see below
        return report_failure(exc, as_json=as_json)
    if as_json:
        print_json(document)
    elif text:
        print(text, flush=True)
    return code


def failure_document(exc: BaseException) -> dict[str, Any]:
    """What a failed command reports (pure): the error document of ``--json`` output.

    A stop signal exits 128 + its number (130 SIGINT, 143 SIGTERM); a modelship error
    keeps its class and exit code; anything else is translated (a transport failure becomes
    :class:`~modelship.errors.Unreachable` naming the endpoint, the rest exit 1 naming the
    exception).
    """
    signum = stop_signal(exc)
    if signum is not None:
        name = signal.Signals(signum).name
        return {"error": "StopRequested", "exit_code": exit_code_for(signum),
                "message": f"stopped by {name}", "hint": "the next command finishes or undoes "
                "what this one left; `modelship status MODEL` shows what serves",
                "details": {"signal": name}}
    return translate(exc).to_dict()


def report_failure(exc: BaseException, *, as_json: bool) -> int:
    """Say ``exc`` in one line on stderr (plus the JSON document with ``--json``); return
    the exit code. The traceback of an unexpected error goes to a log file, not the
    terminal. ``SystemExit`` and the CLI framework's own exits pass through."""
    if isinstance(exc, SystemExit | GeneratorExit) or _is_cli_exit(exc):
        raise exc
    document = failure_document(exc)
    if document["error"] == "InfrastructureError" and not isinstance(exc, ModelshipError):
        saved = _save_traceback(exc)
        if saved:
            document["details"] = {**document.get("details", {}), "traceback": saved}
            document["hint"] = f"{document['hint']}; the traceback is in {saved}"
    line = document["message"].rstrip(".")
    if document.get("hint"):
        line += f". {document['hint'][0].upper()}{document['hint'][1:].rstrip('.')}."
    print(f"error: {' '.join(line.split())}", file=sys.stderr, flush=True)
    if as_json:
        print_json(document)
    return int(document["exit_code"])


def _is_cli_exit(exc: BaseException) -> bool:
    """click's Exit/Abort/usage errors: the framework reports those itself."""
    return type(exc).__module__.startswith("click.")


def _save_traceback(exc: BaseException) -> str | None:
    """Append the traceback to ``$MODELSHIP_HOME/logs/errors.log``; its path, or None."""
    home = Path(os.environ.get("MODELSHIP_HOME", ".modelship"))
    folder = home / "logs" if home.is_dir() else Path(tempfile.gettempdir())
    path = folder / ("errors.log" if home.is_dir() else "modelship-errors.log")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with path.open("a") as log:
            log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}\n"
                      f"{describe_traceback(exc)}\n")
    except OSError:
        return None
    return str(path)
