"""The order at the end of a progressive canary that passed (issue 20, docs/gateway.md
"Why the weight returns to 0 before the swap"): the record says production, the router is
read back at production and the candidate is unloaded from the canary Triton, all before
the canary stage returns to promote, which only then starts the atomic swap. Pinned so
that a change of order is a decision, not an accident."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from modelship.ledger import ReleaseRecord
from modelship.policy import CanaryPolicy, Policy
from modelship.slack.notifier import NullNotifier
from modelship.split_scope import SplitScope
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit
from tasks import live_traffic, progressive
from tasks.record import ReleaseJournal
from tests.fake_router import FakeRouter
from tests.unit.test_progressive_stage import MODEL, _Clients, _Counters, _Release


class _Timeline(FakeRouter):
    def __init__(self, timeline: list[str]) -> None:
        super().__init__()
        self.timeline = timeline

    def set_weights(self, canary_pct: float) -> None:
        super().set_weights(canary_pct)
        self.timeline.append(f"weight {canary_pct:g}")

    def live(self) -> TrafficSplit:
        split = super().live()
        self.timeline.append(f"read {split.canary_pct:g}")
        return split


def test_the_weight_is_back_at_production_and_the_candidate_unloaded_before_the_swap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    timeline: list[str] = []
    router = _Timeline(timeline)

    @contextmanager
    def loaded(*args: Any, **kwargs: Any) -> Iterator[None]:
        timeline.append("candidate loaded on the canary")
        yield
        timeline.append("candidate unloaded")

    monkeypatch.setattr(live_traffic, "configured_router",
                        lambda settings, progress, scope=None: router)
    monkeypatch.setattr(live_traffic, "split_scope",
                        lambda clients, model, progress: SplitScope(model))
    monkeypatch.setattr(progressive, "serving_on_canary", loaded)
    monkeypatch.setattr(progressive, "scrape_servers",
                        _Counters(c_us=1000.0, p_us=1500.0, per_look=2000).scrape)
    monkeypatch.setattr(progressive, "LOOK_S", 0.0)
    policy = Policy(canary=CanaryPolicy(traffic="progressive", steps=[5, 50],
                                        step_min_s=0.0001, step_max_s=60.0))
    record = ReleaseRecord.start("promote", MODEL, to_version=2, from_version=1)
    journal = ReleaseJournal(record, None, NullNotifier())
    save = journal.save

    def saved() -> None:
        if record.traffic.get("split"):
            timeline.append(f"record {record.traffic['split']['canary_pct']:g}")
        save()

    monkeypatch.setattr(journal, "save", saved)
    settings: Any = type("S", (), {"http_timeout_s": 1.0})()
    result = progressive.live_canary(settings, _Clients(), policy, journal,  # type: ignore[arg-type]
                                     serving=1, release=_Release())  # type: ignore[arg-type]
    timeline.append("swap may start")  # promote's next stage
    assert result.action.kind == "swap" and router.split == PRODUCTION_ONLY
    last_50 = max(i for i, t in enumerate(timeline) if t == "weight 50")
    tail = [t for t in timeline[last_50 + 1:] if not t.startswith("read 50")]
    # the swap event is written with weight 0 first, the router set to 0 and read back
    # at 0, the candidate unloaded, and only then may the swap start
    assert tail.index("record 0") < tail.index("weight 0") < tail.index("read 0") \
        < tail.index("candidate unloaded") < tail.index("swap may start"), timeline
    assert record.traffic["events"][-1]["action"] == "swap"
    assert record.traffic["events"][-1]["weight_pct"] == 0.0
