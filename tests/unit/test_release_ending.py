"""tasks.fleet.ending: the one way out of a fleet change (promote, standalone swap and
rollback), around their stages: every exit goes through end_release exactly as each
caller's own try/except did, and a body that ended its record itself is left alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from modelship.errors import ReleaseCancelled
from tasks import fleet


class _Journal:
    def __init__(self, status: str = "running") -> None:
        self.record = SimpleNamespace(status=status)

    def write_ending(self, record: Any) -> None:
        raise AssertionError("end_release is faked here")


def _ending(monkeypatch: pytest.MonkeyPatch, journal: _Journal, *,
            raises: BaseException | None = None) -> tuple[Any, list[Any]]:
    calls: list[Any] = []

    def end_release(settings: Any, clients: Any, policy: Any, record: Any,
                    exc: BaseException | None, **_: Any) -> None:
        calls.append(("end", exc))
        if raises is not None and exc is not None:
            raise raises from exc

    monkeypatch.setattr(fleet, "end_release", end_release)
    manager = fleet.ending(None, None, None, journal,  # type: ignore[arg-type]
                           on_stop=lambda exc: calls.append(("stop", exc)))
    return manager, calls


def test_a_normal_exit_ends_the_release_once(monkeypatch: pytest.MonkeyPatch) -> None:
    manager, calls = _ending(monkeypatch, _Journal())
    with manager:
        pass
    assert calls == [("end", None)]


def test_an_error_ends_the_release_with_it_then_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """end_release returns (the release finished forward): the error still goes on."""
    manager, calls = _ending(monkeypatch, _Journal())
    error = RuntimeError("the bake could not watch")
    with pytest.raises(RuntimeError) as raised, manager:
        raise error
    assert raised.value is error
    assert calls == [("stop", error), ("end", error)]


def test_what_end_release_raises_replaces_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cancelled = ReleaseCancelled("swap of m cancelled", signum=15)
    manager, calls = _ending(monkeypatch, _Journal(), raises=cancelled)
    stop = KeyboardInterrupt()
    with pytest.raises(ReleaseCancelled) as raised, manager:
        raise stop
    assert raised.value is cancelled and raised.value.__cause__ is stop
    assert calls == [("stop", stop), ("end", stop)]


@pytest.mark.parametrize("status", ["noop", "released", "rolled_back"])
def test_a_body_that_ended_its_record_is_left_as_it_ended(
        monkeypatch: pytest.MonkeyPatch, status: str) -> None:
    journal = _Journal()
    manager, calls = _ending(monkeypatch, journal)
    with manager:
        journal.record.status = status  # e.g. a no-op swap's journal.finish("noop")
    error = ValueError("after the end")
    manager, calls_after = _ending(monkeypatch, journal)
    with pytest.raises(ValueError), manager:
        raise error
    assert calls == [] and calls_after == []
