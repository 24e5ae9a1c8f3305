"""Command output: the result on stdout (one JSON document with ``--json``, else a table or a
summary); progress and errors on stderr."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from modelship.errors import ModelshipError

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

    Errors become one line (plus the hint) on stderr, and with ``--json`` also an error
    document on stdout, so scripts always get exactly one JSON document.
    """
    try:
        # Libraries print to stdout (MLflow's "View run ..."): keep stdout for the one
        # JSON document, everything else goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            result = action()
    except ModelshipError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        if as_json:
            print_json(exc.to_dict())
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if as_json:
        print_json(to_json(result))
    else:
        text = render(result)
        if text:
            print(text, flush=True)
    return exit_code(result)
