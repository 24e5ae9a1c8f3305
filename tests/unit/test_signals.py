"""SIGINT and SIGTERM are a request to stop cleanly; a second one cannot cut a cleanup
short. Real signals, sent to this process (pytest runs tests in the main thread)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from modelship.signals import (
    StopRequested,
    deferred,
    exit_code_for,
    stop_on_signals,
    stop_signal,
)


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_becomes_a_stop_request_with_the_shells_exit_code(signum: int,
                                                                   code: int) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StopRequested) as stopped, stop_on_signals():
        _send(signum)
        threading.Event().wait(2)  # the handler raises here, long before the timeout
    assert stopped.value.signum == signum and stopped.value.exit_code == code
    assert isinstance(stopped.value, KeyboardInterrupt)  # `except KeyboardInterrupt` sees it
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_a_second_signal_during_the_cleanup_does_not_skip_it() -> None:
    steps: list[str] = []
    said: list[str] = []
    with pytest.raises(StopRequested), stop_on_signals():
        try:
            _send(signal.SIGTERM)
            threading.Event().wait(2)
        except StopRequested:
            with deferred("the swap aborts", say=said.append) as held:
                steps.append("abort sent")
                _send(signal.SIGINT)      # the impatient second Ctrl-C
                _send(signal.SIGTERM)
                steps.append("every replica back on P")
                steps.append("record written")
            assert held == [signal.SIGINT, signal.SIGTERM]
            raise
    assert steps == ["abort sent", "every replica back on P", "record written"]
    assert len(said) == 2 and "SIGINT received while the swap aborts" in said[0]


def test_after_a_deferred_block_signals_stop_again() -> None:
    with stop_on_signals():
        with deferred("a cleanup", say=lambda _: None) as held:
            _send(signal.SIGTERM)
        assert held == [signal.SIGTERM]
        with pytest.raises(StopRequested):
            _send(signal.SIGTERM)
            threading.Event().wait(2)


def test_outside_the_main_thread_the_helpers_do_nothing() -> None:
    seen: list[object] = []

    def body() -> None:
        with stop_on_signals(), deferred("x") as held:
            seen.append(held)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == [[]]


class TerminationSignal(BaseException):  # the shape of prefect.exceptions.TerminationSignal
    def __init__(self, signal: int) -> None:
        self.signal = signal


@pytest.mark.parametrize(("exc", "expected"), [
    (StopRequested(signal.SIGTERM), signal.SIGTERM),
    (StopRequested(signal.SIGINT), signal.SIGINT),
    (KeyboardInterrupt(), signal.SIGINT),
    (TerminationSignal(signal.SIGTERM), signal.SIGTERM),
    (ValueError("a bug"), None),
    (SystemExit(1), None),
])
def test_stop_signal_names_the_signal_an_exception_stands_for(exc: BaseException,
                                                              expected: int | None) -> None:
    assert stop_signal(exc) == expected


def test_exit_codes() -> None:
    assert (exit_code_for(signal.SIGINT), exit_code_for(signal.SIGTERM)) == (130, 143)
