"""The fault matrix's judge (tests/faults.py): it must be able to fail.

``disagreements``, ``story_breaks`` and ``loose_ends`` decide whether a release converged
from what was observed, independently of ``modelship status``; each rule is shown to fire
on the state it names and to stay quiet on a converged one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.faults import (
    Fault,
    Observation,
    RecordState,
    ReplicaState,
    disagreements,
    loose_ends,
    story_breaks,
)


def rec(id_: str, status: str, from_v: int | None, to_v: int | None, *,
        kind: str = "promote", alive: bool | None = False, pending: int = 0) -> RecordState:
    return RecordState(id_, kind, status, from_v, to_v, 0, pid_alive=alive,
                       pending_approvals=pending)


HISTORY = (rec("r1", "released", None, 1), rec("r2", "released", 1, 2))


def obs(**changes: Any) -> Observation:
    base = Observation(
        model="m", replicas=(ReplicaState("triton-0", (2,), True),
                             ReplicaState("triton-1", (2,), True)),
        pin_version=2, pin_batching=True, aliases={"production": 2, "previous": 1},
        tag_release_id="r2", records=HISTORY, locks=(), canary_leftovers=())
    return replace(base, **changes)


def test_a_converged_state_has_nothing_to_say() -> None:
    assert disagreements(obs()) == []
    assert loose_ends(obs()) == []
    assert story_breaks(HISTORY, 2, start=None) == []


@pytest.mark.parametrize(("changes", "words"), [
    ({"replicas": (ReplicaState("triton-0", (2,), True), ReplicaState("triton-1", (1,), True))},
     "do not serve one version"),
    ({"replicas": (ReplicaState("triton-0", (2,), True), ReplicaState("triton-1", (1, 2), True))},
     "do not serve one version"),
    ({"replicas": (ReplicaState("triton-0", (2,), True), ReplicaState("triton-1", error="down"))},
     "do not serve one version"),
    ({"replicas": (ReplicaState("triton-0", (2,), False), ReplicaState("triton-1", (2,), True))},
     "dynamic batching on triton-0"),
    ({"pin_version": 1}, "pin says v1"),
    ({"aliases": {"production": 1}}, "production alias says v1"),
    ({"records": (*HISTORY, rec("r3", "running", 2, 1))}, "r3 is running (its process is gone)"),
    ({"records": (*HISTORY, rec("r3", "incomplete", 2, 1))}, "r3 is incomplete"),
    ({"records": (*HISTORY, rec("r3", "released", 2, 1))}, "says v1 serves"),
    ({"records": (*HISTORY, rec("r3", "cancelled", 1, 2))}, "says v1 serves"),
    ({"locks": ({"model": "m", "held": True, "holder": None},)}, "lock is held"),
    ({"locks": ({"model": "m", "held": True, "holder_alive": True},)}, "lock is held"),
    ({"locks": ({"model": "m", "held": True, "holder_alive": False, "unreadable": True},)},
     "lock is held"),
])
def test_each_disagreement_is_found(changes: dict[str, Any], words: str) -> None:
    found = disagreements(obs(**changes))
    assert any(words in line for line in found), found


def test_a_lock_whose_holder_is_verified_dead_wedges_nothing() -> None:
    # the next release or canary takes it over at once (a killed canary's slot)
    dead = {"model": "m", "lock": "canary", "held": True, "holder_alive": False,
            "unreadable": False}
    assert disagreements(obs(locks=(dead,))) == []


def test_a_record_that_stopped_before_the_fleet_or_undid_it_agrees() -> None:
    for status in ("cancelled", "interrupted", "rolled_back", "failed", "rejected"):
        assert disagreements(obs(records=(*HISTORY, rec("r3", status, 2, 1)))) == [], status
    assert disagreements(obs(records=(*HISTORY, rec("r3", "noop", 2, 2)))) == []
    # a canary record does not change the fleet
    assert disagreements(obs(records=(*HISTORY, rec("c", "passed", 2, 1, kind="canary")))) == []


@pytest.mark.parametrize(("records", "serving", "words"), [
    ((rec("a", "cancelled", 2, 1), rec("b", "released", 1, 2)), 2, "started from v1"),
    ((rec("a", "released", 2, 1), rec("b", "released", 2, 1)), 1, "started from v2"),
    ((rec("a", "interrupted", 2, 1),), 1, "last word is v2"),
    ((rec("a", "running", 2, 1), rec("b", "released", 2, 1)), 1, "a is still running"),
])
def test_a_broken_story_is_found(records: tuple[RecordState, ...], serving: int,
                                 words: str) -> None:
    found = story_breaks(records, serving, start=2)
    assert any(words in line for line in found), found


def test_a_continuous_story_is_whole() -> None:
    story = (rec("a", "cancelled", 2, 1), rec("b", "interrupted", 2, 1),
             rec("c", "released", 2, 1, kind="rollback"), rec("d", "noop", 1, 1))
    assert story_breaks(story, 1, start=2) == []


def test_loose_ends_are_the_tag_and_the_canary() -> None:
    assert any("tag" in line for line in loose_ends(obs(tag_release_id="r1")))
    assert any("tag" in line for line in loose_ends(obs(tag_release_id=None)))
    assert any("canary" in line for line in loose_ends(obs(canary_leftovers=("m",))))


def test_a_fault_names_its_cell_and_refuses_what_it_cannot_inject() -> None:
    assert Fault("sigterm", "bake").id == "sigterm-bake"
    assert Fault("s3", "swap").component == "seaweedfs"
    assert Fault("sigint", "swap").component is None
    with pytest.raises(AssertionError):
        Fault("sighup", "bake")
    with pytest.raises(AssertionError):
        Fault("sigkill", "lunch")
