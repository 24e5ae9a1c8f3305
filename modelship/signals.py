"""SIGINT and SIGTERM as a request to stop cleanly, and cleanups a second signal cannot skip.

A pod stop, a Prefect cancel (the runner sends SIGTERM) and Ctrl-C all mean the same thing
to a release: stop, and leave the fleet, the pin, the aliases and the record in one true
state (DESIGN §2 item 10). So:

- :func:`stop_on_signals` (installed at the CLI entry and in the promote flow) turns both
  signals into :class:`StopRequested`, raised in the main thread wherever it is. It is a
  :class:`KeyboardInterrupt`, so every ``except KeyboardInterrupt`` (``reconcile
  --watch``, the CLI's exit 130) treats SIGTERM the same as Ctrl-C, and no
  ``except Exception`` swallows it.
- :func:`deferred` wraps a cleanup (abort a swap, undo it, write the record): a signal that
  arrives inside it is remembered, said on stderr, and does not interrupt it. The cleanup
  is bounded by its own deadlines, so a second Ctrl-C waits seconds, not forever; SIGKILL
  still stops the process, and the next command finishes what it left
  (:mod:`tasks.recovery`).
- :func:`stop_signal` tells which signal an exception stands for, whoever raised it: ours,
  Python's own ``KeyboardInterrupt``, or Prefect's ``TerminationSignal``.

Handlers can only be installed in the main thread; elsewhere these are no-ops (a worker
thread never receives signals in Python anyway).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["StopRequested", "deferred", "exit_code_for", "stop_on_signals", "stop_signal"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)

Handler = Callable[[int, FrameType | None], Any] | int | None


class StopRequested(KeyboardInterrupt):
    """A SIGINT or SIGTERM asked this process to stop cleanly.

    Attributes:
        signum: The signal received.
        exit_code: ``128 + signum`` (130 for SIGINT, 143 for SIGTERM), the shell's code.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"{signal.Signals(signum).name} received: stopping cleanly")


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise StopRequested(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _swap_handlers(handler: Handler) -> dict[int, Handler]:
    """Install ``handler`` for both signals; return the previous ones."""
    previous: dict[int, Handler] = {}
    for signum in SIGNALS:
        previous[signum] = signal.getsignal(signum)
        signal.signal(signum, handler)
    return previous


def _restore(previous: dict[int, Handler]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside: SIGINT and SIGTERM raise :class:`StopRequested` in the main thread.

    The previous handlers come back on the way out (Prefect's engine installs its own
    SIGTERM bridge around a flow run; it gets it back when the flow body returns).
    """
    if not _main_thread():
        yield
        return
    previous = _swap_handlers(_raise_stop)
    try:
        yield
    finally:
        _restore(previous)


@contextmanager
def deferred(what: str, *, say: Callable[[str], None] | None = None,
             received: list[int] | None = None) -> Iterator[list[int]]:
    """Run a cleanup that a signal must not cut short.

    A SIGINT or SIGTERM that arrives inside is appended to the yielded list (and to
    ``received`` when given) and said on ``say`` (default stderr); the cleanup goes on.
    The caller decides what the remembered signals mean once it is done (a cleanup that
    runs because of a first signal simply ends as that stop).

    Args:
        what: The cleanup, for the line said when a signal is held back.
        say: Where that line goes.
        received: A list to collect the held-back signal numbers in.
    """
    got: list[int] = received if received is not None else []
    if not _main_thread():
        yield got
        return

    def hold(signum: int, _frame: FrameType | None) -> None:
        got.append(signum)
        line = (f"{signal.Signals(signum).name} received while {what}: finishing that "
                "first, so that nothing is left half-done (SIGKILL would leave it to the "
                "next command)")
        if say is not None:
            say(line)
        else:
            print(line, file=sys.stderr, flush=True)

    previous = _swap_handlers(hold)
    try:
        yield got
    finally:
        _restore(previous)


def stop_signal(exc: BaseException) -> int | None:
    """The signal ``exc`` stands for, or None when it is not a stop request.

    :class:`StopRequested` carries its own; a plain ``KeyboardInterrupt`` is SIGINT;
    Prefect's ``TerminationSignal`` (its SIGTERM bridge, a cancel from the runner) carries
    ``signal``.
    """
    if isinstance(exc, StopRequested):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    if type(exc).__name__ == "TerminationSignal":
        value = getattr(exc, "signal", None)
        return int(value) if isinstance(value, int) else int(signal.SIGTERM)
    return None


def exit_code_for(signum: int) -> int:
    """The shell's code for a process stopped by ``signum``: 128 + the signal number."""
    return 128 + int(signum)
