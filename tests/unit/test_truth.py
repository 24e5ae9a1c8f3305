"""``modelship status`` is a pure comparison: every disagreement kind, and its repair."""

from __future__ import annotations

from dataclasses import replace

import pytest

from modelship.ledger import ReleaseRecord, StageEntry
from tasks.truth import (
    Expected,
    LockSeen,
    Observation,
    PinSeen,
    RecordSeen,
    ReplicaSeen,
    expected_version,
    liveness,
    record_seen,
    truth,
)

HERE = "host-a"
SERVING = "digest-batching-on"
PAUSED = "digest-batching-off"
PIN4 = PinSeen(4, SERVING, True)
PROMOTE_STAGES = ("resolve", "check", "stage", "canary", "gates", "approve", "baseline",
                  "swap", "bake", "record")


def replica(name: str, *versions: int, digest: str = SERVING,
            batching: bool = True) -> ReplicaSeen:
    return ReplicaSeen(name, True, tuple(versions), digest if versions else None,
                       batching if versions else None)


def on(*versions: int, digest: str = SERVING, batching: bool = True
       ) -> tuple[ReplicaSeen, ...]:
    """Two replicas serving ``versions``."""
    return tuple(replica(f"triton-{i}", *versions, digest=digest, batching=batching)
                 for i in range(2))


def record(rid: str, status: str, from_version: int | None, to_version: int | None, *,
           kind: str = "promote", stages: tuple[str, ...] = PROMOTE_STAGES,
           host: str = HERE, pid_running: bool | None = None,
           reason: str | None = None) -> RecordSeen:
    return RecordSeen(rid, kind, status, from_version, to_version, stages, host, 4242,
                      pid_running, reason)


RELEASED4 = record("20260101T000002Z-b", "released", 3, 4)
GOOD = Observation("m", HERE, on(4), pin=PIN4, alias=4, records=(RELEASED4,))


def mlflow_down(obs: Observation) -> Observation:
    return replace(obs, unread=frozenset({"mlflow"}))


CASES: list[tuple[str, Observation, list[str], str | None]] = [
    ("everything says v4", GOOD, [], None),
    ("never released: nothing anywhere", Observation("m", HERE, on()), [], None),
    ("a first release withdrawn by its bake",
     Observation("m", HERE, on(), records=(record("r1", "rolled_back", None, 4),)), [], None),
    ("every replica on v4 with dynamic batching off (a swap stopped while paused)",
     replace(GOOD, replicas=on(4, digest=PAUSED, batching=False)), ["config_drift"],
     "modelship reconcile m"),
    ("one replica with another config", replace(GOOD, replicas=(
        replica("triton-0", 4), replica("triton-1", 4, digest="other"))),
     ["config_drift"], "modelship reconcile m"),
    ("SIGINT during the swap: the run is dead and batching is off",
     replace(GOOD, replicas=on(4, digest=PAUSED, batching=False), records=(
         record("r9", "running", 4, 5, stages=PROMOTE_STAGES[:8], pid_running=False),
         RELEASED4)), ["dead_release", "config_drift"], "modelship reconcile m"),
    ("SIGTERM during the bake: fleet and pin on v5, alias on v4, record running",
     replace(GOOD, replicas=on(5), pin=PinSeen(5, SERVING, True), records=(
         record("r9", "running", 4, 5, stages=PROMOTE_STAGES[:9], pid_running=False),
         RELEASED4)), ["dead_release", "alias"], "release r9"),
    ("the alias moved away from what serves", replace(GOOD, alias=3), ["alias"],
     "modelship swap m --to 4"),
    ("no production alias", replace(GOOD, alias=None), ["alias"], "modelship swap m --to 4"),
    ("MLflow down at the record stage (before incomplete existed): the record failed, "
     "the fleet and the pin moved",
     replace(GOOD, replicas=on(5), pin=PinSeen(5, SERVING, True), records=(
         record("r9", "failed", 4, 5), RELEASED4)), ["fleet_version", "pin_version"],
     "modelship swap m --to 4"),
    ("an incomplete release: fleet and pin on v5, the alias still v4",
     replace(GOOD, replicas=on(5), pin=PinSeen(5, SERVING, True), records=(
         record("r9", "incomplete", 4, 5, reason="missing: alias production -> v5"),
         RELEASED4)), ["incomplete_release", "alias"], "finishes or undoes release r9"),
    ("a mixed fleet", replace(GOOD, replicas=(replica("triton-0", 4), replica("triton-1", 3))),
     ["fleet_mixed"], "modelship reconcile m"),
    ("a replica serving two versions", replace(GOOD, replicas=(
        replica("triton-0", 4), replica("triton-1", 4, 5))), ["fleet_mixed"],
     "modelship reconcile m"),
    ("a replica restarted empty", replace(GOOD, replicas=(replica("triton-0", 4),
                                                          replica("triton-1"))),
     ["fleet_mixed"], "modelship reconcile m"),
    ("a replica down", replace(GOOD, replicas=(
        replica("triton-0", 4), ReplicaSeen("triton-1", False, problem="refused"))),
     ["replica_unreachable"], "restart triton-1"),
    ("no replicas configured", replace(GOOD, replicas=()), ["no_replicas"],
     "modelship stack up"),
    ("the whole fleet on another version than ledger and pin",
     replace(GOOD, replicas=on(3), alias=4), ["fleet_version"], "modelship reconcile m"),
    ("no pin: reconcile could not restore production", replace(GOOD, pin=None),
     ["pin_version"], "modelship swap m --to 4"),
    ("the pin names another version", replace(GOOD, pin=PinSeen(3, SERVING, True)),
     ["pin_version"], "modelship swap m --to 4"),
    ("the pin does not verify", replace(GOOD, pin=None, pin_problem="not signed with our key"),
     ["pin_invalid"], "modelship swap m --to 4"),
    ("a lock whose holder is gone is taken over by the next release: a note",
     replace(GOOD, lock=LockSeen(True, "r7", "canary", False, "canary r7 (pid 1 on host-b)")),
     [], None),
    ("a lost concurrent promotion is newer but never touched the fleet",
     replace(GOOD, records=(record("r9", "failed", 3, 5, stages=("resolve", "check")),
                            RELEASED4)), [], None),
    ("a rejected release changed nothing",
     replace(GOOD, records=(record("r9", "rejected", 4, 5, stages=PROMOTE_STAGES[:5]),
                            RELEASED4)), [], None),
    ("a cancelled release undid its swap",
     replace(GOOD, records=(record("r9", "cancelled", 4, 5, stages=PROMOTE_STAGES[:8]),
                            RELEASED4)), [], None),
    ("a dead run that never reached the fleet",
     replace(GOOD, records=(record("r9", "running", 4, 5, stages=("resolve", "check"),
                                   pid_running=False), RELEASED4)), ["dead_release"],
     "release r9"),
    ("a release died on another host after taking the lock",
     replace(GOOD, records=(record("r9", "running", 4, 5, stages=PROMOTE_STAGES[:5],
                                   host="host-b"), RELEASED4)), ["dead_release"],
     "modelship reconcile m"),
    ("MLflow down: the alias is not compared", mlflow_down(replace(GOOD, alias=None)), [],
     None),
    ("MLflow down does not hide a fleet problem", mlflow_down(replace(GOOD, replicas=(
        replica("triton-0", 4), replica("triton-1", 3)))), ["fleet_mixed"],
     "modelship reconcile m"),
    ("S3 down: the alias against the fleet", replace(GOOD, alias=3, unread=frozenset({"s3"})),
     ["alias"], "once S3 answers"),
    ("S3 down: two configs for one version", replace(GOOD, unread=frozenset({"s3"}), replicas=(
        replica("triton-0", 4), replica("triton-1", 4, digest=PAUSED, batching=False))),
     ["config_drift"], "once S3 answers"),
    ("S3 down: a running release on another host cannot be judged dead",
     replace(GOOD, unread=frozenset({"s3"}), records=(
         record("r9", "running", 4, 5, stages=PROMOTE_STAGES[:5], host="host-b"), RELEASED4)),
     [], None),
    ("Prefect down: nothing status compares depends on it",
     replace(GOOD, unread=frozenset({"prefect"})), [], None),
    ("no ledger record: the pin decides", replace(GOOD, records=(), alias=3), ["alias"],
     "modelship swap m --to 4"),
    ("no record and no pin: the fleet and the alias disagree",
     replace(GOOD, records=(), pin=None, alias=3), ["alias"], "modelship swap m --to V"),
]


@pytest.mark.parametrize(("case", "obs", "kinds", "repair"), CASES, ids=[c[0] for c in CASES])
def test_each_disagreement_is_named_with_its_repair(case: str, obs: Observation,
                                                    kinds: list[str], repair: str | None
                                                    ) -> None:
    found = truth(obs)
    assert [d.kind for d in found.disagreements] == kinds, found.disagreements
    assert found.consistent is (not kinds)
    if repair is None:
        assert found.next is None
    else:
        assert found.next is not None and repair in found.next, found.next
    for disagreement in found.disagreements:
        assert disagreement.detail and "`modelship " in disagreement.repair or \
            "modelship stack up" in disagreement.repair


def test_batching_off_says_so() -> None:
    found = truth(replace(GOOD, replicas=on(4, digest=PAUSED, batching=False)))
    (drift,) = found.disagreements
    assert "triton-0, triton-1 serve v4 with dynamic batching off" in drift.detail


def test_a_live_release_changing_the_fleet_is_in_progress_not_an_error() -> None:
    running = record("r9", "running", 4, 5, stages=PROMOTE_STAGES[:8], pid_running=True)
    found = truth(replace(GOOD, replicas=(replica("triton-0", 4, 5), replica("triton-1", 5)),
                          alias=4, records=(running, RELEASED4)))
    assert found.consistent and found.expected is None
    assert found.in_progress is not None and "r9" in found.in_progress
    assert found.processes == {"r9": "alive"}


def test_a_live_release_before_its_swap_still_lets_status_compare() -> None:
    running = record("r9", "running", 4, 5, stages=("resolve", "check"), pid_running=True)
    found = truth(replace(GOOD, alias=3, records=(running, RELEASED4)))
    assert [d.kind for d in found.disagreements] == ["alias"]
    assert found.in_progress is not None and "r9 (v4 -> v5, last stage check)" in \
        found.in_progress


def test_a_live_lock_holder_without_a_record_is_in_progress() -> None:
    lock = LockSeen(True, "-", "reconcile", True, "reconcile - (pid 7 on host-a)")
    found = truth(replace(GOOD, replicas=(replica("triton-0", 4), replica("triton-1")),
                          lock=lock))
    assert found.consistent and found.in_progress == \
        "the release lock is held by reconcile - (pid 7 on host-a)"
    canary = replace(lock, kind="canary")
    assert [d.kind for d in truth(replace(GOOD, replicas=(
        replica("triton-0", 4), replica("triton-1")), lock=canary)).disagreements] == \
        ["fleet_mixed"]  # a canary does not touch the fleet: status still compares


def test_what_was_not_read_is_noted() -> None:
    notes = truth(replace(GOOD, unread=frozenset({"mlflow", "s3"}))).notes
    assert any("MLflow" in n for n in notes) and any("S3" in n for n in notes)
    assert truth(GOOD).notes == ()
    gone = LockSeen(True, "r7", "canary", False, "canary r7 (pid 1 on host-b)")
    assert any("next release takes it over" in n and "modelship unlock m" in n
               for n in truth(replace(GOOD, lock=gone)).notes)


def test_the_expected_version_names_its_source() -> None:
    assert truth(GOOD).expected == Expected(4, "the ledger (release 20260101T000002Z-b, "
                                               "released)")
    assert truth(replace(GOOD, records=())).expected == Expected(4, "the production pin",
                                                                 "pin")


LIVENESS: list[tuple[str, RecordSeen, LockSeen | None, bool, str]] = [
    ("the lock names it and its holder lives",
     record("r9", "running", 4, 5, host="host-b"), LockSeen(True, "r9", "promote", True),
     True, "alive"),
    ("the lock names it and its holder is gone (a recycled pid)",
     record("r9", "running", 4, 5, pid_running=True), LockSeen(True, "r9", "promote", False),
     True, "dead"),
    ("this host, pid alive", record("r9", "running", 4, 5, pid_running=True), None, True,
     "alive"),
    ("this host, pid gone", record("r9", "running", 4, 5, pid_running=False), None, False,
     "dead"),
    ("another host, took the lock, no longer holds it",
     record("r9", "running", 4, 5, host="host-b"), None, True, "dead"),
    ("another host, swap records hold the lock from the start",
     record("r9", "running", 4, 5, host="host-b", kind="swap", stages=()), None, True,
     "dead"),
    ("another host, still checking (never took the lock)",
     record("r9", "running", 4, 5, host="host-b", stages=("resolve", "check")), None, True,
     "unknown"),
    ("another host, the lock store is down", record("r9", "running", 4, 5, host="host-b"),
     None, False, "unknown"),
]


@pytest.mark.parametrize(("case", "seen", "lock", "lock_read", "state"), LIVENESS,
                         ids=[c[0] for c in LIVENESS])
def test_liveness_of_a_running_record(case: str, seen: RecordSeen, lock: LockSeen | None,
                                      lock_read: bool, state: str) -> None:
    assert liveness(seen, here=HERE, lock=lock, lock_read=lock_read) == state


EXPECTED: list[tuple[str, list[RecordSeen], dict[str, str], int | None | str]] = [
    ("released: its version", [RELEASED4], {}, 4),
    ("noop: its version", [record("r", "noop", 4, 4)], {}, 4),
    ("rolled back by its bake: what served before", [record("r", "rolled_back", 3, 4)], {},
     3),
    ("rolled back first release: nothing", [record("r", "rolled_back", None, 4)], {}, None),
    ("failed after the swap: what served before", [record("r", "failed", 3, 4)], {}, 3),
    ("failed before the swap: the older record decides",
     [record("r", "failed", 2, 5, stages=("resolve",)), RELEASED4], {}, 4),
    ("a rollback record that failed: what served before",
     [record("r", "failed", 4, 3, kind="rollback", stages=())], {}, 4),
    ("a dead run past its swap leaves it open",
     [record("r", "running", 4, 5), RELEASED4], {"r": "dead"}, "open"),
    ("an incomplete record leaves it open", [record("r", "incomplete", 4, 5), RELEASED4], {},
     "open"),
    ("a live run is skipped", [record("r", "running", 4, 5), RELEASED4], {"r": "alive"}, 4),
    ("a canary-stage dead run is skipped",
     [record("r", "running", 4, 5, stages=("resolve", "canary")), RELEASED4], {"r": "dead"},
     4),
    ("no records: nothing says", [], {}, "unknown"),
]


@pytest.mark.parametrize(("case", "records", "processes", "want"), EXPECTED,
                         ids=[c[0] for c in EXPECTED])
def test_expected_version_walks_the_ledger(case: str, records: list[RecordSeen],
                                           processes: dict[str, str],
                                           want: int | None | str) -> None:
    expected, unsettled = expected_version(records, processes)  # type: ignore[arg-type]
    if want == "open":
        assert expected is None and unsettled is records[0]
    elif want == "unknown":
        assert expected is None and unsettled is None
    else:
        assert unsettled is None and expected is not None and expected.version == want


def test_record_seen_reads_an_incomplete_records_missing_steps() -> None:
    done = ReleaseRecord(id="r", kind="promote", model="m", status="incomplete",
                         from_version=4, to_version=5,
                         stages=[StageEntry("swap", "t0", outcome="ok")],
                         holder={"host": HERE, "pid": 12})
    done.incomplete = {"goal": "released", "missing": ["alias production -> v5"],
                       "error": "MLflow did not answer"}
    seen = record_seen(done, pid_running=None)
    assert (seen.stages, seen.host, seen.pid) == (("swap",), HERE, 12)
    assert seen.reason == ("goal released; missing: alias production -> v5; MLflow did not "
                           "answer")
    found = truth(replace(GOOD, replicas=on(5), pin=PinSeen(5, SERVING, True),
                          records=(seen, RELEASED4)))
    assert "missing: alias production -> v5" in found.disagreements[0].detail
