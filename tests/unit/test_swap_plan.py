"""The swap plan and its run are pure: tables of fleets and outcomes, no servers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from modelship.errors import PreflightError
from modelship.policy import TritonPolicy
from modelship.triton.model_config import (
    ModelConfig,
    ModelSpec,
    TensorSpec,
    render_model_config,
    serving_digest,
    with_versions,
    without_dynamic_batching,
)
from modelship.triton.swap_plan import (
    Aborted,
    AbortPhase,
    Done,
    ReplicaView,
    RunPhase,
    SwapPlan,
    SwapRun,
    expire,
    next_action,
    plan_swap,
    record,
    replica_states,
    start,
)

MODEL = "fraud"
SPEC = ModelSpec(MODEL, inputs=(TensorSpec("input", "float32", (6,)),),
                 outputs=(TensorSpec("label", "int64", ()),))
P_CONFIG = render_model_config(SPEC, TritonPolicy(), versions=[1])
C_CONFIG = render_model_config(SPEC, TritonPolicy(), versions=[2])
DIGEST = serving_digest(P_CONFIG)
OTHER_DIGEST = serving_digest(without_dynamic_batching(P_CONFIG))
REPLICAS = ("r0", "r1", "r2")


def view(name: str, *versions: int, digest: str | None = DIGEST, live: bool = True,
         problem: str | None = None) -> ReplicaView:
    return ReplicaView(name, live, tuple(versions), digest if versions else None, problem)


def fleet(*versions: int) -> list[ReplicaView]:
    return [view(name, *versions) for name in REPLICAS]


def plan(replicas: list[ReplicaView], *, target: int = 2, pause: bool = True,
         verified: bool = True, production: ModelConfig | None = P_CONFIG) -> SwapPlan:
    return plan_swap(MODEL, replicas, target=target, candidate_config=C_CONFIG,
                     production_config=production, pause_batching=pause,
                     candidate_verified=verified)


def shape(p: SwapPlan) -> list[tuple[str, list[int], bool, int | None, bool]]:
    """(name, specific versions, dynamic batching on, expected version, probe) per phase."""
    rows = []
    for phase in (*p.phases, *([p.abort] if p.abort else [])):
        cfg = phase.config
        versions = list(cfg.version_policy.specific.versions) if cfg else []
        batching = bool(cfg and cfg.HasField("dynamic_batching"))
        rows.append((phase.name, versions, batching, phase.expect_version, phase.probe))
    return rows


# --------------------------------------------------------------------------------------
# planning


KINDS: list[tuple[Any, ...]] = [
    ("every replica already serves the target: nothing to do",
     fleet(2), 2, True, "noop", 2, []),
    ("nothing serves yet: one deploy phase, abort unloads",
     fleet(), 2, True, "first_deploy", None,
     [("deploy", [2], True, 2, True), ("abort", [], False, None, False)]),
    ("swap with batching paused: pause, switch, resume; abort restores P",
     fleet(1), 2, True, "swap", 1,
     [("pause_batching", [1], False, 1, False), ("switch", [2], False, 2, True),
      ("resume_batching", [2], True, 2, False), ("abort", [1], True, 1, True)]),
    ("swap without the pause: one switch with C's full config",
     fleet(1), 2, False, "swap", 1,
     [("switch", [2], True, 2, True), ("abort", [1], True, 1, True)]),
    ("rollback to an older version is a swap like any other",
     fleet(3), 2, False, "swap", 3,
     [("switch", [2], True, 2, True), ("abort", [3], True, 3, True)]),
    ("target served with another config (stuck paused): reconfigured, not a no-op",
     [view(n, 2, digest=OTHER_DIGEST) for n in REPLICAS], 2, False, "swap", 2,
     [("switch", [2], True, 2, True), ("abort", [2], False, 2, True)]),
]


@pytest.mark.parametrize(
    ("case", "replicas", "target", "pause", "kind", "from_version", "phases"),
    KINDS, ids=[c[0] for c in KINDS]
)
def test_plan_kinds_and_phases(case: str, replicas: list[ReplicaView], target: int,
                               pause: bool, kind: str, from_version: int | None,
                               phases: list[tuple[str, list[int], bool, int | None, bool]]
                               ) -> None:
    production = with_versions(P_CONFIG, [from_version]) if from_version else None
    if "stuck" in case:
        production = without_dynamic_batching(with_versions(C_CONFIG, [2]))
    p = plan(replicas, target=target, pause=pause, production=production)
    assert p.kind == kind
    assert p.from_version == from_version and p.to_version == target
    assert p.replicas == REPLICAS
    assert shape(p) == phases
    assert p.describe() and p.to_dict()["kind"] == kind


def test_pause_at_switch_brings_c_up_unbatched_straight_from_p() -> None:
    production = with_versions(P_CONFIG, [1])
    p = plan_swap(MODEL, fleet(1), target=2, candidate_config=C_CONFIG,
                  production_config=production, pause_batching=True, candidate_verified=True,
                  pause_at_switch=True)
    assert shape(p) == [("switch", [2], False, 2, True), ("resume_batching", [2], True, 2, False),
                        ("abort", [1], True, 1, True)]
    # Without pause_batching the option changes nothing.
    plain = plan_swap(MODEL, fleet(1), target=2, candidate_config=C_CONFIG,
                      production_config=production, pause_batching=False,
                      candidate_verified=True, pause_at_switch=True)
    assert shape(plain) == [("switch", [2], True, 2, True), ("abort", [1], True, 1, True)]


def test_noop_needs_no_verified_manifest_because_nothing_changes() -> None:
    assert plan(fleet(2), verified=False).kind == "noop"


def test_phase_configs_are_full_configs_not_patches() -> None:
    p = plan(fleet(1), pause=True)
    switch = p.phases[1].config
    assert switch is not None
    assert [i.name for i in switch.input] == ["input"] and switch.max_batch_size == 32
    assert switch.instance_group and switch.backend == "onnxruntime"
    resume = p.phases[2].config
    assert resume == with_versions(C_CONFIG, [2])


REFUSALS: list[tuple[Any, ...]] = [
    ("a replica is not live",
     [view("r0", 1), view("r1", live=False, problem="connection refused"), view("r2", 1)],
     {}, ["replica r1 is not live: connection refused"]),
    ("replicas disagree on the version",
     [view("r0", 1), view("r1", 2), view("r2", 1)], {},
     ["disagree on the version", "r0 serves v1", "r1 serves v2"]),
    ("a half-done first deploy: some serve nothing",
     [view("r0", 2), view("r1"), view("r2")], {}, ["r1 serves nothing"]),
    ("replicas disagree on the serving digest",
     [view("r0", 1), view("r1", 1, digest=OTHER_DIGEST), view("r2", 1)], {},
     ["different configs", OTHER_DIGEST[:12]]),
    ("a replica serves two versions",
     [view("r0", 1, 2), view("r1", 1), view("r2", 1)], {},
     ["r0 serves 2 versions", "expected exactly one"]),
    ("the candidate did not verify", fleet(1), {"verified": False},
     ["did not verify against its manifest"]),
    ("the candidate did not verify, even for a first deploy", fleet(),
     {"verified": False}, ["did not verify"]),
    ("P's production config is unknown", fleet(1), {"production": None},
     ["production config of fraud/1 is unknown"]),
    ("no replicas at all", [], {}, ["no Triton replicas"]),
    ("not a version number", fleet(1), {"target": 0}, ["target version 0"]),
    ("every surprise at once",
     [view("r0", 1, 2), view("r1", live=False), view("r2", 1, digest=OTHER_DIGEST)],
     {"verified": False},
     ["r1 is not live", "r0 serves 2 versions", "disagree on the version",
      "different configs", "did not verify"]),
]


@pytest.mark.parametrize(
    ("case", "replicas", "kwargs", "fragments"),
    REFUSALS, ids=[c[0] for c in REFUSALS]
)
def test_refusals_list_every_surprise(case: str, replicas: list[ReplicaView],
                                      kwargs: dict[str, object], fragments: list[str]) -> None:
    with pytest.raises(PreflightError) as info:
        plan(replicas, **kwargs)  # type: ignore[arg-type]
    error = info.value
    for fragment in fragments:
        assert fragment in error.message, (fragment, error.message)
    assert error.details["problems"]
    if case == "every surprise at once":
        assert len(error.details["problems"]) == 5
    assert "refused before changing anything" in error.message
    assert error.hint


def test_a_refusal_names_the_candidate_problem_and_the_fix() -> None:
    with pytest.raises(PreflightError) as info:
        plan_swap(MODEL, fleet(1), target=2, candidate_config=C_CONFIG,
                  production_config=P_CONFIG, pause_batching=True, candidate_verified=False,
                  candidate_problem="file model.onnx: missing")
    assert "file model.onnx: missing" in info.value.message
    assert "modelship stage fraud --version 2" in str(info.value.hint)


# --------------------------------------------------------------------------------------
# running

Step = Callable[[SwapRun], SwapRun]


def ok(phase: str, *replicas: str) -> Step:
    def step(run: SwapRun) -> SwapRun:
        for r in replicas or REPLICAS:
            run = record(run, r, phase, True, at=1.0)
        return run
    return step


def fail(phase: str, replica: str, reason: str = "boom") -> Step:
    def step(run: SwapRun) -> SwapRun:
        return record(run, replica, phase, False, reason=reason, at=2.0)
    return step


def timeout(run: SwapRun) -> SwapRun:
    return expire(run, at=60.0)


SWAP = plan(fleet(1), pause=True)


OUTCOMES: list[tuple[Any, ...]] = [
    ("all phases ok: done, every replica on C",
     [ok("pause_batching"), ok("switch"), ok("resume_batching")], "done",
      {r: (2, "resume_batching", True) for r in REPLICAS}),
    ("failure at pause: abort on every replica, back on P",
     [ok("pause_batching", "r0", "r1"), fail("pause_batching", "r2"), ok("abort")],
     "aborted", {r: (1, "abort", True) for r in REPLICAS}),
    ("failure at switch: the replicas that moved go back too",
     [ok("pause_batching"), ok("switch", "r0"), fail("switch", "r1"),
      ok("switch", "r2"), ok("abort")],
     "aborted", {r: (1, "abort", True) for r in REPLICAS}),
    ("failure at resume: C everywhere but the swap is still undone",
     [ok("pause_batching"), ok("switch"), fail("resume_batching", "r0"), ok("abort")],
     "aborted", {r: (1, "abort", True) for r in REPLICAS}),
    ("a timeout in switch: pending replicas time out, then abort",
     [ok("pause_batching"), ok("switch", "r0"), timeout, ok("abort")],
     "aborted", {r: (1, "abort", True) for r in REPLICAS}),
    ("a replica dies mid-switch: its abort fails too and is reported",
     [ok("pause_batching"), ok("switch", "r0", "r2"),
      fail("switch", "r1", "Triton r1 did not answer"), ok("abort", "r0", "r2"),
      fail("abort", "r1", "Triton r1 did not answer")],
     "aborted", {"r0": (1, "abort", True), "r1": (None, "abort", False),
                 "r2": (1, "abort", True)}),
    ("the abort itself times out: the run still ends, naming the replica",
     [ok("pause_batching"), fail("switch", "r0"), ok("abort", "r0", "r1"), timeout],
     "aborted", {"r0": (1, "abort", True), "r1": (1, "abort", True),
                 "r2": (None, "abort", False)}),
]


@pytest.mark.parametrize(
    ("case", "steps", "status", "states"), OUTCOMES, ids=[c[0] for c in OUTCOMES]
)
def test_run_outcomes(case: str, steps: list[Step], status: str,
                      states: dict[str, tuple[int | None, str, bool]]) -> None:
    run = start(SWAP)
    for step in steps:
        run = step(run)
    assert run.status == status
    got = {n: (s.version, s.last_phase, s.ok) for n, s in replica_states(run).items()}
    assert got == states
    action = next_action(run)
    if status == "done":
        assert action == Done()
    else:
        assert isinstance(action, Aborted)
        assert dict(action.states) == replica_states(run)


def test_next_action_walks_the_phases_then_aborts_on_every_replica() -> None:
    run = start(SWAP)
    assert next_action(run) == RunPhase(SWAP.phases[0], REPLICAS)
    run = ok("pause_batching", "r0")(run)
    assert next_action(run) == RunPhase(SWAP.phases[0], ("r1", "r2"))
    run = ok("pause_batching", "r1", "r2")(run)
    assert next_action(run) == RunPhase(SWAP.phases[1], REPLICAS)
    run = fail("switch", "r2", "not ready within 60 s")(run)
    assert run.status == "aborting" and run.failed_phase == "switch"
    assert SWAP.abort is not None
    assert next_action(run) == AbortPhase(SWAP.abort, REPLICAS)
    run = ok("switch", "r0")(run)  # a late outcome of the failed phase is still kept
    run = ok("abort", "r0")(run)
    assert next_action(run) == AbortPhase(SWAP.abort, ("r1", "r2"))
    run = ok("abort", "r1", "r2")(run)
    action = next_action(run)
    assert isinstance(action, Aborted)
    assert action.reason == "switch failed on r2: not ready within 60 s"


def test_abort_bookkeeping_keeps_every_outcome_in_order() -> None:
    run = start(SWAP)
    for step in [ok("pause_batching"), fail("switch", "r1", "boom"), ok("switch", "r0"),
                 ok("abort")]:
        run = step(run)
    assert [(r.replica, r.phase, r.ok) for r in run.records] == [
        ("r0", "pause_batching", True), ("r1", "pause_batching", True),
        ("r2", "pause_batching", True), ("r1", "switch", False), ("r0", "switch", True),
        ("r0", "abort", True), ("r1", "abort", True), ("r2", "abort", True)]
    assert run.first_failure is not None and run.first_failure.reason == "boom"
    states = replica_states(run)
    assert states["r1"].describe() == "r1: restored, serves v1"
    assert states["r1"].to_dict()["version"] == 1


def test_records_are_immutable_updates() -> None:
    run = start(SWAP)
    after = record(run, "r0", "pause_batching", True)
    assert run.records == () and len(after.records) == 1


def test_noop_is_done_at_once() -> None:
    run = start(plan(fleet(2)))
    assert run.status == "done" and next_action(run) == Done()
    assert {s.version for s in replica_states(run).values()} == {2}


def test_first_deploy_failure_unloads_everywhere() -> None:
    run = start(plan(fleet()))
    run = record(run, "r0", "deploy", True)
    run = record(run, "r1", "deploy", False, reason="load failed")
    action = next_action(run)
    assert isinstance(action, AbortPhase) and action.phase.config is None
    for r in REPLICAS:
        run = record(run, r, "abort", True)
    assert {s.version for s in replica_states(run).values()} == {None}
    assert run.status == "aborted"


BUGS: list[tuple[Any, ...]] = [
    ("an unknown replica", [], "pause_batching", "r9"),
    ("a phase out of order", [], "switch", "r0"),
    ("the same outcome twice", [ok("pause_batching", "r0")], "pause_batching", "r0"),
    ("a forward phase while aborting", [fail("pause_batching", "r0")], "switch", "r1"),
    ("anything after the end",
     [ok("pause_batching"), ok("switch"), ok("resume_batching")], "abort", "r0"),
]


@pytest.mark.parametrize(
    ("case", "steps", "phase", "replica"), BUGS, ids=[c[0] for c in BUGS]
)
def test_coordinator_bugs_are_refused(case: str, steps: list[Step], phase: str,
                                      replica: str) -> None:
    run = start(SWAP)
    for step in steps:
        run = step(run)
    with pytest.raises(ValueError):
        record(run, replica, phase, True)


# --------------------------------------------------------------------------------------
# converge: repairing a mixed fleet (issues 8 and 10)


def converge_plan(replicas: list[ReplicaView], *, target: int = 2,
                  verified: bool = True) -> SwapPlan:
    return plan_swap(MODEL, replicas, target=target, candidate_config=C_CONFIG,
                     production_config=P_CONFIG, pause_batching=True,
                     candidate_verified=verified, converge=True)


C_DIGEST = serving_digest(with_versions(C_CONFIG, [2]))
CONVERGE: list[tuple[Any, ...]] = [
    ("a crashed coordinator left r1 on C, the others on P",
     [view("r0", 1), view("r1", 2, digest=C_DIGEST), view("r2", 1)],
     "converge", ("r0", "r1", "r2"), (), "r1 serves v2"),
    ("one replica restarted empty",
     [view("r0", 2, digest=C_DIGEST), view("r1"), view("r2", 2, digest=C_DIGEST)],
     "converge", ("r0", "r1", "r2"), (), "r1 serves nothing"),
    ("one replica serves both versions",
     [view("r0", 1, 2), view("r1", 1), view("r2", 1)],
     "converge", ("r0", "r1", "r2"), (), "r0 serves v1, v2"),
    ("same version, different configs",
     [view("r0", 2, digest=C_DIGEST), view("r1", 2, digest=OTHER_DIGEST),
      view("r2", 2, digest=C_DIGEST)],
     "converge", ("r0", "r1", "r2"), (), "r1 serves v2"),
    ("an unreachable replica is skipped, the reachable ones converge",
     [view("r0", 1), view("r1", live=False, problem="connection refused"), view("r2", 2)],
     "converge", ("r0", "r2"), ("r1",), "r1 unreachable"),
    ("the reachable replicas already serve C: nothing to do, the dead one is skipped",
     [view("r0", 2, digest=C_DIGEST), view("r1", live=False), view("r2", 2, digest=C_DIGEST)],
     "noop", ("r0", "r2"), ("r1",), "every reachable replica already serves v2"),
]


@pytest.mark.parametrize(("case", "replicas", "kind", "touched", "skipped", "said"),
                         CONVERGE, ids=[c[0] for c in CONVERGE])
def test_converge_brings_every_reachable_replica_to_the_target(
        case: str, replicas: list[ReplicaView], kind: str, touched: tuple[str, ...],
        skipped: tuple[str, ...], said: str) -> None:
    p = converge_plan(replicas)
    assert p.kind == kind, case
    assert p.replicas == touched and p.skipped == skipped
    assert any(said in line for line in p.describe()), p.describe()
    if kind == "converge":
        assert "the fleet is mixed" in p.describe()[0]
        assert shape(p) == [("converge", [2], True, 2, True), ("abort", [2], True, 2, True)]
        assert p.phases[0].config == with_versions(C_CONFIG, [2])  # full config, not a patch
        assert p.to_dict()["kind"] == "converge" and p.to_dict()["skipped"] == list(skipped)
        # without converge the same fleet is refused, and the hint says how to converge it
        with pytest.raises(PreflightError) as info:
            plan(replicas)
        assert "--converge" in str(info.value.hint)
        assert f"modelship rollback {MODEL}" in str(info.value.hint)


@pytest.mark.parametrize(("case", "replicas", "kwargs", "fragment"), [
    ("no replica is live", [view("r0", live=False), view("r1", live=False)], {},
     "no replica of fraud is live"),
    ("the candidate did not verify", [view("r0", 1), view("r1", 2)], {"verified": False},
     "did not verify"),
    ("duplicate names", [view("r0", 1), view("r0", 2)], {}, "not unique"),
])
def test_converge_still_refuses_what_it_cannot_repair(
        case: str, replicas: list[ReplicaView], kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PreflightError) as info:
        converge_plan(replicas, **kwargs)
    assert fragment in info.value.message, case


def test_converge_on_a_consistent_fleet_is_the_ordinary_plan() -> None:
    assert converge_plan(fleet(1)) == plan(fleet(1))
    assert converge_plan(fleet()).kind == "first_deploy"


def test_a_converge_run_that_fails_reports_every_replica() -> None:
    p = converge_plan([view("r0", 1), view("r1", 2, digest=C_DIGEST), view("r2", 1)])
    run = record(start(p), "r0", "converge", True)
    run = record(run, "r1", "converge", False, "v2 not ready")
    action = next_action(run)
    assert isinstance(action, AbortPhase) and action.replicas == ("r0", "r1", "r2")
    assert action.phase.config == with_versions(C_CONFIG, [2])
    for name in ("r0", "r1", "r2"):
        run = record(run, name, "abort", name != "r1", "still failing")
    final = next_action(run)
    assert isinstance(final, Aborted)
    assert final.states["r0"].version == 2 and final.states["r1"].ok is False
    assert "ABORT FAILED" in final.states["r1"].describe()
