"""``mlflow server`` in one process: MLflow's own command, its web server run in-process.

``mlflow server`` prepares the stores (the database's migrations), then starts uvicorn as a
second Python process, which imports MLflow all over again: about 5 s of CPU, and the
server is ready only once both have run, one after the other. Run as
``python -m modelship.stack.mlflow_server server ARGS...``, this module runs MLflow's own
``server`` command with its checks, settings and environment unchanged, and runs the uvicorn
command that command builds in this process, where MLflow is already imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence


class _Ended:
    """What ``mlflow server`` expects back from starting its web server (a ``Popen``): here
    the server has already run to its end in this process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.returncode = 0

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        del timeout
        return self.returncode

    def send_signal(self, signum: int) -> None:
        del signum


def uvicorn_args(cmd: Sequence[str]) -> list[str]:
    """The uvicorn arguments of a ``python -m uvicorn ARGS`` command (pure).

    Raises:
        RuntimeError: the command is not uvicorn's (a future MLflow changed how it serves).
    """
    if len(cmd) < 3 or list(cmd[1:3]) != ["-m", "uvicorn"]:
        raise RuntimeError(f"mlflow server asked to run {' '.join(cmd)!r}, not uvicorn: "
                           "modelship.stack.mlflow_server knows only `python -m uvicorn`")
    return list(cmd[3:])


def run_inline(cmd: Sequence[str], *, extra_env: Mapping[str, str] | None = None,
               **_popen: object) -> _Ended:
    """Stands in for ``mlflow.server._exec_cmd``: sets the environment MLflow meant for its
    web server's process, and runs that server here until it stops."""
    args = uvicorn_args(cmd)
    os.environ.update(extra_env or {})
    import uvicorn.main  # lazy: only the server process serves

    uvicorn.main.main(args=args, prog_name="uvicorn", standalone_mode=False)
    return _Ended()


def main(argv: Sequence[str] | None = None) -> None:
    """``mlflow ARGS``, with the web server in this process."""
    import mlflow.server  # lazy: ~4 s; uvicorn_args' unit test needs none of it
    from mlflow.cli import cli

    mlflow.server._exec_cmd = run_inline  # noqa: SLF001 - the one seam MLflow leaves
    cli.main(args=list(sys.argv[1:] if argv is None else argv), prog_name="mlflow")


if __name__ == "__main__":
    main()
