"""A release's split covers its own model's requests (tasks/live_traffic.split_scope):
gRPC ones too only when the fleet serves no other model, since gRPC names the model in the
request body, which the gateway does not read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from modelship.errors import Unreachable
from tasks.live_traffic import split_scope


class Replica:
    def __init__(self, name: str, models: list[tuple[str, str]] | None) -> None:
        self.name, self.models = name, models

    def repository_index(self) -> list[dict[str, Any]]:
        if self.models is None:
            raise Unreachable(f"Triton {self.name} did not answer")
        return [{"name": n, "state": s} for n, s in self.models]


@pytest.mark.parametrize(("replicas", "grpc", "said"), [
    ([[("fraud", "READY")], [("fraud", "READY")]], True, None),
    ([[("fraud", "READY"), ("churn", "UNAVAILABLE")]], True, None),  # unloaded: no traffic
    ([[("fraud", "READY")], [("fraud", "READY"), ("churn", "READY")]], False, "churn"),
    ([[("fraud", "READY")], None], False, "did not answer"),  # unknown: assume others
    ([[]], True, None),  # a first release: nothing served yet
])
def test_grpc_is_split_only_when_the_fleet_serves_this_model_alone(
        replicas: list[list[tuple[str, str]] | None], grpc: bool, said: str | None) -> None:
    clients: Any = SimpleNamespace(replicas=[Replica(f"triton-{i}", m)
                                             for i, m in enumerate(replicas)])
    notes: list[str] = []
    scope = split_scope(clients, "fraud", notes.append)
    assert scope.model == "fraud" and scope.grpc is grpc
    if said is None:
        assert notes == []
    else:
        assert len(notes) == 1 and said in notes[0] and "gRPC requests stay on production" \
            in notes[0]
