"""A swap phase's deadline times the replicas, not this process's imports.

On a loaded 2-core machine the first probe's ``import tritonclient.http`` (gevent with it)
took seconds; it used to run inside each phase's deadline. The local work (that import,
each replica's gRPC client) is now done before the clock starts.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import tasks.swap as swapping
from modelship.policy import SwapPolicy
from modelship.triton.swap_plan import Phase

IMPORT_S = 0.3  # what the local work costs here (seconds on a loaded machine)
DEADLINE_S = 5.0


class SlowToBuild:
    """A replica whose client costs IMPORT_S to build (no I/O)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.warmed_at: float | None = None

    def warm(self) -> None:
        time.sleep(IMPORT_S)
        self.warmed_at = time.monotonic()


def _phase_clock(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, float], list[float]]:
    """Record each replica's phase deadline and when the HTTP import ended."""
    deadlines: dict[str, float] = {}
    imported: list[float] = []

    def slow_import() -> None:
        time.sleep(IMPORT_S)
        imported.append(time.monotonic())

    def phase_on(server: Any, phase: Phase, *, deadline: float, **_: Any) -> Any:
        deadlines[server.name] = deadline
        return swapping._Outcome(True, None, 0.0, 0.0)

    monkeypatch.setattr(swapping, "warm_http", slow_import)
    monkeypatch.setattr(swapping, "_run_phase_on", phase_on)
    return deadlines, imported


def test_a_phase_deadline_starts_after_the_imports_and_the_clients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    deadlines, imported = _phase_clock(monkeypatch)
    servers = {name: SlowToBuild(name) for name in ("r0", "r1")}
    outcomes = swapping._run_phase(
        servers, list(servers), Phase("switch", None, 2, probe=True), model="fraud",
        swap_start=time.monotonic(), policy=SwapPolicy(deadline_s=DEADLINE_S,
                                                       probe_timeout_s=1.0),
        probe=swapping._Probe({}, [], 1.0))
    assert all(o.ok for o in outcomes.values()), outcomes
    assert imported, "the HTTP client was not imported before the phase"
    warmed = [s.warmed_at for s in servers.values()]
    assert None not in warmed, "a replica's client was not built before the phase"
    local_done = max([*imported, *(w for w in warmed if w is not None)])
    # every replica gets the whole deadline after the local work
    assert sorted(deadlines) == ["r0", "r1"]
    assert all(d >= local_done + DEADLINE_S for d in deadlines.values()), (deadlines,
                                                                            local_done)


def test_reconcile_probe_deadline_starts_after_the_imports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    deadlines, imported = _phase_clock(monkeypatch)
    server = SlowToBuild("r0")
    ok, why, _ = swapping.apply_config(server, model="fraud", config=None,
                                       version=2, golden=None,
                                       timeout_s=DEADLINE_S, probe_timeout_s=1.0)
    assert ok, why
    assert imported and server.warmed_at is not None
    assert deadlines["r0"] >= max(imported[-1], server.warmed_at) + DEADLINE_S
