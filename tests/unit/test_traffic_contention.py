"""Two live releases at once (issue 20, adversarial): the router holds one split for the
whole gateway, so only the holder of the canary slot may write it. A release of another
model that finds the slot busy is refused (``ReleaseLocked``, exit 1) before any write
of the router or of its record's split, in each mode that sets the router: the shadow,
the progressive canary and the holdback bake. (Two releases of the same model never get
this far: the model's release lock refuses the second one first, tests/e2e/test_shadow.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from modelship.errors import ReleaseLocked
from modelship.ledger import ReleaseRecord
from modelship.policy import BakePolicy, CanaryPolicy, Policy
from modelship.slack.notifier import NullNotifier
from modelship.split_scope import SplitScope
from tasks import canary_slot as slot_module
from tasks import holdback, live_traffic, progressive, shadow
from tasks.record import ReleaseJournal
from tests.fake_router import FakeRouter
from tests.unit.test_progressive_stage import _Clients, _Release


@contextmanager
def _busy(*args: Any, **kwargs: Any) -> Iterator[None]:
    raise ReleaseLocked("the canary Triton stayed busy for 900 s: its slot is held by "
                        "the progressive canary of model a v7", hint="try again",
                        model=kwargs.get("model"))
    yield  # pragma: no cover - never reached


class _Storage:  # a shared slot exists (S3 configured); the lock itself is replaced
    pass


def test_a_shadow_of_another_model_never_touches_the_router_while_the_slot_is_busy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slot_module, "canary_slot", _busy)
    router, written = FakeRouter(), list[dict[str, Any]]()
    clients: Any = type("C", (), {"storage": _Storage(), "replicas": [], "canary": None})()
    policy = Policy(canary=CanaryPolicy(traffic="shadow", mirror_pct=20.0))
    with pytest.raises(ReleaseLocked) as err:
        shadow.run_shadow(None, clients, policy, model="b", candidate=2,  # type: ignore[arg-type]
                          baseline=1, router=router, write=written.append)
    assert err.value.exit_code == 1 and "slot is held by" in err.value.message
    assert router.calls == [] and written == []


def test_a_progressive_canary_of_another_model_never_writes_a_split(
        monkeypatch: pytest.MonkeyPatch) -> None:
    router = FakeRouter()
    monkeypatch.setattr(live_traffic, "configured_router",
                        lambda settings, progress, scope=None: router)
    monkeypatch.setattr(live_traffic, "split_scope",
                        lambda clients, model, progress: SplitScope(model))
    monkeypatch.setattr(progressive, "canary_slot", _busy)
    record = ReleaseRecord.start("promote", "b", to_version=2, from_version=1)
    journal = ReleaseJournal(record, None, NullNotifier())
    clients = _Clients()
    clients.storage = _Storage()  # type: ignore[assignment]
    policy = Policy(canary=CanaryPolicy(traffic="progressive", steps=[5, 50]))
    with pytest.raises(ReleaseLocked):
        progressive.live_canary(None, clients, policy, journal,  # type: ignore[arg-type]
                                serving=1, release=_Release())  # type: ignore[arg-type]
    assert router.writes == [] and not record.traffic.get("split")


def test_a_holdback_of_another_model_never_writes_a_split(
        monkeypatch: pytest.MonkeyPatch) -> None:
    router = FakeRouter()
    monkeypatch.setattr(holdback, "canary_and_router", lambda *a, **k: (None, router))
    monkeypatch.setattr(holdback, "canary_slot", _busy)
    written: list[dict[str, Any]] = []
    policy = Policy(bake=BakePolicy(duration_s=10.0, holdback_pct=5.0))
    clients: Any = type("C", (), {"storage": _Storage(), "replicas": []})()
    with pytest.raises(ReleaseLocked):
        holdback.holdback_watch(None, clients, policy, model="b", version=2,  # type: ignore[arg-type]
                                previous=1, payload={}, write=written.append)
    assert router.calls == [] and written == []
