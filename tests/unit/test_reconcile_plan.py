"""Reconcile's plan is pure: per replica ok / load / skip, from what it serves."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest

from modelship.errors import ReleaseIncomplete
from modelship.policy import TritonPolicy
from modelship.triton.model_config import (
    ModelSpec,
    TensorSpec,
    render_model_config,
    serving_digest,
    with_versions,
    without_dynamic_batching,
)
from modelship.triton.swap_plan import ReplicaView
from tasks.reconcile import Pin, plan_reconcile, reconcile, watch

SPEC = ModelSpec("fraud", inputs=(TensorSpec("input", "float32", (6,)),),
                 outputs=(TensorSpec("label", "int64", ()),))
PIN = Pin("fraud", 2, with_versions(render_model_config(SPEC, TritonPolicy(), versions=[2]),
                                    [2]))
DIGEST = serving_digest(PIN.config)
PAUSED = serving_digest(without_dynamic_batching(PIN.config))

CASES: list[tuple[Any, ...]] = [
    ("serves production", ReplicaView("r", True, (2,), DIGEST), "ok", "serves v2"),
    ("restarted empty", ReplicaView("r", True, (), None), "load", "serves nothing"),
    ("left on the old version", ReplicaView("r", True, (1,), DIGEST), "load", "serves v1"),
    ("serves both", ReplicaView("r", True, (1, 2), DIGEST), "load", "serves v1, v2"),
    ("stuck with batching paused", ReplicaView("r", True, (2,), PAUSED), "load",
     "another config"),
    ("unreachable", ReplicaView("r", False, (), None, "connection refused"), "skip",
     "connection refused"),
]


@pytest.mark.parametrize(("case", "view", "action", "reason"), CASES,
                         ids=[c[0] for c in CASES])
def test_each_replica_gets_what_it_needs(case: str, view: ReplicaView, action: str,
                                          reason: str) -> None:
    plan = plan_reconcile(PIN, [view])
    (step,) = plan.steps
    assert step.action == action, case
    assert reason in step.reason
    assert plan.to_load == (("r",) if action == "load" else ())
    assert plan.describe() == [f"fraud v2 on r: {action} ({step.reason})"]


def test_a_fleet_is_planned_replica_by_replica() -> None:
    plan = plan_reconcile(PIN, [ReplicaView("a", True, (2,), DIGEST),
                                ReplicaView("b", True, (), None),
                                ReplicaView("c", False, (), None)])
    assert [s.action for s in plan.steps] == ["ok", "load", "skip"]
    assert plan.to_load == ("b",)


def test_watch_reconciles_every_interval_and_stops_after_its_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks.reconcile as module

    calls: list[dict[str, Any]] = []
    pauses: list[float] = []

    def fake(replicas: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {"models": [], "changed": len(calls), "ok": True}

    monkeypatch.setattr(module, "reconcile", fake)
    reports = list(watch([], interval_s=3.0, rounds=3, sleep=pauses.append, model="fraud"))
    assert [r["changed"] for r in reports] == [1, 2, 3]
    assert pauses == [3.0, 3.0]
    assert all(c["model"] == "fraud" for c in calls)


class _NoPinStorage:
    """A repository where the model has no production pin yet."""

    bucket = "b"

    def head(self, key: str) -> None:
        return None


def test_reconcile_finishes_releases_first_and_reports_one_it_could_not() -> None:
    held: list[str] = []
    calls: list[str] = []

    def lock(model: str) -> Any:
        held.append(model)
        return nullcontext()

    def finished(model: str) -> dict[str, Any]:
        calls.append(model)
        assert held == [model]  # under the model's lock, before anything else
        return {"interrupted": ["R1"], "finished": [{"id": "R1", "goal": "undone"}]}

    def mlflow_down(model: str) -> dict[str, Any]:
        raise ReleaseIncomplete("release R2 of m is incomplete", hint="bring MLflow back")

    kwargs: dict[str, Any] = {"storage": _NoPinStorage(), "repository_prefix": "P",
                              "signing_key": b"k", "model": "m", "lock": lock}
    done = reconcile([], recover=finished, **kwargs)
    assert calls == ["m"] and done["ok"]
    assert done["models"][0]["recovered"]["finished"][0]["id"] == "R1"

    held.clear()
    stuck = reconcile([], recover=mlflow_down, **kwargs)
    model = stuck["models"][0]
    assert not stuck["ok"] and model["exit_code"] == 1
    assert "R2" in model["error"] and model["hint"] == "bring MLflow back"
    assert model["status"].startswith("no production recorded")  # still reconciled

    untouched = reconcile([], recover=mlflow_down, dry_run=True, **kwargs)
    assert untouched["ok"] and "recovered" not in untouched["models"][0]
