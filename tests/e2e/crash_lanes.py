"""Lanes for the fault matrix (tests/e2e/test_crash.py): cells of several models side by
side on one stack.

A cell's time is mostly waiting: Triton loading and unloading, the canary's and the bake's
windows, a dependency's bounded timeouts, a swap deadline. So the matrix runs its cells in
lanes, one model per lane, the lanes side by side on the worker's session stack and each
lane's cells in order (each starts from what the one before it left). Cells of different
models touch different objects (the model on the replicas, its pin, aliases, ledger,
release lock and leftovers on the canary; the canary slot is taken in turn, a dead holder's
taken over at once), so a cell of one lane cannot change what a cell of another asserts.

A cell that kills a component (MLflow, S3, Prefect, the gateway) would, so it takes the
stack alone (:class:`Turns`): from its fault point (the faulted run waits there,
:func:`tests.faults.wait_at_gate`, until the other lanes' cells have ended), or from the
start of its stage where a wait at the point would change the fault (S3 down mid-swap: the
swap's deadline runs; the gateway during a progressive step: the canary slot is held),
until the component is back (``modelship stack up``); then its turn is shared again
(:meth:`Hold.go_shared`): what is left of the cell (the faulted run's record, ``status``,
the next command) touches its own model only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Turns:
    """Cells that share the stack, and cells that take it alone: a readers-writer lock that
    prefers the one alone (no shared turn begins while one waits to be alone)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._alone = False
        self._waiting = 0

    def take(self, *, alone: bool) -> None:
        with self._cond:
            if alone:
                self._waiting += 1
                try:
                    self._cond.wait_for(lambda: not self._alone and self._shared == 0)
                finally:
                    self._waiting -= 1
                self._alone = True
            else:
                self._cond.wait_for(lambda: not self._alone and self._waiting == 0)
                self._shared += 1

    def give(self, *, alone: bool) -> None:
        with self._cond:
            if alone:
                assert self._alone, "given back alone, but not held alone"
                self._alone = False
            else:
                assert self._shared > 0, "given back shared, but not held shared"
                self._shared -= 1
            self._cond.notify_all()

    def state(self) -> tuple[int, bool, int]:
        """(shared turns held, held alone, waiting to be alone)."""
        with self._cond:
            return self._shared, self._alone, self._waiting


class Hold:
    """One cell's turn: shared or alone from the start; :meth:`go_alone` turns a shared
    turn alone (given back first, so two lanes turning alone at once cannot deadlock)."""

    def __init__(self, turns: Turns, *, alone: bool) -> None:
        self.turns, self.alone = turns, alone
        turns.take(alone=alone)
        self.held = True

    def go_alone(self) -> None:
        if not self.alone:
            self.turns.give(alone=False)
            self.held = False
            self.turns.take(alone=True)
            self.alone = self.held = True

    def go_shared(self) -> None:
        """Turn an alone turn shared again (the killed component is back: what the cell
        does next touches its own model only). Waits, as any shared turn, while another
        cell waits to be alone."""
        if self.alone:
            self.turns.give(alone=True)
            self.held = False
            self.turns.take(alone=False)
            self.alone, self.held = False, True

    def release(self) -> None:
        if self.held:
            self.turns.give(alone=self.alone)
            self.held = False


@dataclass
class Outcome:
    """What one cell's run printed (its timings) and the exception it ended with."""

    lines: list[str] = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Lanes(Generic[K]):
    """Run each lane's cells in order, in a thread per lane, all lanes at once;
    :meth:`outcome` waits for one cell's. ``run(lane, cell, lines)`` runs one cell (and
    appends what it prints to ``lines``); a cell that raised does not stop its lane (the
    next cell starts from whatever it left, and heals it if it must)."""

    def __init__(self, lanes: Mapping[str, Sequence[K]],
                 run: Callable[[str, K, list[str]], None]) -> None:
        self.lanes = {name: list(cells) for name, cells in lanes.items() if cells}
        self.outcomes: dict[K, Outcome] = {c: Outcome() for cells in self.lanes.values()
                                           for c in cells}
        self._run = run
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._lane, args=(name,), daemon=True,
                                          name=f"lane-{name}") for name in self.lanes]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _lane(self, name: str) -> None:
        for cell in self.lanes[name]:
            outcome = self.outcomes[cell]
            try:
                if self._stop.is_set():
                    raise RuntimeError("the matrix stopped before this cell")
                self._run(name, cell, outcome.lines)
            except BaseException as exc:  # noqa: BLE001 - handed to the cell's test
                outcome.error = exc
            finally:
                outcome.done.set()

    def outcome(self, cell: K, timeout_s: float | None = None) -> Outcome:
        outcome = self.outcomes[cell]
        if not outcome.done.wait(timeout_s):
            raise TimeoutError(f"cell {cell} did not end within {timeout_s} s")
        return outcome

    def stop(self, timeout_s: float | None = None) -> None:
        """No new cell begins; wait for the running ones to end."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
