"""tests/e2e/crash_lanes.py: the fault matrix's lanes share the stack, and a cell that
kills a component has it alone."""

from __future__ import annotations

import threading
import time

import pytest

from tests.e2e.crash_lanes import Hold, Lanes, Turns


def _soon(check: object, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_shared_turns_overlap_and_an_alone_turn_waits_for_them() -> None:
    turns = Turns()
    a, b = Hold(turns, alone=False), Hold(turns, alone=False)
    assert turns.state() == (2, False, 0)
    alone = threading.Thread(target=lambda: Hold(turns, alone=True))
    alone.start()
    assert _soon(lambda: turns.state() == (2, False, 1))
    # a shared turn asked for now waits behind the one waiting to be alone
    late: list[Hold] = []
    sharer = threading.Thread(target=lambda: late.append(Hold(turns, alone=False)))
    sharer.start()
    time.sleep(0.1)
    assert not late and turns.state() == (2, False, 1)
    a.release()
    time.sleep(0.1)
    assert turns.state() == (1, False, 1)  # still one shared turn going on
    b.release()
    alone.join(5)
    assert turns.state() == (0, True, 0)
    assert not late
    turns.give(alone=True)
    sharer.join(5)
    assert late and turns.state() == (1, False, 0)


def test_two_lanes_turning_alone_at_once_take_turns() -> None:
    """Each gives its shared turn back before it waits to be alone: no deadlock."""
    turns = Turns()
    holds = [Hold(turns, alone=False) for _ in range(2)]
    alone_at: list[int] = []
    lock = threading.Lock()

    def go(hold: Hold, n: int) -> None:
        hold.go_alone()
        with lock:
            alone_at.append(n)
            assert turns.state()[:2] == (0, True)
        time.sleep(0.05)
        hold.release()

    threads = [threading.Thread(target=go, args=(h, n)) for n, h in enumerate(holds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sorted(alone_at) == [0, 1]
    assert turns.state() == (0, False, 0)


def test_an_alone_turn_turned_shared_again_lets_the_other_lanes_go_on() -> None:
    """A cell whose killed component is back shares the stack again; it waits, as any
    shared turn, behind a cell that waits to be alone."""
    turns = Turns()
    killer = Hold(turns, alone=False)
    killer.go_alone()
    assert turns.state() == (0, True, 0)
    others: list[Hold] = []
    sharer = threading.Thread(target=lambda: others.append(Hold(turns, alone=False)))
    sharer.start()
    time.sleep(0.1)
    assert not others  # the stack is the killer's alone
    killer.go_shared()
    sharer.join(5)
    assert others and turns.state() == (2, False, 0)
    # behind a cell waiting to be alone, a turn going shared waits too
    second = Hold(turns, alone=False)
    waiting = threading.Thread(target=second.go_alone)
    waiting.start()
    assert _soon(lambda: turns.state() == (2, False, 1))
    others[0].release()
    killer.release()
    waiting.join(5)
    assert turns.state() == (0, True, 0)
    back = threading.Thread(target=second.go_shared)
    back.start()
    back.join(5)
    assert turns.state() == (1, False, 0) and second.held and not second.alone
    second.release()
    assert turns.state() == (0, False, 0)


def test_giving_back_a_turn_not_held_is_an_error() -> None:
    with pytest.raises(AssertionError):
        Turns().give(alone=False)
    with pytest.raises(AssertionError):
        Turns().give(alone=True)


def test_lanes_run_side_by_side_in_order_and_hand_each_cell_its_outcome() -> None:
    """Lane x's second cell waits for lane y's first: one lane at a time would never
    get there; a cell that raised hands its error over and its lane goes on."""
    began: dict[str, threading.Event] = {c: threading.Event() for c in "abcd"}
    order: list[str] = []

    def run(lane: str, cell: str, lines: list[str]) -> None:
        began[cell].set()
        order.append(cell)
        lines.append(f"{lane}:{cell}")
        if cell == "b":
            assert began["c"].wait(5), "lane y did not run beside lane x"
        if cell == "c":
            raise ValueError("cell c failed")

    lanes = Lanes({"x": ["a", "b"], "y": ["c", "d"], "empty": []}, run)
    lanes.start()
    outcomes = {c: lanes.outcome(c, timeout_s=10) for c in "abcd"}
    lanes.stop(5)
    assert [outcomes[c].lines for c in "abcd"] == [["x:a"], ["x:b"], ["y:c"], ["y:d"]]
    assert isinstance(outcomes["c"].error, ValueError)
    assert [outcomes[c].error for c in "abd"] == [None, None, None]
    assert order.index("a") < order.index("b") and order.index("c") < order.index("d")


def test_a_stopped_matrix_begins_no_new_cell() -> None:
    release, running = threading.Event(), threading.Event()

    def run(lane: str, cell: str, lines: list[str]) -> None:
        running.set()
        release.wait(5)

    lanes = Lanes({"x": ["a", "b"]}, run)
    lanes.start()
    assert running.wait(5)
    stopper = threading.Thread(target=lanes.stop, args=(5,))
    stopper.start()
    time.sleep(0.05)
    release.set()
    stopper.join(5)
    assert lanes.outcome("a", 1).error is None
    assert isinstance(lanes.outcome("b", 1).error, RuntimeError)
